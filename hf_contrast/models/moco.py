"""MoCo (v2 by default, v3-style cosine momentum and symmetric loss as options) on a timm backbone."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from transformers.utils import logging

from .. import distributed
from .backbone import build_encoder_and_head
from .base import ContrastiveOutput, ContrastivePreTrainedModel
from .configuration import MoCoConfig
from .false_negatives import cancel_negatives, same_instance_mask, support_scores
from .losses import _fp32_normalize, _no_autocast, _with_negatives, contrastive_loss, mask_negatives_
from .queue import NegativeQueue, upgrade_legacy_queue_state
from .split_batch_norm import convert_split_batch_norm, split_batch_norm

logger = logging.get_logger(__name__)


class MoCoModel(ContrastivePreTrainedModel):
    """Momentum Contrast: a query encoder trained by gradient, a key encoder that follows it by EMA,
    and a FIFO queue of keys from earlier steps that serve as negatives.

    Attributes:
        encoder, projector: the query side (trained).
        key_encoder, key_projector: deep copies, ``requires_grad=False``, updated only by
            :meth:`momentum_update`. They run in the same train/eval mode as the query side and
            keep their own BatchNorm running statistics.
        queue: the :class:`~hf_contrast.models.queue.NegativeQueue` (keys ``(queue_size, projection_dim)``,
            their instance ids and entry steps, pointer, fill count), all buffers.
        queue_ptr, queue_filled: the queue's pointer and fill count as host ints.

    Only the filled slots of the queue act as negatives: the forward uses the whole ``(K, D)`` buffer
    with the queue's validity mask (unused slots get ``-inf`` logits), so ``num_negatives`` (a 0-d
    tensor) is the true count, the random vectors the official code starts from never act as negatives
    (on small data they let the queries collapse onto one direction within a few steps), and the
    shapes never change while the queue fills (no recompiles under ``torch.compile``, no host read).
    The forward never mutates the queue: the trainer calls :meth:`enqueue` with ``outputs.queue_keys``
    after the loss.

    No training step without negatives: while the queue is still EMPTY (the first step of a run, or
    after enqueues that were all rejected), each query's negatives are the other images' keys of the
    same step (this process's ``B - 1``, the off-diagonal of ``q @ k.T``), as SimCLR's in-batch
    negatives, instead of nothing (a loss of exactly 0 and a zero gradient). As soon as the queue
    holds any key they stop: every accepted step enqueues at least ``B`` keys, so "any" and "at
    least B" coincide except for a queue smaller than the batch, where "any" keeps the queue's
    semantics. The ``(B, B)`` in-batch block is written into the first ``B`` queue columns with a
    ``torch.where`` on the device-side fill count (those columns are all ``-inf`` while the queue is
    empty), so the logits keep their shape ``(B, 1 + K)`` (``(B, 1 + B)`` for ``K < B``): no host
    read, one graph under ``torch.compile``. ``num_negatives`` counts them. Only in training: in eval
    mode the contrast is against the queue as it is (no negatives before training).
    """

    config_class = MoCoConfig
    method_name = "MoCo"
    in_batch_negatives = False  # the negatives are the queue's keys (the first step's in-batch keys aside)
    encode_keys_normalized = True  # encode_keys gives the keys as queued: the queue monitors can re-encode them

    def __init__(self, config: MoCoConfig):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        self.key_encoder = copy.deepcopy(self.encoder)
        self.key_projector = copy.deepcopy(self.projector)
        if config.shuffle_bn and config.key_bn_splits > 1:  # one-process split-BN, active only in encode_keys
            convert_split_batch_norm(self.key_encoder)
            convert_split_batch_norm(self.key_projector)
        self.freeze_key_side()
        self.queue = NegativeQueue(config.queue_size, config.projection_dim)
        self.register_load_state_dict_pre_hook(
            lambda module, state_dict, prefix, *args: upgrade_legacy_queue_state(state_dict, prefix, module.queue))
        self.post_init()

    @property
    def queue_ptr(self) -> int:
        """The slot the next key is written to (host int; see :class:`~hf_contrast.models.queue.NegativeQueue`)."""
        return self.queue.pointer

    @property
    def queued_views(self) -> int:
        """Keys per image enqueued each step: 2 with ``symmetric_loss`` (both views' keys), else 1."""
        return 2 if self.config.symmetric_loss else 1

    def key_modules(self) -> tuple[torch.nn.Module, ...]:
        return (self.key_encoder, self.key_projector)

    def check_training_setup(self, per_device_batch_size: int, world_size: int) -> None:
        """The base checks, and split-BN's: the batch must split into ``key_bn_splits`` equal sub-batches
        of at least 2 images (one process)."""
        super().check_training_setup(per_device_batch_size, world_size)
        splits = self.config.key_bn_splits if self.config.shuffle_bn and world_size == 1 else 1
        b = per_device_batch_size
        if splits > 1 and (b % splits or b // splits < 2):
            raise ValueError(
                f"per_device_train_batch_size={b} cannot be split into key_bn_splits={splits} equal sub-batches of "
                f"at least 2 images (split-BN on one process): use a batch that is a multiple of {splits} and at "
                f"least {2 * splits}, or key_bn_splits=1.")

    def explain_negatives(self, per_device_batch_size: int | None, world_size: int, negatives: int | None) -> str:
        n, w, queue = per_device_batch_size, world_size, self.config.queue_size
        per_step = None if n is None else n * w * self.queued_views
        text = (f"Each query has 1 positive (the key of its other view) and **{negatives} negatives**: the keys of "
                f"earlier batches held in MoCo's FIFO queue (`queue_size={queue}`), computed by the "
                "momentum key encoder. The count does not depend on the batch size.")
        if per_step and per_step < queue:
            text += (f" Each micro-batch enqueues {per_step} keys (gathered from {w} process(es)), so the "
                     f"queue spans the last {math.ceil(queue / per_step)} micro-batches.")
        elif per_step:
            text += (f" Each micro-batch enqueues {per_step} keys (gathered from {w} process(es)), more than the "
                     "queue holds: it keeps only the newest of them.")
        return text

    def negatives(self) -> torch.Tensor:
        """The filled part of the queue ``(K_filled, D)``, detached (for diagnostics; the forward uses the
        whole buffer with :meth:`NegativeQueue.valid`).

        No copy is needed in the forward: the loss L2-normalises the buffer into a new tensor, which is
        what autograd saves, so enqueuing in place after the loss cannot modify a tensor saved for
        backward (a copy would cost 32 MiB per step at K=65536)."""
        return self.queue.negatives()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))  # (B, D)

    @torch.no_grad()
    def encode_keys(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised keys ``(B, D)`` of images ``(B, C, H, W)``, exactly as training makes them: key
        encoder under no_grad, with shuffle-BN (across processes) or split-BN (one process). In eval mode
        BatchNorm uses its running statistics, so there is nothing to shuffle (and no RNG is drawn)."""
        if not self.config.shuffle_bn or not self.training:
            return F.normalize(self.key_projector(self.key_encoder(x)).float(), dim=1)  # (B, D)
        if distributed.is_distributed():
            x, unshuffle = distributed.batch_shuffle(x)
            k = F.normalize(self.key_projector(self.key_encoder(x)).float(), dim=1)
            return distributed.batch_unshuffle(k, unshuffle)
        # one process: normalise the shuffled keys in S sub-batches (split-BN), in one forward, so that
        # a key's BatchNorm statistics come from a random subset instead of the query's batch
        splits = self.config.key_bn_splits
        if splits == 1:
            return F.normalize(self.key_projector(self.key_encoder(x)).float(), dim=1)  # (B, D)
        perm = torch.randperm(x.shape[0], device=x.device)  # (B,) sub-batch k: rows perm[k * B / S : (k + 1) * B / S]
        with split_batch_norm([self.key_encoder, self.key_projector], splits):
            k = self.key_projector(self.key_encoder(x[perm]))  # (B, D) in shuffled order (x[perm] keeps channels_last)
        return F.normalize(k.float(), dim=1)[torch.argsort(perm)]  # (B, D) back in the query's order

    def forward(self, pixel_values: torch.Tensor, pixel_values_2: torch.Tensor | None = None,
                instance_ids: torch.Tensor | None = None, return_loss: bool = True, **kwargs) -> ContrastiveOutput:
        """Contrast queries of view 1 with keys of view 2 and the queued negatives (arguments as
        :meth:`ContrastivePreTrainedModel.forward`; with ``exclude_same_instance`` the queued keys of a
        query's own image, by ``instance_ids``, are masked).

        Returns:
            :class:`ContrastiveOutput`; ``queue_keys`` / ``queue_instance_ids`` hold this batch's keys
            and ids for :meth:`enqueue` (both views' with ``symmetric_loss``). Both halves of the
            symmetric loss use the same pre-step queue.
        """
        if pixel_values_2 is None:
            raise ValueError("MoCoModel.forward needs two views: pass pixel_values and pixel_values_2")
        queue = (self.queue.keys, self.queue.instance_ids, self.queue.valid())  # (K, D), (K,), (K,) the whole buffer
        stand_in = (self.queue.filled == 0) if self.training else None  # 0-d bool: in-batch negatives on
        q, k, ids = self._query(pixel_values), self.encode_keys(pixel_values_2), instance_ids  # (B, D) each
        halves = 1
        if self.config.symmetric_loss:  # both halves' rows in one (2B, 1 + K) buffer of logits
            q2, k1 = self._query(pixel_values_2), self.encode_keys(pixel_values)
            q, k, halves = torch.cat([q, q2]), torch.cat([k, k1]), 2  # (2B, D): q1 with k2, then q2 with k1
            ids = None if instance_ids is None else torch.cat([instance_ids, instance_ids])
        logits, labels, positive_mask, counts, kept, removed = self._contrast(q, k, *queue, ids, stand_in, halves)
        loss = None
        if return_loss:
            loss = contrastive_loss(logits, labels, self.config.temperature, self.config.tau_plus, positive_mask)
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=q, queue_keys=k,
            num_negatives=counts.float().mean(), negative_counts=kept,
            queue_instance_ids=ids, false_negatives_removed=removed,
        )

    def _logits(self, q, k, negatives, valid, ids, negative_ids, stand_in, halves):
        """Logits ``(A, 1 + K)`` and labels of :func:`~hf_contrast.models.losses.info_nce_logits` for ``A = halves * B``
        queries ``q`` and keys ``k`` ``(A, D)``, in one buffer, with the unused slots and (``ids`` ``(A,)`` not
        None) the queued keys of a query's own image at ``-inf`` in place. With ``stand_in`` (a 0-d bool,
        training) the in-batch block ``q @ k.T / T`` of each half (its ``B`` queries against its ``B`` keys)
        takes columns ``1 .. B`` where ``stand_in`` is True (the queue is then empty: those columns are
        -inf), its diagonal and the keys of the query's own image at -inf, padded with -inf columns to
        ``1 + B`` when ``K < B``. Returns ``(logits, labels, matches (A,) or None, own (halves, B, B) or
        None)``: the same-instance queued keys masked per row, and the in-batch keys masked per half."""
        t, a, size = self.config.temperature, q.shape[0], negatives.shape[0]
        n = a // halves
        with _no_autocast(q):
            q_t = _fp32_normalize(q) / t  # (A, D) scaled by 1/T
            k_n = _fp32_normalize(k)  # (A, D)
            l_pos = (q_t * k_n).sum(1, keepdim=True)  # (A, 1)
            if stand_in is None:
                logits, matches = _with_negatives(q_t, l_pos, negatives, valid, ids, negative_ids)  # (A, 1 + K)
                return logits, torch.zeros(a, dtype=torch.long, device=q.device), matches, None
            # the first min(B, K) queue columns in their own matmul, so the in-batch block can replace them
            # without a copy or a slice of the (A, K) logits in the backward
            head = min(n, size)
            neg = _fp32_normalize(negatives)  # (K, D)
            l_head, l_tail = q_t @ neg[:head].T, q_t @ neg[head:].T  # (A, head), (A, K - head)
            m_head = mask_negatives_(l_head, valid[:head], ids, None if ids is None else negative_ids[:head])
            m_tail = mask_negatives_(l_tail, valid[head:], ids, None if ids is None else negative_ids[head:])
            matches = None if ids is None else m_head + m_tail  # (A,)
            in_batch = torch.bmm(q_t.view(halves, n, -1), k_n.view(halves, n, -1).transpose(1, 2))  # (H, B, B)
            own = torch.eye(n, dtype=torch.bool, device=q.device).expand(halves, n, n)  # (H, B, B) the positive
            if ids is not None:  # and other crops of the query's image
                own = own | same_instance_mask(ids[:n], ids[:n])  # the halves share their ids
            with torch.no_grad():
                in_batch.masked_fill_(own, float("-inf"))
            if head < n:  # a queue smaller than the batch: room for the in-batch block
                l_head = torch.cat([l_head, l_head.new_full((a, n - head), float("-inf"))], dim=1)  # (A, B)
            block = torch.where(stand_in, in_batch.reshape(a, n), l_head)  # (A, B)
            logits = torch.cat([l_pos, block, l_tail], dim=1)  # (A, 1 + max(K, B))
        return logits, torch.zeros(a, dtype=torch.long, device=q.device), matches, own

    def _contrast(self, q, k, negatives, negative_ids, valid, instance_ids, stand_in=None, halves=1):
        """Logits of the query/key pairings ``q``, ``k`` ``(A, D)`` (``halves`` blocks of ``B`` rows) against
        the whole queue buffer ``negatives (K, D)``, its ids ``(K,)`` and validity ``valid (K,)``, with the
        masks of the config; with ``stand_in`` (0-d bool, training) the other images' keys of the step in
        the first ``B`` negative columns while it is True (see the class docstring and :meth:`_logits`).

        Returns ``(logits (A, 1 + K), labels (A,), positive_mask, negatives (A,), kept (A,), removed (A,))``
        (see :func:`~hf_contrast.models.false_negatives.cancel_negatives`); unused queue slots and masked
        in-batch keys are ``-inf`` and not counted. ``positive_mask`` and ``removed`` are None without
        false-negative cancellation."""
        exclude = self.config.exclude_same_instance and instance_ids is not None
        ids = instance_ids.to(negative_ids.device) if exclude else None  # (A,)
        logits, labels, matches, own = self._logits(q, k, negatives, valid, ids, negative_ids, stand_in, halves)
        a, size, width = q.shape[0], negatives.shape[0], logits.shape[1] - 1  # width: max(K, B) in training
        n = a // halves
        if self.config.false_negatives is None:  # counted from the masks written into the logits
            counts = valid.sum() if matches is None else valid.sum() - matches  # () or (A,)
            if stand_in is not None:  # the other images' keys while the queue is empty (then valid.sum() = 0)
                counts = torch.where(stand_in, n - own.sum(-1).reshape(a), counts)  # (A,)
            counts = counts.expand(a)  # (A,)
            return logits, labels, None, counts, counts, None
        invalid = ~valid  # (K,)
        if exclude:  # (A, K) the unused slots and the queued keys of the query's own image
            invalid = invalid | same_instance_mask(ids, negative_ids)
        excluded = F.pad(invalid.expand(a, -1), (1, width - size), value=True)  # (A, 1 + width)
        support = torch.stack([q, k], dim=1)  # (A, 2, D): support = the two views
        scores = support_scores(support, negatives)  # (A, K)
        scores = F.pad(scores, (1, width - scores.shape[1]), value=float("-inf"))  # (A, 1 + width)
        if stand_in is not None:  # in-batch columns: the positive, and other crops of the query's image
            excluded[:, 1 : 1 + n] = torch.where(stand_in, own.reshape(a, n), excluded[:, 1 : 1 + n])
            in_batch = torch.cat([support_scores(support[h * n : (h + 1) * n], k[h * n : (h + 1) * n])
                                  for h in range(halves)])  # (A, B) each half against its own keys
            scores[:, 1 : 1 + n] = torch.where(stand_in, in_batch, scores[:, 1 : 1 + n])
        logits, *masks = cancel_negatives(logits, labels, excluded, scores, self.config)
        return (logits, labels, *masks)
