"""MoCo (v2 by default, v3-style cosine momentum and symmetric loss as options) on a timm backbone."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from transformers.utils import logging

from . import distributed
from .backbone import build_encoder_and_head
from .configuration import MoCoConfig
from .false_negatives import cancel_negatives, same_instance_mask, support_scores
from .losses import _fp32_normalize, _no_autocast, contrastive_loss, info_nce_logits
from .modeling_base import ContrastiveOutput, ContrastivePreTrainedModel
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
        queue: the :class:`~hf_contrast.queue.NegativeQueue` (keys ``(queue_size, projection_dim)``,
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
        """The slot the next key is written to (host int; see :class:`~hf_contrast.queue.NegativeQueue`)."""
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

    def forward(
        self,
        pixel_values: torch.Tensor,
        pixel_values_2: torch.Tensor | None = None,
        instance_ids: torch.Tensor | None = None,
        return_loss: bool = True,
        **kwargs,
    ) -> ContrastiveOutput:
        """Contrast queries of view 1 with keys of view 2 and the queued negatives.

        Args:
            pixel_values: first views ``(B, C, H, W)``.
            pixel_values_2: second views ``(B, C, H, W)``; required for the loss.
            instance_ids: ``(B,)`` long, the dataset index of each image; with
                ``exclude_same_instance`` the queued keys of a query's own image are masked, and the
                ids go into the queue with the keys. ``None``: unknown (nothing masked).
            return_loss: compute the loss.

        Returns:
            :class:`ContrastiveOutput`; ``queue_keys`` / ``queue_instance_ids`` hold this batch's keys
            and ids for :meth:`enqueue` (both views' with ``symmetric_loss``). Both halves of the
            symmetric loss use the same pre-step queue.
        """
        if pixel_values_2 is None:
            raise ValueError("MoCoModel.forward needs two views: pass pixel_values and pixel_values_2")
        queue = (self.queue.keys, self.queue.instance_ids, self.queue.valid())  # (K, D), (K,), (K,) the whole buffer
        stand_in = (self.queue.filled == 0) if self.training else None  # 0-d bool: in-batch negatives on
        q1 = self._query(pixel_values)  # (B, D)
        k2 = self.encode_keys(pixel_values_2)  # (B, D)
        halves = [self._contrast(q1, k2, *queue, instance_ids, stand_in)]
        embeddings, keys, ids = q1, k2, instance_ids
        if self.config.symmetric_loss:
            q2 = self._query(pixel_values_2)
            k1 = self.encode_keys(pixel_values)
            halves.append(self._contrast(q2, k1, *queue, instance_ids, stand_in))
            embeddings, keys = torch.cat([q1, q2]), torch.cat([k2, k1])  # (2B, D)
            ids = None if instance_ids is None else torch.cat([instance_ids, instance_ids])
        logits, labels, positive_mask, counts, kept, removed = (
            None if any(h[i] is None for h in halves) else torch.cat([h[i] for h in halves]) for i in range(6))
        loss = None
        if return_loss:
            loss = contrastive_loss(logits, labels, self.config.temperature, self.config.tau_plus, positive_mask)
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=embeddings, queue_keys=keys,
            num_negatives=counts.float().mean(), negative_counts=kept,
            queue_instance_ids=ids, false_negatives_removed=removed,
        )

    def _logits(self, q, k, negatives, valid, stand_in):
        """Logits ``(B, 1 + K)`` and labels of :func:`~hf_contrast.losses.info_nce_logits`; with
        ``stand_in`` (a 0-d bool, training) the in-batch block ``q @ k.T / T`` replaces columns
        ``1 .. B`` where ``stand_in`` is True and off the diagonal (the queue is then empty: those
        columns are -inf), padded with -inf columns to ``1 + B`` when ``K < B``. Returns
        ``(logits, labels, in_batch_masked (B, B) or None)``."""
        t = self.config.temperature
        logits, labels = info_nce_logits(q, k, negatives, t, valid)  # (B, 1 + K), (B,)
        if stand_in is None:
            return logits, labels, None
        n = q.shape[0]
        if negatives.shape[0] < n:  # a queue smaller than the batch: room for the in-batch block
            logits = F.pad(logits, (0, n - negatives.shape[0]), value=float("-inf"))  # (B, 1 + B)
        with _no_autocast(q):
            in_batch = _fp32_normalize(q) @ _fp32_normalize(k).T / t  # (B, B)
        masked = torch.eye(n, dtype=torch.bool, device=q.device) | ~stand_in  # (B, B) the positive; all once queued
        logits[:, 1 : 1 + n] = torch.where(masked, logits[:, 1 : 1 + n], in_batch)  # (B, B) block of the logits
        return logits, labels, masked

    def _contrast(self, q, k, negatives, negative_ids, valid, instance_ids, stand_in=None):
        """Logits of one query/key pairing against the whole queue buffer ``negatives (K, D)``, its ids
        ``(K,)`` and validity ``valid (K,)``, with the masks of the config; with ``stand_in`` (0-d bool,
        training) the other images' keys of the step in the first ``B`` negative columns while it is
        True (see the class docstring and :meth:`_logits`).

        Returns ``(logits (B, 1 + K), labels (B,), positive_mask, negatives (B,), kept (B,), removed (B,))``
        (see :func:`~hf_contrast.false_negatives.cancel_negatives`); unused queue slots and masked
        in-batch keys are ``-inf`` and not counted. ``positive_mask`` and ``removed`` are None without
        false-negative cancellation."""
        logits, labels, in_batch_masked = self._logits(q, k, negatives, valid, stand_in)
        n, width = q.shape[0], logits.shape[1] - 1  # width: max(K, B) in training with K < B, else K
        exclude = self.config.exclude_same_instance and instance_ids is not None
        if not exclude and self.config.false_negatives is None:  # only the unused slots are masked
            counts = valid.sum()  # 0-d
            if stand_in is not None:
                counts = counts + stand_in * (n - 1)  # the other images' keys while the queue is empty
            counts = counts.expand(n)  # (B,) a view of the 0-d count
            return logits, labels, None, counts, counts, None
        invalid = ~valid  # (K,)
        if exclude:  # (B, K) the unused slots and the queued keys of the query's own image
            ids = instance_ids.to(negative_ids.device)
            invalid = invalid | same_instance_mask(ids, negative_ids)
        excluded = F.pad(invalid.expand(n, -1), (1, width - invalid.shape[-1]), value=True)  # (B, 1 + width)
        if in_batch_masked is not None:  # in-batch columns: the positive, and other crops of the query's image
            own = in_batch_masked | same_instance_mask(ids, ids) if exclude else in_batch_masked  # (B, B)
            excluded[:, 1 : 1 + n] = torch.where(stand_in, own, excluded[:, 1 : 1 + n])
        scores = None
        if self.config.false_negatives is not None:
            support = torch.stack([q, k], dim=1)  # (B, 2, D): support = the two views
            scores = support_scores(support, negatives)  # (B, K)
            scores = F.pad(scores, (1, width - scores.shape[1]), value=float("-inf"))  # (B, 1 + width)
            if in_batch_masked is not None:
                scores[:, 1 : 1 + n] = torch.where(stand_in, support_scores(support, k), scores[:, 1 : 1 + n])
        logits, *masks = cancel_negatives(logits, labels, excluded, scores, self.config)
        return (logits, labels, *masks)
