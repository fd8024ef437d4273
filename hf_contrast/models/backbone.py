"""The timm backbone and the projection head shared by every contrastive model."""

from __future__ import annotations

import timm
import torch
from torch import nn

from .configuration import ContrastiveConfig, check_timm_name


def create_backbone(name: str, backbone_kwargs: dict | None = None) -> nn.Module:
    """A headless timm model built from scratch: ``forward`` returns pooled features ``(B, C)``.

    Raises:
        ValueError: ``name`` is not a timm architecture (close matches are suggested).
    """
    check_timm_name(name)
    return timm.create_model(name, pretrained=False, num_classes=0, **(backbone_kwargs or {}))


class ProjectionHead(nn.Sequential):
    """MLP head: ``projection_layers - 1`` blocks of Linear (+ BatchNorm) + ReLU, then a Linear.

    MoCo v2 uses 2048-ReLU-128 without BatchNorm; SimCLR uses BatchNorm in the hidden layers; MoCo v3
    and SimCLR v2 also normalise the output with a BatchNorm without affine parameters.

    ``output_bias`` (default: only without ``output_batch_norm``) sets the bias of the last Linear;
    MoCo v3's ``_build_mlp`` has no bias anywhere, also on a predictor without output BatchNorm.
    """

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int = 2, batch_norm: bool = False,
                 output_batch_norm: bool = False, output_bias: bool | None = None):
        layers: list[nn.Module] = []
        dim = in_dim
        for _ in range(num_layers - 1):
            layers.append(nn.Linear(dim, hidden_dim, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers.append(nn.ReLU(inplace=True))
            dim = hidden_dim
        output_bias = not output_batch_norm if output_bias is None else output_bias
        layers.append(nn.Linear(dim, out_dim, bias=output_bias))
        if output_batch_norm:  # MoCo v3 / SimCLR v2: every output dimension keeps unit batch variance
            layers.append(nn.BatchNorm1d(out_dim, affine=False))
        super().__init__(*layers)


def check_patch_grid(encoder: nn.Module, config: ContrastiveConfig) -> None:
    """Refuse an ``image_size`` that is not a multiple of a patch backbone's patch size: timm's patch
    projection (a convolution of stride P) silently drops the last ``image_size % P`` rows and columns, so
    ``vit_tiny_patch16_224`` at 30 px sees only its top-left 16x16 pixels. Padded patches
    (``dynamic_img_pad`` with ``dynamic_img_size`` in ``backbone_kwargs``) are accepted."""
    patch_embed = getattr(encoder, "patch_embed", None)
    patch = getattr(patch_embed, "patch_size", None)
    if patch is None or getattr(patch_embed, "dynamic_img_pad", False):
        return
    patch = max(patch) if isinstance(patch, (tuple, list)) else int(patch)
    size = config.image_size
    if size % patch:
        grid, lower, upper = size // patch, size // patch * patch, (size // patch + 1) * patch
        sizes = " or ".join(f"image_size={n}" for n in (lower, upper) if n)
        seen = f"its {grid}x{grid} grid of patches would see only the top-left {lower}x{lower} pixels" if grid else (
            "it would have no patch at all")
        raise ValueError(
            f"image_size={size} is not a multiple of the patch size {patch} of backbone={config.backbone!r}: {seen}, "
            f"dropping the last {size % patch}. Use {sizes}, or pad to {upper} with dynamic_img_pad and "
            f"dynamic_img_size true in backbone_kwargs.")


def build_encoder_and_head(config: ContrastiveConfig) -> tuple[nn.Module, ProjectionHead]:
    """The backbone and projection head a config describes (a patch backbone's grid checked against
    ``config.image_size``, :func:`check_patch_grid`)."""
    encoder = create_backbone(config.backbone, config.backbone_kwargs)
    check_patch_grid(encoder, config)
    projector = ProjectionHead(
        encoder.num_features,
        config.projection_hidden_dim,
        config.projection_dim,
        config.projection_layers,
        config.projection_batch_norm,
        config.projection_output_batch_norm,
    )
    return encoder, projector


@torch.no_grad()
def embedding_std(z: torch.Tensor) -> float:
    """Mean per-dimension std of L2-normalised embeddings ``(N, D)``: about ``1/sqrt(D)`` when
    healthy, near 0 when the embeddings collapsed onto one direction."""
    z = nn.functional.normalize(z.float(), dim=-1)
    return z.std(dim=0).mean().item()
