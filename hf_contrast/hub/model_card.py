"""The model card of an exported encoder: the facts as data (:class:`EncoderCardData`), a Jinja
template for the prose, and a plot of the training curves (:mod:`.curves`).

The template lives in the repository's top-level ``model_cards/`` folder (where users edit it) and is
shipped inside the wheel as the package data ``hf_contrast.model_cards`` (``pyproject.toml`` maps that
folder onto the package), so a wheel install renders cards without the source tree.

The card states what most contrastive checkpoints leave out: how many negatives each anchor was
trained against and where they came from (the per-device batch, the number of processes, whether
SimCLR gathered the views of all processes, the size of MoCo's queue), and that gradient
accumulation added none.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from ..trainer.throughput import summarize_throughput
from .curves import _CURVE_KEYS, CURVES_FILENAME, plot_training_curves  # noqa: F401 - re-exported

TEMPLATE_NAME = "encoder_card.md.jinja"


SOURCE_TEMPLATE = Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME  # in a source checkout (hub/ is two below)


def default_template_text() -> str:
    """The text of the model card template ``encoder_card.md.jinja``.

    In a source checkout (``hf_contrast/`` beside ``pyproject.toml`` and ``model_cards/``) the checkout's own
    ``model_cards/`` is read: a clone used without installing (``PYTHONPATH=.``) has no ``hf_contrast.model_cards``
    package, which only an install's ``package-dir`` mapping creates, and a clone run in front of another install
    must not render that install's template. Otherwise (a wheel, a zip) the package data ``hf_contrast.model_cards``
    is read with :mod:`importlib.resources`.

    Raises:
        FileNotFoundError: neither is there (call it before training to fail early).
    """
    if SOURCE_TEMPLATE.is_file() and (SOURCE_TEMPLATE.parents[1] / "pyproject.toml").is_file():
        return SOURCE_TEMPLATE.read_text(encoding="utf-8")
    try:
        resource = importlib.resources.files("hf_contrast.model_cards").joinpath(TEMPLATE_NAME)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except ModuleNotFoundError:  # no package data and no checkout
        pass
    raise FileNotFoundError(
        f"The model card template {TEMPLATE_NAME} is neither in the package hf_contrast.model_cards nor at "
        f"{SOURCE_TEMPLATE}: reinstall hf_contrast (pip install .), run from a complete clone, or pass "
        "template_path= to EncoderCardData.to_model_card."
    )


def describe_augmentation(augmentation) -> str:
    """One line describing a :class:`~hf_contrast.TwoViewAugmentation`, its recipe named first (its
    ``describe()``); any other object: its ``str``."""
    if augmentation is None:
        return "not recorded"
    if not hasattr(augmentation, "describe"):
        return str(augmentation)
    return augmentation.describe()


@dataclass
class EncoderCardData:
    """Everything the model card of an exported encoder states, filled from a trainer
    (:meth:`from_trainer`), from a model (:meth:`from_model`) or given explicitly.

    Args:
        method: ``"MoCo"``, ``"MoCo v3"`` or ``"SimCLR"``.
        backbone: the timm architecture.
        num_features: size of the pooled features the encoder returns.
        num_parameters: parameters of the exported encoder.
        image_size: side of the training crops.
        mean, std: per-channel normalisation used in training (recorded in ``pretrained_cfg``).
        temperature: softmax temperature of the contrastive loss.
        projection: the projection head used in pretraining (not exported).
        per_device_batch_size: images per device per micro-batch (N).
        world_size: number of processes (W).
        gradient_accumulation_steps: micro-batches per optimizer step.
        gather_distributed: SimCLR: views gathered from all processes; MoCo v3: keys gathered.
        queue_size, momentum, momentum_schedule, symmetric_loss: MoCo's queue and key encoder
            (MoCo v3: momentum and schedule only).
        negatives: negatives per anchor; computed from the fields above when ``None``.
        measured_negatives: the mean negatives per anchor after masking, as last logged
            (``num_negatives`` in ``log_history``; default: taken from it).
        exclude_same_instance, false_negatives, false_negative_top_k, tau_plus: how false negatives
            were handled (same-instance masking, cancellation, the debiased loss's prior).
        augmentations: description of the two-view augmentation.
        steps, epochs: optimizer steps and epochs trained.
        images_per_second, data_wait_fraction: training throughput of all processes together, and the
            share of time spent waiting for data (default: the mean of the logged windows after the
            first, see :func:`hf_contrast.trainer.throughput.summarize_throughput`).
        skipped_samples: unreadable training images replaced by the next readable one (``skip_bad_samples``;
            default: the last ``skipped_samples`` in ``log_history``).
        knn_top1: kNN top-1 of the exported encoder (default: the last ``knn_top1`` in ``log_history``).
        knn_details: how the kNN result was measured (k, temperature, splits).
        knn_baselines: other kNN results to show next to it, e.g. ``{"random init": 0.7}``.
        datasets: Hub dataset ids trained on (YAML ``datasets``).
        dataset_description: the training data in words.
        num_train_images: images the model was trained on (the training split, not a held-out one; default from a
            trainer: the length of its training dataset, or a stream's recorded shard sizes).
        repo_id: the Hub repo, used in the loading snippets.
        license: YAML ``license``.
        log_history: ``trainer.state.log_history``, plotted as the training curves.
        negatives_text: the paragraph on how an anchor's negatives arise (from the method's
            ``explain_negatives``; :meth:`from_model` fills it).
    """

    method: str
    backbone: str
    num_features: int | None = None
    num_parameters: int | None = None
    image_size: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    temperature: float | None = None
    projection: str | None = None
    per_device_batch_size: int | None = None
    world_size: int = 1
    gradient_accumulation_steps: int = 1
    gather_distributed: bool | None = None
    queue_size: int | None = None
    momentum: float | None = None
    momentum_schedule: str | None = None
    symmetric_loss: bool | None = None
    negatives: int | None = None
    measured_negatives: float | None = None
    exclude_same_instance: bool | None = None
    false_negatives: str | None = None
    false_negative_top_k: int | None = None
    tau_plus: float | None = None
    augmentations: str | None = None
    steps: int | None = None
    epochs: float | None = None
    images_per_second: float | None = None
    skipped_samples: int | None = None
    data_wait_fraction: float | None = None
    knn_top1: float | None = None
    knn_details: str | None = None
    knn_baselines: dict[str, float] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    dataset_description: str | None = None
    num_train_images: int | None = None
    repo_id: str | None = None
    license: str = "apache-2.0"
    log_history: list[dict[str, Any]] = field(default_factory=list, repr=False)
    negatives_text: str | None = None

    def __post_init__(self):
        if self.knn_top1 is None:
            self.knn_top1 = next((h["knn_top1"] for h in reversed(self.log_history) if "knn_top1" in h), None)
        if self.measured_negatives is None:
            self.measured_negatives = next(
                (h["num_negatives"] for h in reversed(self.log_history) if "num_negatives" in h), None)
        if self.skipped_samples is None:
            self.skipped_samples = next(
                (h["skipped_samples"] for h in reversed(self.log_history) if "skipped_samples" in h), None)
        throughput = summarize_throughput(self.log_history)
        if self.images_per_second is None:
            self.images_per_second = throughput.get("images_per_second")
        if self.data_wait_fraction is None:
            self.data_wait_fraction = throughput.get("data_wait_fraction")

    @classmethod
    def from_model(cls, model, augmentation=None, **overrides) -> EncoderCardData:
        """Card data from a :class:`~hf_contrast.MoCoModel` / :class:`~hf_contrast.SimCLRModel` alone
        (batch, steps and curves stay unknown unless given in ``overrides``).

        Args:
            augmentation: the :class:`~hf_contrast.TwoViewAugmentation` used in training; gives the
                normalisation, crop size and augmentation description.
            overrides: any field of :class:`EncoderCardData`.
        """
        cfg = model.config
        queued, ema = model.has_queue, model.has_momentum_encoder  # the method interface, no class check
        head = f"{cfg.projection_layers}-layer MLP {cfg.projection_hidden_dim}-{cfg.projection_dim}"
        head += ", BatchNorm" if cfg.projection_batch_norm else ""
        head += ", output BatchNorm" if cfg.projection_output_batch_norm else ""
        if hasattr(cfg, "predictor_layers"):  # MoCo v3
            head += (f"; predictor {cfg.predictor_layers}-layer MLP {cfg.predictor_hidden_dim}-{cfg.projection_dim}"
                     + (", output BatchNorm" if cfg.predictor_output_batch_norm else ""))
        fields = dict(
            method=model.describe(),
            backbone=cfg.backbone.split(".", 1)[0],
            num_features=model.encoder.num_features,
            num_parameters=sum(p.numel() for p in model.encoder.parameters()),
            image_size=cfg.image_size,
            mean=getattr(cfg, "image_mean", None),
            std=getattr(cfg, "image_std", None),
            temperature=cfg.temperature,
            projection=head,
            gather_distributed=getattr(cfg, "gather_distributed", None) if model.in_batch_negatives else None,
            queue_size=getattr(cfg, "queue_size", None) if queued else None,
            momentum=getattr(cfg, "momentum", None) if ema else None,
            momentum_schedule=getattr(cfg, "momentum_schedule", None) if ema else None,
            symmetric_loss=getattr(cfg, "symmetric_loss", None),
            exclude_same_instance=getattr(cfg, "exclude_same_instance", None) if queued else None,
            false_negatives=getattr(cfg, "false_negatives", None),
            false_negative_top_k=getattr(cfg, "false_negative_top_k", None),
            tau_plus=getattr(cfg, "tau_plus", 0.0),
        )
        if augmentation is not None:
            fields.update(mean=tuple(augmentation.mean), std=tuple(augmentation.std),
                          image_size=augmentation.image_size, augmentations=describe_augmentation(augmentation))
        fields.update(overrides)
        card = cls(**fields)
        if card.negatives is None:
            card.negatives = model.negatives_per_anchor(card.per_device_batch_size, card.world_size)
        if card.negatives_text is None:
            card.negatives_text = model.explain_negatives(card.per_device_batch_size, card.world_size, card.negatives)
        return card

    @classmethod
    def from_trainer(cls, trainer, augmentation=None, **overrides) -> EncoderCardData:
        """Card data from a :class:`~hf_contrast.ContrastiveTrainer` (after ``train()``): the batch,
        world size and accumulation from ``trainer.args``, steps, epochs and curves from
        ``trainer.state``, the negatives from ``trainer.negatives_per_anchor()``, and the augmentation
        (normalisation, crop size) from the training dataset when it is a
        :class:`~hf_contrast.data.TwoViewDataset` and ``augmentation`` is not given."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        if augmentation is None:
            augmentation = getattr(trainer.train_dataset, "augmentation", None)
        args, state = trainer.args, trainer.state
        fields = dict(
            per_device_batch_size=args.per_device_train_batch_size,
            world_size=args.world_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            steps=state.global_step,
            epochs=state.epoch,
            log_history=list(state.log_history),
        )
        dataset = trainer.train_dataset
        sizes = getattr(dataset, "shard_sizes", None)
        if sizes:  # a stream with recorded shard sizes
            fields["num_train_images"] = int(sum(sizes))
        elif hasattr(dataset, "__len__"):
            fields["num_train_images"] = len(dataset)
        if hasattr(trainer, "negatives_per_anchor"):
            fields["negatives"] = trainer.negatives_per_anchor()
        return cls.from_model(model, augmentation, **{**fields, **overrides})

    @property
    def global_batch_size(self) -> int | None:
        """Images per optimizer step: per-device batch x world size x accumulation."""
        if self.per_device_batch_size is None:
            return None
        return self.per_device_batch_size * self.world_size * self.gradient_accumulation_steps

    @property
    def negatives_explanation(self) -> str:
        """How the negatives of one anchor arise, in one paragraph."""
        if self.negatives_text is not None:
            return self.negatives_text
        return f"Each anchor is contrasted with {self.negatives} negatives per step."

    @property
    def false_negative_note(self) -> str:
        """How negatives that may not be negatives were treated, in one line."""
        parts = []
        if self.exclude_same_instance:
            parts.append("queued keys of the anchor's own image were masked")
        if self.false_negatives:
            parts.append(f"false-negative cancellation ({self.false_negatives}, top {self.false_negative_top_k} "
                         "per anchor by similarity to its two views)")
        if self.tau_plus:
            parts.append(f"debiased loss (tau_plus={self.tau_plus})")
        return "; ".join(parts) if parts else "none"

    @property
    def accumulation_note(self) -> str:
        g = self.gradient_accumulation_steps
        return (f"Gradient accumulation: {g} micro-batch(es) per optimizer step. Accumulation averages gradients "
                "over more images but adds no negatives: the loss is computed inside each micro-batch.")

    def final_metrics(self) -> dict[str, float]:
        """The last logged value of each curve (``loss``, ``contrastive_top1``, ``knn_top1``)."""
        out = {}
        for key, _ in _CURVE_KEYS:
            value = next((h[key] for h in reversed(self.log_history) if key in h), None)
            if value is not None:
                out[key] = value
        return out

    def to_model_card_data(self) -> ModelCardData:
        """The YAML header: ``library_name: timm``, ``pipeline_tag: image-feature-extraction``, tags."""
        tags = ["timm", "hf_contrast", "self-supervised", "contrastive-learning", self.method.lower().replace(" ", ""), self.backbone]
        return ModelCardData(
            library_name="timm", pipeline_tag="image-feature-extraction", license=self.license,
            tags=tags, datasets=list(self.datasets) or None,
        )

    def to_model_card(self, template_path: str | Path | None = None, curves_file: str | None = None) -> ModelCard:
        """Render the Jinja template with this data.

        Args:
            template_path: a Jinja template file; default: the packaged ``encoder_card.md.jinja``.
            curves_file: file name of the training-curve plot next to the card, if one was written.
        """
        if template_path is not None:
            template_text = Path(template_path).read_text(encoding="utf-8")
        else:
            template_text = default_template_text()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "log_history"}
        return ModelCard.from_template(
            self.to_model_card_data(), template_str=template_text,
            card=values, global_batch_size=self.global_batch_size, negatives_explanation=self.negatives_explanation,
            false_negative_note=self.false_negative_note,
            accumulation_note=self.accumulation_note, final_metrics=self.final_metrics(), curves_file=curves_file,
            load_name=self.repo_id,
        )
