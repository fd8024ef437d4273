"""Export of the trained query encoder in timm's own Hub folder layout.

The folder holds ``config.json`` (``architecture``, ``num_classes: 0``, ``num_features``,
``model_args``, ``pretrained_cfg`` with the training mean/std/input size), ``model.safetensors``
(the timm state dict, no pickle), ``README.md`` (the model card) and ``training_curves.png``. It
loads with no hf_contrast code: ``timm.create_model("local-dir:DIR", pretrained=True)``,
``transformers.AutoModel`` / ``AutoModelForImageClassification`` / ``AutoImageProcessor`` and
``pipeline("image-feature-extraction")``.

The config is written here rather than by ``timm.models.save_for_hf``: timm 1.0.31 writes
``num_classes`` into ``model_args``, which transformers' ``TimmWrapper`` then passes twice
("got multiple values for keyword argument 'num_classes'"). Only fields every timm 1.0.x reads
are written, so the export loads with timm 1.0.30 and 1.0.31 alike.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..data.views import IMAGENET_MEAN, IMAGENET_STD
from .curves import CURVES_FILENAME, plot_training_curves
from .model_card import EncoderCardData

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"


def split_source(source):
    """``(model, trainer or None)`` from a contrastive model or a trainer holding one."""
    if hasattr(source, "state") and hasattr(source, "model") and hasattr(source, "args"):
        accelerator = getattr(source, "accelerator", None)
        model = accelerator.unwrap_model(source.model) if accelerator is not None else source.model
        return model, source
    if not hasattr(source, "encoder") or not hasattr(getattr(source, "config", None), "backbone"):
        raise ValueError(
            f"Cannot export a {type(source).__name__}: pass a MoCoV3Model, a MoCoModel, a SimCLRModel or a "
            "ContrastiveTrainer."
        )
    return source, None


def timm_hub_config(encoder: torch.nn.Module, architecture: str, backbone_kwargs: dict | None, image_size: int,
                    mean, std) -> dict:
    """timm's ``config.json`` for a headless encoder, readable by timm 1.0.x and transformers' TimmWrapper.

    ``model_args`` holds the ``timm.create_model`` kwargs the encoder was built with (never
    ``num_classes``: the loaders choose it). An architecture with a fixed input size (ViT) also records
    its ``img_size``, so its position embeddings keep their shape; ``fixed_input_size`` is false when
    the model resizes them at run time (``dynamic_img_size``), so loaders do not resize the model to
    the training crop.
    """
    model_args = {k: v for k, v in (backbone_kwargs or {}).items() if k not in ("num_classes", "pretrained")}
    source_cfg = dict(getattr(encoder, "pretrained_cfg", None) or {})
    fixed = bool(source_cfg.get("fixed_input_size", False))
    img_size = getattr(getattr(encoder, "patch_embed", None), "img_size", None)
    if fixed and img_size is not None and "img_size" not in model_args:
        model_args["img_size"] = list(img_size)
    if getattr(encoder, "dynamic_img_size", False):
        fixed = False
    in_chans = int(model_args.get("in_chans", 3))
    pretrained_cfg = {
        "input_size": [in_chans, image_size, image_size],
        "fixed_input_size": fixed,
        "interpolation": "bilinear",  # as hf_contrast's eval transform
        "crop_pct": 1.0,
        "crop_mode": "center",
        "mean": list(mean),
        "std": list(std),
        "num_classes": 0,
        "first_conv": source_cfg.get("first_conv"),
        "classifier": source_cfg.get("classifier"),
    }
    config = {
        "architecture": architecture,
        "num_classes": 0,
        "num_features": int(encoder.num_features),
    }
    if getattr(encoder, "global_pool", None) and isinstance(encoder.global_pool, str):
        config["global_pool"] = encoder.global_pool
    if model_args:
        config["model_args"] = model_args
    config["pretrained_cfg"] = {k: v for k, v in pretrained_cfg.items() if v is not None}
    return config


def _check_directory(directory: Path, overwrite: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"The export directory {directory} is a file: pass a new or empty directory.")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise ValueError(
            f"The export directory {directory} is not empty ({', '.join(sorted(p.name for p in directory.iterdir())[:5])}"
            "...): pass a new or empty directory, or overwrite=True to replace the export files in it."
        )


def export_encoder(source, directory: str | Path, *, card: EncoderCardData | None = None, overwrite: bool = False,
                   augmentation=None, **card_fields) -> Path:
    """Write the query encoder of ``source`` as a timm Hub folder with its model card.

    Args:
        source: a :class:`~hf_contrast.MoCoModel`, :class:`~hf_contrast.MoCoV3Model`,
            :class:`~hf_contrast.SimCLRModel` or a
            :class:`~hf_contrast.ContrastiveTrainer` (which also fills batch, steps and curves of the card).
        directory: a new or empty directory.
        card: the card data; built from ``source`` when ``None``.
        overwrite: write into a non-empty directory, replacing files of the same names.
        augmentation: the :class:`~hf_contrast.TwoViewAugmentation` used in training: its mean/std
            and crop size go into ``pretrained_cfg`` (ImageNet mean/std otherwise, with a warning).
        card_fields: fields of :class:`EncoderCardData` (``knn_top1``, ``datasets``, ``repo_id``...).

    Returns:
        The export directory.

    Raises:
        ValueError: ``directory`` is not empty (and ``overwrite`` is false), or ``source`` is not a
            contrastive model or trainer.
    """
    model, trainer = split_source(source)
    directory = Path(directory)
    _check_directory(directory, overwrite)
    if card is None:
        build = EncoderCardData.from_trainer if trainer is not None else EncoderCardData.from_model
        card = build(source if trainer is not None else model, augmentation=augmentation, **card_fields)
    if card.mean is None or card.std is None:
        logger.warning("No training mean/std given (pass augmentation= or mean=/std=): the export records "
                       "ImageNet's, so loaders will normalise with those.")
        card.mean, card.std = card.mean or IMAGENET_MEAN, card.std or IMAGENET_STD
    encoder = model.encoder
    config = timm_hub_config(encoder, card.backbone, model.config.backbone_kwargs, card.image_size or
                             model.config.image_size, card.mean, card.std)
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in encoder.state_dict().items()}

    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    curves = plot_training_curves(card.log_history, directory / CURVES_FILENAME)
    card.to_model_card(curves_file=curves.name if curves else None).save(directory / CARD_NAME)
    logger.info(f"Exported the {card.backbone} encoder to {directory}")
    return directory


def load_image_processor(name_or_path: str | Path, **kwargs):
    """``AutoImageProcessor`` of an encoder export (its ``pretrained_cfg``: size, mean/std), without a false warning.

    transformers 5 maps timm exports (``model_type`` ``timm_wrapper``) to one image processor, a PIL-backend
    class, but picks the torchvision backend by default whenever torchvision is installed, so every plain load
    warns "Requested torchvision backend is not available. Falling back to pil backend." (untrue, and nothing to
    act on). Asking for the ``pil`` backend loads the same class without it.

    Args:
        name_or_path: an export folder or Hub repo id.
        kwargs: passed to ``AutoImageProcessor.from_pretrained``.
    """
    from transformers import AutoImageProcessor
    from transformers.models.auto import image_processing_auto

    if hasattr(image_processing_auto, "_resolve_backend"):  # a transformers that chooses backends
        kwargs.setdefault("backend", "pil")
    return AutoImageProcessor.from_pretrained(name_or_path, **kwargs)
