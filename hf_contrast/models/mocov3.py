"""MoCo v3 on a timm backbone: momentum encoder, in-batch keys gathered over processes, a predictor;
optionally (``queue_size > 0``) a FIFO queue of earlier keys as extra negatives."""

from __future__ import annotations

import copy
import math
import os

import torch
import torch.nn.functional as F
from timm.layers import convert_sync_batchnorm
from torch import nn

from .. import distributed
from .backbone import ProjectionHead, build_encoder_and_head
from .base import ContrastiveOutput, ContrastivePreTrainedModel
from .configuration import MoCoV3Config
from .false_negatives import cancel_negatives, same_instance_mask, support_scores
from .losses import _fp32_normalize, _no_autocast, _with_negatives, contrastive_loss
from .queue import NegativeQueue

SYNC_BATCH_NORM_DEVICES = ("cuda", "xpu", "hpu")  # where torch's SyncBatchNorm runs across processes


def resolve_sync_batch_norm(setting: bool | None) -> bool:
    """``MoCoV3Config.sync_batch_norm``: True/False as given; None: on when more than one process runs
    (an initialised process group of world size > 1, or torchrun's ``WORLD_SIZE`` > 1 before it is)
    on an accelerator SyncBatchNorm supports (CUDA, XPU, HPU), as the official ``main_moco.py``;
    off on one process and on CPU-only process groups (gloo), where SyncBatchNorm cannot run."""
    if setting is not None:
        return setting
    processes = max(distributed.world_size(), int(os.environ.get("WORLD_SIZE", "1")))
    accelerator = torch.accelerator.current_accelerator()
    return processes > 1 and accelerator is not None and accelerator.type in SYNC_BATCH_NORM_DEVICES


