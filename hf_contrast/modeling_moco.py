"""MoCo (v2 by default, v3-style cosine momentum and symmetric loss as options) on a timm backbone."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers.utils import logging

from . import distributed
from .backbone import build_encoder_and_head
from .configuration import MoCoConfig
from .losses import contrastive_loss, info_nce_logits
from .modeling_base import ContrastiveOutput, ContrastivePreTrainedModel
from .momentum import ema_update_, enqueue_
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
        queue: buffer ``(queue_size, projection_dim)`` of L2-normalised keys.
        queue_ptr: 0-d long buffer, the slot the next key is written to (the oldest key).
        queue_filled: 0-d long buffer, how many slots hold real keys (``<= queue_size``).

    Only the filled part of the queue is used as negatives, so ``num_negatives`` is the true count
    and the random vectors the official code starts from never act as negatives (on small data they
    let the queries collapse onto one direction within a few steps). The forward never mutates the
    queue: the trainer calls :meth:`enqueue` with ``outputs.queue_keys`` after the loss.
    """

    config_class = MoCoConfig

    def __init__(self, config: MoCoConfig):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        self.key_encoder = copy.deepcopy(self.encoder)
        self.key_projector = copy.deepcopy(self.projector)
        if config.shuffle_bn and config.key_bn_splits > 1:  # one-process split-BN, active only in encode_keys
            convert_split_batch_norm(self.key_encoder)
            convert_split_batch_norm(self.key_projector)
        self._freeze_key_side()
        queue = F.normalize(torch.randn(config.queue_size, config.projection_dim), dim=1)
        self.register_buffer("queue", queue)
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_filled", torch.zeros((), dtype=torch.long))
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``; the loader materialises fresh parameters, so the key side
        is frozen again afterwards."""
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._freeze_key_side()
        return loaded

    def _freeze_key_side(self) -> None:
        for p in self.key_parameters():
            p.requires_grad_(False)

    def query_parameters(self) -> list[torch.nn.Parameter]:
        return [*self.encoder.parameters(), *self.projector.parameters()]

    def key_parameters(self) -> list[torch.nn.Parameter]:
        return [*self.key_encoder.parameters(), *self.key_projector.parameters()]

    @torch.no_grad()
    def momentum_update(self, momentum: float) -> None:
        """``theta_k <- momentum * theta_k + (1 - momentum) * theta_q`` for every key-side parameter
        (one fused foreach update). Call once per optimizer step; BatchNorm buffers are not averaged."""
        ema_update_(self.key_parameters(), self.query_parameters(), momentum)

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        """Write keys ``(B, D)`` into the queue, FIFO with wrap-around. Keys must be the same on every
        process (gather them first, see :func:`hf_contrast.distributed.gather_no_grad`)."""
        if keys.ndim != 2 or keys.shape[1] != self.queue.shape[1]:
            raise ValueError(f"keys must have shape (B, {self.queue.shape[1]}), got {tuple(keys.shape)}")
        finite = torch.isfinite(keys).all(dim=1)  # (B,)
        if not bool(finite.all()):  # never let NaN/inf into the queue: it would poison every later loss
            logger.warning(f"Dropping {int((~finite).sum())} of {keys.shape[0]} keys that are NaN or inf")
            keys = keys[finite]
        enqueue_(self.queue, self.queue_ptr, F.normalize(keys.float(), dim=1))
        self.queue_filled.clamp_(min=0).add_(keys.shape[0]).clamp_(max=self.queue.shape[0])

    def negatives(self) -> torch.Tensor:
        """The filled part of the queue ``(K_filled, D)``, detached.

        No copy is needed: the loss L2-normalises it into a new tensor, which is what autograd saves,
        so enqueuing in place after the loss cannot modify a tensor saved for backward (a copy would
        cost 32 MiB per step at K=65536)."""
        return self.queue[: int(self.queue_filled)].detach()

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))  # (B, D)

    @torch.no_grad()
    def encode_keys(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised keys ``(B, D)`` of images ``(B, C, H, W)``, exactly as training makes them: key
        encoder under no_grad, with shuffle-BN (across processes) or split-BN (one process)."""
        if not self.config.shuffle_bn:
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
        perm = torch.randperm(x.shape[0], device=x.device)  # (B,) sub-batch k holds rows perm[k::S]
        with split_batch_norm([self.key_encoder, self.key_projector], splits):
            k = self.key_projector(self.key_encoder(x[perm]))  # (B, D) in shuffled order
        return F.normalize(k.float(), dim=1)[torch.argsort(perm)]  # (B, D) back in the query's order

    def forward(
        self,
        pixel_values: torch.Tensor,
        pixel_values_2: torch.Tensor | None = None,
        return_loss: bool = True,
        **kwargs,
    ) -> ContrastiveOutput:
        """Contrast queries of view 1 with keys of view 2 and the queued negatives.

        Args:
            pixel_values: first views ``(B, C, H, W)``.
            pixel_values_2: second views ``(B, C, H, W)``; required for the loss.
            return_loss: compute the InfoNCE loss.

        Returns:
            :class:`ContrastiveOutput`; ``keys`` holds this batch's keys for :meth:`enqueue`
            (both views' keys with ``symmetric_loss``).
        """
        if pixel_values_2 is None:
            raise ValueError("MoCoModel.forward needs two views: pass pixel_values and pixel_values_2")
        negatives = self.negatives()  # (K, D)
        t = self.config.temperature
        q1 = self._query(pixel_values)  # (B, D)
        k2 = self.encode_keys(pixel_values_2)  # (B, D)
        logits, labels = info_nce_logits(q1, k2, negatives, t)  # (B, 1 + K), (B,)
        embeddings, keys = q1, k2
        if self.config.symmetric_loss:
            q2 = self._query(pixel_values_2)
            k1 = self.encode_keys(pixel_values)
            logits_2, labels_2 = info_nce_logits(q2, k1, negatives, t)
            logits, labels = torch.cat([logits, logits_2]), torch.cat([labels, labels_2])  # (2B, 1 + K)
            embeddings, keys = torch.cat([q1, q2]), torch.cat([k2, k1])
        loss = contrastive_loss(logits, labels, t, self.config.tau_plus) if return_loss else None
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=embeddings, queue_keys=keys,
            num_negatives=negatives.shape[0],
        )
