"""SimCLR on a timm backbone: in-batch negatives, gathered across processes."""

from __future__ import annotations

import torch
from timm.layers import convert_sync_batchnorm

from . import distributed
from .backbone import build_encoder_and_head
from .configuration import SimCLRConfig
from .losses import contrastive_loss, nt_xent_logits
from .modeling_base import ContrastiveOutput, ContrastivePreTrainedModel


class SimCLRModel(ContrastivePreTrainedModel):
    """SimCLR: one encoder, both views through it, NT-Xent over all views of the (global) batch.

    With ``gather_distributed`` (default) each process compares its 2N anchors with the 2·N·W views
    of all W processes, gathered with gradient: 2·N·W - 2 negatives per anchor. Without it, each
    process only sees its own batch: 2N - 2 negatives.
    """

    config_class = SimCLRConfig

    def __init__(self, config: SimCLRConfig):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        if config.sync_batch_norm:  # same parameter and buffer names: checkpoints are unaffected
            self.encoder = convert_sync_batchnorm(self.encoder)
            self.projector = convert_sync_batchnorm(self.projector)
        self.post_init()

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
        loss = contrastive_loss(logits, labels, self.config.temperature, self.config.tau_plus) if return_loss else None
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=z, num_negatives=logits.shape[1] - 2
        )
