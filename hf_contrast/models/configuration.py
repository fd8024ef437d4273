"""Configurations of the contrastive models: every knob, documented and validated at construction.

Defaults follow the official recipes, so ``MoCoConfig()`` is MoCo v2 and ``SimCLRConfig()`` is
SimCLR v1 as their authors ran them on ImageNet:

* MoCo v2 (facebookresearch/moco ``main_moco.py`` with ``--mlp --moco-t 0.2 --aug-plus --cos``):
  queue 65536, momentum 0.999 constant, temperature 0.2, head 2048-ReLU-128 without BatchNorm.
* SimCLR v1 (google-research/simclr, paper section B.9): temperature 0.1 for ImageNet,
  head 2048-BN-ReLU-128, negatives gathered over all devices.

``training/pretrain.py`` overrides some of them for its small default dataset and says why.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

import timm
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

MOMENTUM_SCHEDULES = ("constant", "cosine")
FALSE_NEGATIVE_MODES = (None, "eliminate", "attract")


def check_timm_name(name: str, field: str = "backbone") -> None:
    """Raise ``ValueError`` if ``name`` is not a timm architecture, suggesting close matches."""
    arch = name.split(".", 1)[0]  # drop a pretrained tag such as ".a1_in1k"
    if timm.is_model(arch):
        return
    close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
    hint = f" Did you mean one of: {', '.join(close)}?" if close else " See timm.list_models() for the names."
    raise ValueError(f"{field}={name!r} is not a timm model name.{hint}")


def _check(condition, field: str, value: Any, allowed: str, kind: Literal["int", "number"] | None = None) -> None:
    """Raise a ValueError naming the field, its value and what is allowed.

    ``condition`` may be a callable, evaluated here, so a value of the wrong type (a string where a
    number belongs) fails with the same message instead of a bare TypeError. ``kind="int"`` also requires an
    ``int``, ``kind="number"`` an ``int`` or ``float``; neither accepts a ``bool``.
    """
    if callable(condition):
        try:
            condition = condition()
        except TypeError:
            condition = False
    if kind is not None and (isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float))):
        condition = False
    if not condition:
        raise ValueError(f"{field}={value!r} is invalid: {field} must be {allowed}.")


@strict(accept_kwargs=True)
class ContrastiveConfig(PreTrainedConfig):
    """Fields shared by every contrastive method (not registered as a model type of its own).

    Args:
        backbone: any timm architecture name; built with ``pretrained=False, num_classes=0`` so the
            encoder returns pooled features.
        backbone_kwargs: extra keyword arguments for ``timm.create_model`` (e.g. ``in_chans``,
            ``drop_path_rate``). They travel into the exported timm ``model_args``.
        projection_hidden_dim: width of the projection head's hidden layers.
        projection_dim: size of the embeddings the loss compares.
        projection_layers: number of linear layers in the head (>= 1; 1 means a single linear map).
        projection_batch_norm: BatchNorm after each hidden linear layer of the head.
        projection_output_batch_norm: BatchNorm (no affine) on the head's output, as MoCo v3 and
            SimCLR v2: no output dimension can lose its batch variance, so the embeddings cannot
            collapse onto one direction.
        temperature: softmax temperature of the contrastive loss, > 0.
        image_size: side of the square training crops; recorded for export and checked against data.
        tau_plus: class prior of the debiased contrastive loss (Chuang et al. 2020), in [0, 1);
            0 (default) is plain InfoNCE / NT-Xent. See :func:`hf_contrast.losses.debiased_contrastive_loss`.
        false_negatives: false-negative cancellation (Huynh et al. 2022): ``None`` (off),
            ``"eliminate"`` (drop, per anchor, the ``false_negative_top_k`` negatives most similar to
            the anchor's views from the denominator) or ``"attract"`` (also use them as extra
            positives). See :mod:`hf_contrast.false_negatives`.
        false_negative_top_k: how many candidates per anchor cancellation may take (FNC's ``fn_topk``).
        false_negative_threshold: also require a candidate's similarity to exceed this cosine
            (FNC's ``fn_threshold``, 0.7 in their code); ``None``: top-k alone.
    """

    backbone: str = "resnet50"
    backbone_kwargs: dict[str, Any] | None = None
    projection_hidden_dim: int = 2048
    projection_dim: int = 128
    projection_layers: int = 2
    projection_batch_norm: bool = False
    projection_output_batch_norm: bool = False
    temperature: float = 0.2
    image_size: int = 224
    tau_plus: float = 0.0
    false_negatives: Literal["eliminate", "attract"] | None = None
    false_negative_top_k: int = 10
    false_negative_threshold: float | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_false_negative_fields()
        if self.backbone_kwargs is None:
            self.backbone_kwargs = {}
        check_timm_name(self.backbone)
        reserved = {"pretrained", "num_classes"} & set(self.backbone_kwargs)
        _check(not reserved, "backbone_kwargs", self.backbone_kwargs,
               "free of 'pretrained' and 'num_classes' (the encoder is always built headless, from scratch)")
        _check(lambda: self.projection_hidden_dim >= 1, "projection_hidden_dim", self.projection_hidden_dim, "an integer >= 1", kind="int")
        _check(lambda: self.projection_dim >= 1, "projection_dim", self.projection_dim, "an integer >= 1", kind="int")
        _check(lambda: self.projection_layers >= 1, "projection_layers", self.projection_layers, "an integer >= 1", kind="int")
        _check(lambda: self.temperature > 0, "temperature", self.temperature, "a float > 0 (0.07 to 0.5 is usual)", kind="number")
        _check(lambda: self.image_size >= 1, "image_size", self.image_size, "an integer >= 1 (pixels)", kind="int")


    def nominal_negatives(self, per_device_batch_size: int | None, world_size: int = 1) -> int | None:
        """Negatives per anchor before false-negative cancellation (a queue: once full); ``None`` when they
        depend on a batch size that is unknown. Each method's configuration states its own count (see
        :func:`hf_contrast.negatives_per_anchor`, which subtracts what cancellation takes)."""
        raise NotImplementedError(f"{type(self).__name__} must define nominal_negatives(per_device_batch_size, "
                                  "world_size): the negatives each anchor is contrasted with")

    def _check_false_negative_fields(self) -> None:
        _check(lambda: 0.0 <= self.tau_plus < 1.0, "tau_plus", self.tau_plus, "a float in [0, 1) (0: InfoNCE; 0.1 in the paper)", kind="number")
        _check(self.false_negatives in FALSE_NEGATIVE_MODES, "false_negatives", self.false_negatives,
               f"one of {FALSE_NEGATIVE_MODES}")
        _check(lambda: self.false_negative_top_k >= 1, "false_negative_top_k", self.false_negative_top_k,
               "an integer >= 1 (10 in FNC)", kind="int")
        _check(lambda: self.false_negative_threshold is None or -1.0 <= self.false_negative_threshold <= 1.0,
               "false_negative_threshold", self.false_negative_threshold, "None or a cosine in [-1, 1] (0.7 in FNC)")
        _check(not (self.tau_plus > 0 and self.false_negatives == "attract"), "tau_plus", self.tau_plus,
               "0 when false_negatives='attract' (the debiased loss has a single positive)")


@strict(accept_kwargs=True)
class MoCoConfig(ContrastiveConfig):
    """MoCo (He et al. 2020; Chen et al. 2020 for v2): momentum key encoder and a queue of negatives.

    Args:
        queue_size: number of negative keys held in the FIFO queue (65536 in MoCo). Independent of
            the batch size; need not be a multiple of it. Memory: ``queue_size * projection_dim * 4``
            bytes (32 MiB at the defaults).
        momentum: EMA coefficient ``m`` of ``theta_k <- m * theta_k + (1 - m) * theta_q``, applied
            once per optimizer step, in [0, 1]. 0.999 in MoCo; m = 0 copies the query encoder (fails).
        momentum_schedule: ``"constant"`` (MoCo v1/v2) or ``"cosine"`` (MoCo v3/BYOL: from
            ``momentum`` at step 0 to 1.0 at the last step).
        symmetric_loss: also use view 2 as query against view 1's key and average (MoCo v3); both
            views' keys are then enqueued.
        shuffle_bn: run the key encoder on a shuffled batch (across processes when there are
            several), so BatchNorm statistics cannot leak which key belongs to which query.
        key_bn_splits: on ONE process, where shuffling alone changes nothing for BatchNorm, the
            shuffled key batch is split into this many sub-batches normalised separately (MoCo's
            single-GPU "SplitBatchNorm" demo uses 8), so a key's statistics come from a random subset
            of the batch rather than the query's batch. 1 turns it off; ignored on several processes
            (there shuffle-BN across processes does the job). Backbones without BatchNorm
            (ViT, ConvNeXt) need neither.
        exclude_same_instance: mask, in each query's logits, the queued keys of its own image
            (instance ids stored beside the keys; items carry ``instance_id``). On a narrow corpus a
            large queue otherwise holds earlier keys of the anchor's own image as negatives.
    """

    model_type = "hf_contrast_moco"

    queue_size: int = 65536
    momentum: float = 0.999
    momentum_schedule: Literal["constant", "cosine"] = "constant"
    symmetric_loss: bool = False
    shuffle_bn: bool = True
    key_bn_splits: int = 4
    exclude_same_instance: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _check(lambda: self.queue_size >= 1, "queue_size", self.queue_size, "an integer >= 1 (65536 in MoCo)", kind="int")
        _check(lambda: 0.0 <= self.momentum <= 1.0, "momentum", self.momentum, "in [0, 1] (0.999 in MoCo v2, 0.99 in v3)", kind="number")
        _check(self.momentum_schedule in MOMENTUM_SCHEDULES, "momentum_schedule", self.momentum_schedule,
               f"one of {MOMENTUM_SCHEDULES}")
        _check(lambda: self.key_bn_splits >= 1, "key_bn_splits", self.key_bn_splits, "an integer >= 1 (1: off)", kind="int")

    def nominal_negatives(self, per_device_batch_size: int | None, world_size: int = 1) -> int:
        """``queue_size``, whatever the batch (once the queue is full)."""
        return self.queue_size


@strict(accept_kwargs=True)
class SimCLRConfig(ContrastiveConfig):
    """SimCLR (Chen et al. 2020): in-batch negatives with the NT-Xent loss.

    A batch of N images gives 2N views; each anchor has 1 positive and 2N - 2 negatives, or
    2 * N * world_size - 2 when ``gather_distributed`` gathers the views of every process.

    Args:
        gather_distributed: compute each anchor's loss against the views of all processes
            (with gradient). Off gives per-device negatives, which is what most ports do silently.
        sync_batch_norm: synchronise BatchNorm statistics across processes (SimCLR's "global BN",
            which stops the model from exploiting per-device statistics). Uses timm's
            ``convert_sync_batchnorm``; torch's SyncBatchNorm needs GPU (or XPU/HPU) tensors when
            several processes run, and is a plain BatchNorm on one process.
        grad_cache_chunk_size: gradient caching (Gao et al. 2021) in ``ContrastiveTrainer``: embed
            the per-device batch in chunks of this many images without grad, back-propagate the
            loss over all views to the embeddings, then re-run each chunk with grad (same RNG state)
            and back-propagate the cached embedding gradients. Same negatives, and without
            BatchNorm the same gradients as the full batch, at one chunk's activation memory for
            one extra forward pass. BatchNorm layers then see each chunk's statistics, not the
            batch's (a warning says so): use ``projection_batch_norm=False`` and a backbone
            without BatchNorm (ViT, ConvNeXt) for exact gradients. ``None`` (default): off.
    """

    model_type = "hf_contrast_simclr"

    temperature: float = 0.1
    projection_batch_norm: bool = True
    gather_distributed: bool = True
    sync_batch_norm: bool = False
    grad_cache_chunk_size: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _check(lambda: self.grad_cache_chunk_size is None or (
            isinstance(self.grad_cache_chunk_size, int) and not isinstance(self.grad_cache_chunk_size, bool)
            and self.grad_cache_chunk_size >= 1), "grad_cache_chunk_size", self.grad_cache_chunk_size,
            "None (off) or an integer >= 1 (images per chunk)")
        _check(self.grad_cache_chunk_size is None or (self.tau_plus == 0 and self.false_negatives is None),
               "grad_cache_chunk_size", self.grad_cache_chunk_size,
               "None when tau_plus > 0 or false_negatives is set (the cached step computes plain NT-Xent)")

    def nominal_negatives(self, per_device_batch_size: int | None, world_size: int = 1) -> int | None:
        """``2 N W - 2`` with the views of all ``W`` processes gathered, else ``2 N - 2``."""
        if per_device_batch_size is None:
            return None
        return 2 * per_device_batch_size * (world_size if self.gather_distributed else 1) - 2


@strict(accept_kwargs=True)
class MoCoV3Config(ContrastiveConfig):
    """MoCo v3 (Chen, Xie, He 2021): a momentum encoder whose keys of the whole (gathered) batch are
    the negatives, a predictor on the query side, no queue (``queue_size=0``, the default).

    Defaults are the official ResNet-50 recipe (facebookresearch/moco-v3 ``main_moco.py`` and
    ``moco/builder.py`` ``MoCo_ResNet``): projector 2048-4096-256 (2 layers), predictor 256-4096-256
    without output BatchNorm, temperature 1.0, momentum 0.99 with a cosine schedule to 1. For a ViT
    the official ``MoCo_ViT`` uses a 3-layer projector, a predictor WITH a non-affine output
    BatchNorm, temperature 0.2 and a frozen patch projection: :meth:`for_backbone` picks those.

    Heads follow the official ``_build_mlp``: bias-free Linear layers, BatchNorm + ReLU after each
    hidden one, and on the output a ``BatchNorm1d(affine=False)`` where the recipe has one.

    Each query has 1 positive and ``N * W - 1`` negatives (``N`` images per device, ``W`` processes):
    the momentum encoder's keys of the other images of the global batch, gathered without gradient.
    ``false_negatives`` and ``tau_plus`` (inherited) act on these in-batch keys, per half of the
    symmetric loss. ``queue_size = K > 0`` adds MoCo v2's FIFO queue of earlier keys (a hybrid no
    official code has): ``N * W - 1 + K`` negatives once the queue is full.

    Args:
        predictor_hidden_dim: width of the predictor's hidden layers (4096).
        predictor_layers: linear layers of the predictor (2).
        predictor_batch_norm: BatchNorm after the predictor's hidden layers.
        predictor_output_batch_norm: non-affine BatchNorm on the predictor's output: False for
            ResNets (``MoCo_ResNet``), True for ViTs (``MoCo_ViT``).
        momentum: EMA coefficient at step 0, in [0, 1] (0.99 in MoCo v3; the paper's ViT-B ablation:
            0 -> 74.3, 0.9 -> 75.6, 0.99 -> 76.5, 0.999 -> 75.0).
        momentum_schedule: ``"cosine"`` (official: from ``momentum`` to 1.0, per iteration) or
            ``"constant"``.
        gather_distributed: contrast each query with the keys of all processes (``N * W - 1``
            negatives). Off gives per-device negatives (``N - 1``).
        freeze_patch_embed: freeze the ViT patch projection (``patch_embed.proj``) at its random
            init, the paper's stability trick (+1.7 on ViT-B at 100 epochs). Needs a backbone with
            ``patch_embed.proj``.
        queue_size: 0 (default: the official MoCo v3, in-batch keys only) or ``K > 0``: a FIFO queue
            of the ``K`` most recent keys of both views (``2 * N * W`` enter per step, after the loss),
            whose columns are appended to each query's in-batch logits. Both halves of the loss use
            the queue of before the step. Memory ``K * projection_dim * 4`` bytes.
        exclude_same_instance: with a queue, mask in each query's logits the queued keys of its own
            image (as :class:`MoCoConfig`; items carry ``instance_id``). No effect without a queue.
        sync_batch_norm: BatchNorm statistics synchronised across processes in the encoders, projectors
            and predictor (query and momentum side), as the official ``main_moco.py``, which converts
            the whole model with ``SyncBatchNorm.convert_sync_batchnorm`` when distributed. ``None``
            (default): decided when the model is built: on when more than one process runs (an
            initialised process group of world size > 1, or ``WORLD_SIZE`` > 1 as torchrun sets it)
            on a CUDA/XPU/HPU machine; off on one process, and on CPU-only runs (gloo), where
            SyncBatchNorm cannot run; ``True``/``False`` force it. Same mechanism as :class:`SimCLRConfig` (timm's
            ``convert_sync_batchnorm``): parameter and buffer names, checkpoints and the momentum
            pairs are unchanged. Torch's SyncBatchNorm needs GPU (or XPU/HPU) tensors when several
            processes run.
    """

    model_type = "hf_contrast_mocov3"

    projection_hidden_dim: int = 4096
    projection_dim: int = 256
    projection_layers: int = 2
    projection_batch_norm: bool = True
    projection_output_batch_norm: bool = True
    temperature: float = 1.0
    predictor_hidden_dim: int = 4096
    predictor_layers: int = 2
    predictor_batch_norm: bool = True
    predictor_output_batch_norm: bool = False
    momentum: float = 0.99
    momentum_schedule: Literal["constant", "cosine"] = "cosine"
    gather_distributed: bool = True
    freeze_patch_embed: bool = False
    queue_size: int = 0
    exclude_same_instance: bool = True
    sync_batch_norm: bool | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _check(lambda: self.queue_size >= 0, "queue_size", self.queue_size,
               "an integer >= 0 (0: no queue, the official MoCo v3; K > 0: K queued keys added to the in-batch ones)", kind="int")
        _check(self.sync_batch_norm is None or isinstance(self.sync_batch_norm, bool), "sync_batch_norm",
               self.sync_batch_norm, "None (on with more than one process, as the official code), True or False")
        _check(lambda: self.predictor_hidden_dim >= 1, "predictor_hidden_dim", self.predictor_hidden_dim,
               "an integer >= 1", kind="int")
        _check(lambda: self.predictor_layers >= 1, "predictor_layers", self.predictor_layers, "an integer >= 1", kind="int")
        _check(lambda: 0.0 <= self.momentum <= 1.0, "momentum", self.momentum, "in [0, 1] (0.99 in MoCo v3)", kind="number")
        _check(self.momentum_schedule in MOMENTUM_SCHEDULES, "momentum_schedule", self.momentum_schedule,
               f"one of {MOMENTUM_SCHEDULES}")

    def nominal_negatives(self, per_device_batch_size: int | None, world_size: int = 1) -> int | None:
        """``N W - 1`` in-batch keys gathered over ``W`` processes (``N - 1`` without ``gather_distributed``),
        plus ``queue_size`` queued keys (once the queue is full)."""
        if per_device_batch_size is None:
            return None
        return per_device_batch_size * (world_size if self.gather_distributed else 1) - 1 + self.queue_size

    @classmethod
    def for_backbone(cls, backbone: str, **kwargs) -> MoCoV3Config:
        """The official recipe for ``backbone``'s family: ``MoCo_ViT`` (3-layer projector, predictor
        output BatchNorm, temperature 0.2, frozen patch projection) for backbones with a patch
        embedding, ``MoCo_ResNet`` otherwise. ``kwargs`` override any field."""
        check_timm_name(backbone)
        if is_patch_backbone(backbone, (kwargs.get("backbone_kwargs") or {})):
            kwargs = {**dict(projection_layers=3, predictor_output_batch_norm=True, temperature=0.2,
                             freeze_patch_embed=True), **kwargs}
        return cls(backbone=backbone, **kwargs)


def is_patch_backbone(backbone: str, backbone_kwargs: dict | None = None) -> bool:
    """Whether a timm architecture embeds patches with a ``patch_embed.proj`` layer (ViT, DeiT, ...).
    Built on the meta device: no memory, no weights."""
    import torch

    with torch.device("meta"):
        model = timm.create_model(backbone.split(".", 1)[0], pretrained=False, num_classes=0,
                                  **(backbone_kwargs or {}))
    return hasattr(getattr(model, "patch_embed", None), "proj")
