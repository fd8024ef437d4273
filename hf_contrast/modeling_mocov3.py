"""MoCo v3 on a timm backbone: momentum encoder, in-batch keys gathered over processes, a predictor."""

from __future__ import annotations

import copy

import torch
from torch import nn

from . import distributed
from .backbone import ProjectionHead, build_encoder_and_head
from .configuration import MoCoV3Config
from .false_negatives import cancel_negatives, support_scores
from .losses import contrastive_loss, mocov3_logits
from .modeling_base import ContrastiveOutput, ContrastivePreTrainedModel
from .momentum import ema_update_


class MoCoV3Model(ContrastivePreTrainedModel):
    """MoCo v3 (facebookresearch/moco-v3 ``moco/builder.py``), one forward per crop as there.

    ``q = predictor(projector(encoder(x)))`` for both views; the momentum side makes
    ``k = momentum_projector(momentum_encoder(x))`` under no_grad; the loss is
    ``ctr(q1, k2) + ctr(q2, k1)`` with ``ctr`` of :func:`hf_contrast.losses.mocov3_loss`: each local
    query against the keys of the whole batch gathered over all processes (no gradient), labels
    offset by the rank, cross-entropy times ``2T``. ``N * W - 1`` negatives per query.

    Attributes:
        encoder, projector, predictor: the query side (trained).
        momentum_encoder, momentum_projector: deep copies of encoder and projector,
            ``requires_grad=False``, moved only by :meth:`momentum_update` (the predictor has no
            momentum copy). They run in the same train/eval mode as the query side and keep their own
            BatchNorm running statistics.

    The one difference from the official code: there ``forward(x1, x2, m)`` applies the EMA at the
    start of every step; here :class:`~hf_contrast.MomentumCallback` applies it once per optimizer
    step, right after it, with the momentum of the NEXT iteration. Both give the momentum encoder the
    same weights at every forward (tests/test_mocov3.py checks the trajectory); ours also holds under
    gradient accumulation, where a forward per micro-batch would update several times per step.
    """

    config_class = MoCoV3Config
    momentum_schedule_offset = 1  # MomentumCallback: the update after step i uses m_{i+1} (see above)

    def __init__(self, config: MoCoV3Config):
        super().__init__(config)
        self.encoder, self.projector = build_encoder_and_head(config)
        self.predictor = ProjectionHead(
            config.projection_dim, config.predictor_hidden_dim, config.projection_dim, config.predictor_layers,
            config.predictor_batch_norm, config.predictor_output_batch_norm, output_bias=False,
        )
        self.momentum_encoder = copy.deepcopy(self.encoder)
        self.momentum_projector = copy.deepcopy(self.projector)
        self._freeze()
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``; the loader materialises fresh parameters, so the momentum
        side (and a frozen patch projection) is frozen again afterwards."""
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._freeze()
        return loaded

    def _freeze(self) -> None:
        for p in self.key_parameters():
            p.requires_grad_(False)
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

    def query_parameters(self) -> list[torch.nn.Parameter]:
        """Encoder and projector: the parameters the momentum side follows (not the predictor)."""
        return [*self.encoder.parameters(), *self.projector.parameters()]

    def key_parameters(self) -> list[torch.nn.Parameter]:
        return [*self.momentum_encoder.parameters(), *self.momentum_projector.parameters()]

    @torch.no_grad()
    def momentum_update(self, momentum: float) -> None:
        """``theta_k <- momentum * theta_k + (1 - momentum) * theta_q`` for every momentum-side parameter
        (one fused foreach update), as :meth:`hf_contrast.MoCoModel.momentum_update`. Call once per
        optimizer step; BatchNorm buffers are not averaged."""
        ema_update_(self.key_parameters(), self.query_parameters(), momentum)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.encoder(x)))  # (N, D)

    @torch.no_grad()
    def encode_keys(self, x: torch.Tensor) -> torch.Tensor:
        """The momentum encoder's keys ``(N, D)`` of images ``(N, C, H, W)``, not normalised, not gathered."""
        return self.momentum_projector(self.momentum_encoder(x))  # (N, D)

    def forward(
        self,
        pixel_values: torch.Tensor,
        pixel_values_2: torch.Tensor | None = None,
        return_loss: bool = True,
        **kwargs,
    ) -> ContrastiveOutput:
        """``ctr(q1, k2) + ctr(q2, k1)``.

        Args:
            pixel_values: first views ``(N, C, H, W)``.
            pixel_values_2: second views ``(N, C, H, W)``.
            return_loss: compute the loss.

        Returns:
            :class:`ContrastiveOutput` with logits ``(2N, M)`` (queries of view 1, then of view 2, against
            the gathered keys of the other view), labels ``(2N,)``, the queries as ``embeddings`` and
            ``num_negatives = M - 1`` (``M = N * W`` gathered, else ``N``). With ``false_negatives``
            the cancelled logits are ``-inf`` (eliminate), ``num_negatives`` is the mean per query
            after cancellation, and ``negative_counts`` / ``false_negatives_removed`` are ``(2N,)``.
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
        halves = [self._contrast(q1, k2_local, k2, rank), self._contrast(q2, k1_local, k1, rank)]
        loss = None
        if return_loss:  # ctr(q1, k2) + ctr(q2, k1), each times 2T as the official code
            t = self.config.temperature
            loss = sum(contrastive_loss(logits, labels, t, self.config.tau_plus, positive_mask) * (2 * t)
                       for logits, labels, positive_mask, *_ in halves)
        logits, labels = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])  # (2N, M), (2N,)
        counts = kept = removed = None
        if self.config.false_negatives is not None:
            counts, kept, removed = (torch.cat([h[i] for h in halves]) for i in (3, 4, 5))  # (2N,) each
        return ContrastiveOutput(
            loss=loss, logits=logits, labels=labels, embeddings=torch.cat([q1, q2]),
            num_negatives=k1.shape[0] - 1 if counts is None else counts.float().mean(),
            negative_counts=kept, false_negatives_removed=removed,
        )

    def _contrast(self, q, k_own, keys, rank):
        """``ctr(q, k)``'s logits ``(N, M)`` and labels ``(N,)`` of local queries ``q (N, D)`` against
        the gathered keys ``(M, D)`` of the other view, with false-negative cancellation when the
        config asks for it. The support set of a query is the query and its own key ``k_own (N, D)``,
        as in MoCo (see :mod:`hf_contrast.false_negatives`). Returns ``(logits, labels,
        positive_mask, negatives, kept, removed)``; the last four are None without cancellation."""
        logits, labels = mocov3_logits(q, keys, self.config.temperature, rank)  # (N, M), (N,)
        if self.config.false_negatives is None:
            return logits, labels, None, None, None, None
        excluded = torch.zeros_like(logits, dtype=torch.bool)  # (N, M)
        excluded[torch.arange(logits.shape[0], device=logits.device), labels] = True  # the positive
        scores = support_scores(torch.stack([q, k_own], dim=1), keys)  # (N, M)
        logits, positive_mask, negatives, kept, removed = cancel_negatives(logits, labels, excluded, scores,
                                                                           self.config)
        return logits, labels, positive_mask, negatives, kept, removed
