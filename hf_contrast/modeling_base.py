"""What MoCo and SimCLR models share: the PreTrainedModel base and the output dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration import ContrastiveConfig


@dataclass
class ContrastiveOutput(ModelOutput):
    """Output of a contrastive model's forward.

    Attributes:
        loss: the contrastive loss (``None`` when ``return_loss=False``).
        logits: float32 similarities / temperature, one row per anchor. MoCo: ``(A, 1 + K)`` with
            the positive in column 0; SimCLR: ``(2N, 2M)`` with each anchor's own entry ``-inf``.
        labels: the column of each anchor's positive, ``(A,)``.
        embeddings: the anchors' projections (before normalisation), ``(A, D)``.
        queue_keys: MoCo only: L2-normalised keys to enqueue after the loss, ``(B, D)``. (Not
            ``keys``: a ``ModelOutput`` is a dict, and a field named ``keys`` would shadow
            ``dict.keys``, which DDP's output handling calls.)
        num_negatives: negatives per anchor actually used by this forward: an int when nothing can be
            masked (SimCLR, MoCo v3 without a queue, without FNC), else a 0-d device tensor, the mean per
            anchor after masking (unused queue slots, same-instance keys, FNC); always a tensor with a
            queue (its fill count is on the device).
        negative_counts: ``(A,)`` non-positive candidates left in each row, i.e. finite logits but the
            positive's (``None``: all but the positive and, SimCLR, the anchor itself); with
            ``false_negatives="attract"`` they include the attracted candidates. Always set with a queue.
        queue_instance_ids: MoCo only: instance ids ``(B,)`` of ``queue_keys`` (``None``: unknown).
        false_negatives_removed: ``(A,)`` candidates FNC took per anchor (``None`` when off).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    queue_keys: torch.Tensor | None = None
    num_negatives: int | torch.Tensor | None = None
    negative_counts: torch.Tensor | None = None
    queue_instance_ids: torch.Tensor | None = None
    false_negatives_removed: torch.Tensor | None = None


class ContrastivePreTrainedModel(PreTrainedModel):
    """Base of the contrastive models: a timm ``encoder`` and a ``projector`` head.

    Weights are initialised by timm and torch at construction; transformers' generic initialiser
    is not applied on top (it would overwrite timm's per-architecture init).
    """

    config_class = ContrastiveConfig
    base_model_prefix = "encoder"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    model_tags = ["hf_contrast", "timm"]
    accepts_loss_kwargs = False
    _no_split_modules = []

    def _init_weights(self, module):
        if hasattr(module, "init_non_persistent_buffers"):  # e.g. timm's relative position tables
            module.init_non_persistent_buffers()

    def get_input_embeddings(self):
        return None

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pooled backbone features of images ``(B, 3, H, W)`` -> ``(B, num_features)``: what
        downstream tasks (kNN, linear probe, fine-tuning) use."""
        return self.encoder(pixel_values)
