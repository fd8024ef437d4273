"""SimCLR on a timm backbone: in-batch negatives, gathered across processes."""

from __future__ import annotations

import torch
from timm.layers import convert_sync_batchnorm

from .. import distributed
from .backbone import build_encoder_and_head
from .base import ContrastiveOutput, ContrastivePreTrainedModel
from .configuration import SimCLRConfig
from .false_negatives import cancel_negatives, support_scores
from .losses import contrastive_loss, nt_xent_logits


class SimCLRModel(ContrastivePreTrainedModel):
    """SimCLR: one encoder, both views through it, NT-Xent over all views of the (global) batch.

    With ``gather_distributed`` (default) each process compares its 2N anchors with the 2·N·W views
    of all W processes, gathered with gradient: 2·N·W - 2 negatives per anchor. Without it, each
    process only sees its own batch: 2N - 2 negatives.
    """

    config_class = SimCLRConfig
    method_name = "SimCLR"

    def __init__(self, config: SimCLRConfig):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        if config.sync_batch_norm:  # same parameter and buffer names: checkpoints are unaffected
            self.encoder = convert_sync_batchnorm(self.encoder)
            self.projector = convert_sync_batchnorm(self.projector)
        self.post_init()

    def explain_negatives(self, per_device_batch_size: int | None, world_size: int, negatives: int | None) -> str:
        n, w, k = per_device_batch_size, world_size, negatives
        if n is None:
            return "The per-device batch size was not recorded, so the number of negatives is unknown."
        if self.config.gather_distributed:
            return (f"Each anchor has 1 positive and **{k} negatives = 2·N·W − 2** with N = {n} images per device "
                    f"and W = {w} process(es): the other views of the global batch, gathered from every process "
                    "with gradient (`gather_distributed=True`).")
        text = (f"Each anchor has 1 positive and **{k} negatives = 2·N − 2** with N = {n} images per device: "
                "only the views of its own device's batch (`gather_distributed=False`).")
        if w > 1:
            text += f" The views on the other {w - 1} process(es) were not used as negatives."
        return text

    def forward(
        self,
        pixel_values: torch.Tensor,
        pixel_values_2: torch.Tensor | None = None,
        return_loss: bool = True,
        **kwargs,
    ) -> ContrastiveOutput:
        """NT-Xent over the two views.

        Args:
            pixel_values: first views ``(N, C, H, W)``.
            pixel_values_2: second views ``(N, C, H, W)``.
            return_loss: compute the loss.
        """
        if pixel_values_2 is None:
            raise ValueError("SimCLRModel.forward needs two views: pass pixel_values and pixel_values_2")
        n = pixel_values.shape[0]
        z = self.projector(self.encoder(torch.cat([pixel_values, pixel_values_2])))  # (2N, D): one pass, shared BN stats
        z_a, z_b = z[:n], z[n:]  # (N, D) each
        gather = self.config.gather_distributed and distributed.is_distributed()
        kwargs = {}
        if gather:
            kwargs = dict(
                z_a_all=distributed.gather_with_grad(z_a),  # (N * W, D)
                z_b_all=distributed.gather_with_grad(z_b),
                rank=distributed.rank(),
            )
        logits, labels = nt_xent_logits(z_a, z_b, self.config.temperature, **kwargs)  # (2N, 2M), (2N,)
        positive_mask = counts = kept = removed = None
        if self.config.false_negatives is not None:
            candidates = torch.cat([kwargs.get("z_a_all", z_a), kwargs.get("z_b_all", z_b)])  # (2M, D) the columns
            logits, positive_mask, counts, kept, removed = self._cancel(logits, labels, z_a, z_b, candidates)
        loss = None
        if return_loss:
            loss = contrastive_loss(logits, labels, self.config.temperature, self.config.tau_plus, positive_mask)
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=z,
            num_negatives=logits.shape[1] - 2 if counts is None else counts.float().mean(),
            negative_counts=kept, false_negatives_removed=removed,
        )

    def _cancel(self, logits, labels, z_a, z_b, candidates):
        """False-negative cancellation over the in-batch candidates; the support set of an anchor is
        its image's two views (see :mod:`hf_contrast.models.false_negatives`)."""
        excluded = torch.isneginf(logits)  # (2N, 2M) the anchor itself
        excluded[torch.arange(logits.shape[0], device=logits.device), labels] = True  # and its positive
        support = torch.stack([z_a, z_b], dim=1)  # (N, 2, D)
        scores = support_scores(torch.cat([support, support]), candidates)  # (2N, 2M)
        return cancel_negatives(logits, labels, excluded, scores, self.config)