class MoCoV3Model(ContrastivePreTrainedModel):
    """MoCo v3 (facebookresearch/moco-v3 ``moco/builder.py``), one forward per crop as there.

    ``q = predictor(projector(encoder(x)))`` for both views; the momentum side makes
    ``k = momentum_projector(momentum_encoder(x))`` under no_grad; the loss is
    ``ctr(q1, k2) + ctr(q2, k1)`` with ``ctr`` of :func:`hf_contrast.models.losses.mocov3_loss`: each local
    query against the keys of the whole batch gathered over all processes (no gradient), labels
    offset by the rank, cross-entropy times ``2T``. ``N * W - 1`` negatives per query.

    With ``config.queue_size = K > 0`` (not in the official code) the model also owns MoCo v2's
    :class:`~hf_contrast.models.queue.NegativeQueue` at ``queue``: each ``ctr`` appends the ``K_filled``
    queued keys as extra negative columns (``N * W - 1 + K_filled`` negatives), both halves against
    the queue of before the step; the forward returns the keys of both views as ``queue_keys`` and
    the trainer enqueues them, gathered, once per micro-batch (``2 * N * W`` keys).

    Attributes:
        encoder, projector, predictor: the query side (trained).
        sync_batch_norm: whether the BatchNorm layers of both sides were converted to SyncBatchNorm
            (``config.sync_batch_norm`` resolved by :func:`resolve_sync_batch_norm`).
        momentum_encoder, momentum_projector: deep copies of encoder and projector,
            ``requires_grad=False``, moved only by :meth:`momentum_update` (the predictor has no
            momentum copy). They run in the same train/eval mode as the query side and keep their own
            BatchNorm running statistics.
        queue: only with ``queue_size > 0``: keys ``(queue_size, projection_dim)``, instance ids, entry
            steps, pointer and fill count, all buffers (the layout of :class:`~hf_contrast.MoCoModel`).

    The one difference from the official code: there ``forward(x1, x2, m)`` applies the EMA at the
    start of every step; here :class:`~hf_contrast.MomentumCallback` applies it once per optimizer
    step, right after it, with the momentum of the NEXT iteration. Both give the momentum encoder the
    same weights at every forward (tests/test_mocov3.py checks the trajectory); ours also holds under
    gradient accumulation, where a forward per micro-batch would update several times per step.
    """

    config_class = MoCoV3Config
    method_name = "MoCo v3"
    momentum_schedule_offset = 1  # MomentumCallback: the update after step i uses m_{i+1} (see above)

    def __init__(self, config: MoCoV3Config):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        self.predictor = ProjectionHead(
            config.projection_dim, config.predictor_hidden_dim, config.projection_dim, config.predictor_layers,
            config.predictor_batch_norm, config.predictor_output_batch_norm, output_bias=False,
        )
        self.sync_batch_norm = resolve_sync_batch_norm(config.sync_batch_norm)
        if self.sync_batch_norm:  # before the momentum copies: both sides SyncBatchNorm, names unchanged
            self.encoder, self.projector, self.predictor = (
                convert_sync_batchnorm(m) for m in (self.encoder, self.projector, self.predictor))
        self.momentum_encoder = copy.deepcopy(self.encoder)
        self.momentum_projector = copy.deepcopy(self.projector)
        self.freeze_key_side()
        if config.queue_size > 0:  # no attribute at all without one: monitors and the trainer ask for `queue`
            self.queue = NegativeQueue(config.queue_size, config.projection_dim)
        self.post_init()

    @property
    def queued_views(self) -> int:
        """Both views' keys enter the queue (when there is one)."""
        return 2

    def freeze_key_side(self) -> None:
        """The momentum side, and with ``freeze_patch_embed`` the patch projection (as the official ViT recipe)."""
        super().freeze_key_side()
        if self.config.freeze_patch_embed:
            proj = getattr(getattr(self.encoder, "patch_embed", None), "proj", None)
            if not isinstance(proj, nn.Module):
                raise ValueError(
                    f"freeze_patch_embed=True needs a backbone with a patch projection (patch_embed.proj, as timm's "
                    f"ViTs), but backbone={self.config.backbone!r} has none: use freeze_patch_embed=False."
                )
            for p in proj.parameters():
                p.requires_grad_(False)

    @property
    def loss_scale(self) -> float:
        """``loss = loss_scale * mean cross-entropy``: 2T per ``ctr`` term, two terms. With no signal the
        loss sits at ``loss_scale * ln(N * W)``."""
        return 4.0 * self.config.temperature

    def key_modules(self) -> tuple[nn.Module, ...]:
        """The momentum encoder and projector; they follow the encoder and projector (not the predictor)."""
        return (self.momentum_encoder, self.momentum_projector)

    def explain_negatives(self, per_device_batch_size: int | None, world_size: int, negatives: int | None) -> str:
        n, w, k = per_device_batch_size, world_size, negatives
        if n is None:
            return "The per-device batch size was not recorded, so the number of negatives is unknown."
        queue = self.config.queue_size
        if self.config.gather_distributed:
            text = (f"Each query has 1 positive (the momentum encoder's key of its other view) and **{k} "
                    "negatives**: in-batch keys of the momentum encoder, gathered over W processes: N*W - 1 "
                    + (f"+ K negatives, with K = {queue} queued keys, " if queue else "negatives, with ")
                    + f"N = {n} images per device and W = {w} process(es). Keys are gathered without gradient"
                    + ("." if queue else "; there is no queue."))
        else:
            text = (f"Each query has 1 positive and **{k} negatives = N - 1"
                    + (" + K" if queue else "") + f"** with N = {n} images per device"
                    + (f" and K = {queue} queued keys" if queue else "") + ": the momentum encoder's keys of "
                    "its own device's batch (`gather_distributed=False`)" + (" and the queue." if queue else "."))
            if w > 1:
                text += (f" The keys on the other {w - 1} process(es) were not used"
                         + (" as in-batch negatives (they do enter the queue)." if queue else "."))
        if queue:
            per_step = 2 * n * w
            text += (" The queue (not in the official MoCo v3) holds "
                     f"the keys of both views of earlier batches, {per_step} entering per micro-batch (gathered "
                     f"from {w} process(es)), so it spans the last {math.ceil(queue / per_step)} micro-batches.")
        return text

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.encoder(x)))  # (N, D)

    @torch.no_grad()
    def encode_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The momentum encoder's keys ``(N, D)`` of images ``(N, C, H, W)``, not normalised, not gathered."""
        return self.momentum_projector(self.momentum_encoder(x))  # (N, D)

    def forward(self, pixel_values: torch.Tensor, pixel_values_2: torch.Tensor | None = None,
                instance_ids: torch.Tensor | None = None, return_loss: bool = True, **kwargs) -> ContrastiveOutput:
        """``ctr(q1, k2) + ctr(q2, k1)`` (arguments as :meth:`ContrastivePreTrainedModel.forward`;
        ``instance_ids`` matter only with a queue and ``exclude_same_instance``).

        Returns:
            :class:`ContrastiveOutput` with logits ``(2N, M + K)`` (queries of view 1, then of view 2,
            against the gathered keys of the other view, then the whole queue buffer of ``K = queue_size``
            slots, unused ones ``-inf``; ``K = 0`` without a queue), labels ``(2N,)``, the queries as
            ``embeddings`` and ``num_negatives = M - 1`` (an int; ``M = N * W`` gathered, else ``N``)
            without a queue or masks. With a queue or ``false_negatives`` the masked logits (unused slots,
            same-instance queued keys, cancelled candidates) are ``-inf``, ``num_negatives`` is a 0-d tensor,
            the mean per query after masking (``M - 1 + K_filled`` when nothing else is masked), and
            ``negative_counts`` (and with cancellation ``false_negatives_removed``) are ``(2N,)``. With a
            queue, ``queue_keys`` ``(2N, D)`` holds this process's normalised keys of view 2, then view 1,
            for :meth:`enqueue`, and ``queue_instance_ids`` ``(2N,)`` their ids.
        """
        if pixel_values_2 is None:
            raise ValueError("MoCoV3Model.forward needs two views: pass pixel_values and pixel_values_2")
        q1, q2 = self._query(pixel_values), self._query(pixel_values_2)  # (N, D) each, two batches as official
        k1, k2 = self.encode_keys(pixel_values), self.encode_keys(pixel_values_2)  # (N, D) each
        k1_local, k2_local = k1, k2
        gather = self.config.gather_distributed and distributed.is_distributed()
        if gather:
            k1, k2 = distributed.gather_no_grad(k1), distributed.gather_no_grad(k2)  # (N * W, D) in rank order
        rank = distributed.rank() if gather else 0
        queue = queue_ids = valid = None
        if self.has_queue:  # the whole buffer of before this step, for both halves; unused slots masked
            queue, queue_ids, valid = self.queue.keys, self.queue.instance_ids, self.queue.valid()  # (K, D), (K,), (K,)
        ids = None if instance_ids is None else torch.cat([instance_ids, instance_ids])  # (2N,) both halves
        own_keys = torch.cat([k2_local, k1_local])  # (2N, D) each query's positive key: the FNC support
        logits, labels, positive_mask, counts, kept, removed = self._contrast(
            torch.cat([q1, q2]), (k2, k1), own_keys, rank, queue, queue_ids, valid, ids)  # (2N, M + K), (2N,)
        loss = None
        if return_loss:  # ctr(q1, k2) + ctr(q2, k1), each times 2T as the official code: the mean of 2N rows times 4T
            t = self.config.temperature
            loss = contrastive_loss(logits, labels, t, self.config.tau_plus, positive_mask) * (4 * t)
        queue_keys = queue_key_ids = None
        if self.has_queue:  # this process's keys of view 2, then view 1; the trainer gathers and enqueues them
            queue_keys = F.normalize(own_keys.float(), dim=1)  # (2N, D)
            queue_key_ids = ids  # (2N,)
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=torch.cat([q1, q2]), queue_keys=queue_keys,
            num_negatives=k1.shape[0] - 1 if counts is None else counts.float().mean(),
            negative_counts=kept, queue_instance_ids=queue_key_ids, false_negatives_removed=removed,
        )

    def _contrast(self, q, keys, k_own, rank, queue=None, queue_ids=None, valid=None, instance_ids=None):
        """Both ``ctr``'s logits ``(2N, M + K)`` in one buffer and labels ``(2N,)``: local queries ``q (2N, D)``
        (view 1's, then view 2's), half ``h`` against the gathered keys ``keys[h] (M, D)`` of the other view,
        all against the whole queue buffer ``queue (K, D)`` (``K = 0`` when None) whose unused slots
        (``valid (K,)`` False) are ``-inf`` and not counted, with the masks the config asks for: the
        queued keys of a query's own image (``exclude_same_instance``, ids ``queue_ids (K,)`` against
        ``instance_ids (2N,)``; written into the logits in place) and false-negative cancellation over
        in-batch and queued keys. The support set of a query is the query and its own key
        ``k_own (2N, D)``, as in MoCo (see :mod:`hf_contrast.models.false_negatives`).
        Returns ``(logits, labels, positive_mask, negatives, kept, removed)``; the last four are None
        without a queue and without cancellation (``positive_mask`` and ``removed`` without cancellation)."""
        exclude = self.config.exclude_same_instance and queue is not None and instance_ids is not None
        ids = instance_ids.to(queue_ids.device) if exclude else None  # (2N,)
        n, m = q.shape[0] // 2, keys[0].shape[0]
        with _no_autocast(q):
            q_t = _fp32_normalize(q) / self.config.temperature  # (2N, D) scaled by 1/T
            logits = torch.cat([q_t[h * n : (h + 1) * n] @ _fp32_normalize(keys[h]).T for h in range(2)])  # (2N, M)
            matches = None
            if queue is not None:
                logits, matches = _with_negatives(q_t, logits, queue, valid, ids, queue_ids)  # (2N, M + K)
        labels = (torch.arange(n, device=q.device) + rank * n).repeat(2)  # (2N,) this process's images among the M
        if self.config.false_negatives is None:
            if queue is None:
                return logits, labels, None, None, None, None
            counts = valid.sum() + (m - 1)  # () the other in-batch keys and the filled slots
            counts = (counts if matches is None else counts - matches).expand(2 * n)  # (2N,)
            return logits, labels, None, counts, counts, None
        excluded = torch.zeros_like(logits, dtype=torch.bool)  # (2N, M + K)
        excluded.scatter_(1, labels.unsqueeze(1), True)  # the positive
        if queue is not None:  # unused slots, and the queued keys of the query's own image (in-batch keys are not)
            invalid = ~valid  # (K,)
            if exclude:
                invalid = invalid | same_instance_mask(ids, queue_ids)  # (2N, K)
            excluded[:, m:] = invalid
        support = torch.stack([q, k_own], dim=1)  # (2N, 2, D)
        scores = torch.cat([support_scores(support[h * n : (h + 1) * n],
                                           keys[h] if queue is None else torch.cat([keys[h], queue]))
                            for h in range(2)])  # (2N, M + K)
        logits, positive_mask, negatives, kept, removed = cancel_negatives(logits, labels, excluded, scores,
                                                                           self.config)
        return logits, labels, positive_mask, negatives, kept, removed
