"""What the trainer checks and says before the first step: the method's own checks, the data, the step count,
the setup line and the warnings about negatives (gather, accumulation, narrow corpus); and the collapse watch
of the logging steps. Functions of a :class:`~hf_contrast.ContrastiveTrainer`, so that the trainer itself is
its steps and hooks."""

from __future__ import annotations

import copy
import math

import datasets
import torch
from transformers.utils import logging

from ..data.streaming import StreamingTwoViewDataset
from ..models.corpus import false_negative_estimate
from ..models.negatives import negatives_per_anchor

logger = logging.get_logger("hf_contrast.trainer")


def warn_about_negatives(trainer) -> None:
    """In-batch methods: ``gather_distributed=False`` on several processes, and gradient accumulation, which adds
    no negatives."""
    model, args = trainer.model, trainer.args
    if model.in_batch_negatives and args.world_size > 1 and not getattr(model.config, "gather_distributed", True):
        as_gathered = copy.copy(model.config)
        as_gathered.gather_distributed = True
        gathered = negatives_per_anchor(as_gathered, args.per_device_train_batch_size, args.world_size)
        logger.warning(
            f"gather_distributed=False on {args.world_size} processes: each anchor sees only its own device's "
            f"{trainer.negatives_per_anchor()} negatives, not the {gathered} of the global batch."
        )
    if model.in_batch_negatives and not model.has_queue and args.gradient_accumulation_steps > 1:
        logger.warning(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} does not add negatives: "
            "the loss is computed inside each micro-batch, so each anchor still has "
            f"{trainer.negatives_per_anchor()} negatives. Accumulation only averages gradients over more images."
        )


def validate_setup(trainer) -> None:
    """Clear errors before any work is wasted: no negatives, a queue the batch overwrites, bad data."""
    a = trainer.args
    trainer.model.check_training_setup(a.per_device_train_batch_size, a.world_size)  # the method's own checks
    streamed = isinstance(trainer.train_dataset, StreamingTwoViewDataset)
    device_views = getattr(a, "device_augmentation", False) and not streamed
    if device_views and not hasattr(trainer.train_dataset, "configure_device_augmentation"):
        raise ValueError("device_augmentation=True needs a TwoViewDataset (hf_contrast.two_view_dataset) or a "
                         "streamed StreamingTwoViewDataset: their workers ship the uint8 images and view "
                         f"parameters the device augments, got {type(trainer.train_dataset).__name__}")
    if device_views:
        trainer.train_dataset.configure_device_augmentation()  # items: images (uint8) + view_params
    if streamed:
        trainer.configure_stream()  # too few shards for ranks x workers: a clear error before training
    elif (trainer.train_dataset is not None and not device_views
          and not isinstance(trainer.train_dataset, torch.utils.data.IterableDataset)):
        if hasattr(trainer.train_dataset, "__len__") and len(trainer.train_dataset) == 0:
            raise ValueError("train_dataset is empty: there is nothing to pretrain on")
        if hasattr(trainer.train_dataset, "__getitem__"):
            item = trainer.train_dataset[0]
            missing = {"pixel_values", "pixel_values_2"} - set(item)
            if missing:
                raise ValueError(
                    f"train_dataset items must hold 'pixel_values' and 'pixel_values_2' tensors; item 0 lacks "
                    f"{sorted(missing)} (it has {sorted(item)}). Wrap an image dataset with "
                    "hf_contrast.two_view_dataset(dataset, TwoViewAugmentation(...))."
                )
    if not streamed:
        check_steps(trainer)



def check_steps(trainer) -> None:
    """Refuse a map-style run that would take 0 optimizer steps (transformers would train nothing and
    report success): fewer samples than one global batch with ``dataloader_drop_last``, or 0 epochs."""
    a, data = trainer.args, trainer.train_dataset
    if data is None or isinstance(data, torch.utils.data.IterableDataset) or not hasattr(data, "__len__"):
        return
    n, b, w, g = len(data), a.per_device_train_batch_size, a.world_size, a.gradient_accumulation_steps
    batches = n // (b * w) if a.dataloader_drop_last else math.ceil(n / (b * w))  # per process and epoch
    steps = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * math.ceil(batches / g))  # as Trainer
    if batches >= 1 and steps >= 1:
        return
    setup = (f"train_dataset has {n} samples; per_device_train_batch_size={b} x world size {w} = {b * w} images "
             f"per batch with dataloader_drop_last={a.dataloader_drop_last} gives {batches} batches per epoch; "
             f"gradient_accumulation_steps={g}, num_train_epochs={a.num_train_epochs}, max_steps={a.max_steps}")
    if batches < 1:
        fix = (f"use a per-device batch of at most {max(n // w, 1)} (pretrain.py: --per_device_train_batch_size), "
               "fewer processes or more images (dataloader_drop_last=False would train on a short batch, with "
               "fewer negatives)")
    else:
        fix = "set num_train_epochs > 0 or max_steps > 0"
    raise ValueError(f"This run would take 0 optimizer steps and train nothing: {setup}. Fix: {fix}.")

# --- streamed data: the library owns the split, the position and the device augmentation ---



def log_setup(trainer) -> None:
    a = trainer.args
    if not a.should_log:  # the main process speaks for all
        return
    logger.info(  # INFO: a description, not a problem (pretrain.py's logging shows INFO)
        f"Contrastive setup: per-device batch {a.per_device_train_batch_size}, world size {a.world_size}, "
        f"gradient accumulation {a.gradient_accumulation_steps}, global batch "
        f"{a.per_device_train_batch_size * a.world_size * a.gradient_accumulation_steps}, "
        f"negatives per anchor {trainer.negatives_per_anchor()}"
        + (" (queue; fills during the first steps)" if trainer.has_queue else "")
        + " (accumulation adds none)"
    )
    warn_narrow_corpus(trainer)



def warn_narrow_corpus(trainer) -> None:
    """Warn when the negative pool is a large fraction (>= 10%) of the training set: it then holds
    earlier keys of the anchor's own image (MoCo) and many of its class (see :mod:`hf_contrast.models.corpus`)."""
    dataset = trainer.train_dataset
    if not hasattr(dataset, "__len__") or not len(dataset):
        return
    pool = trainer.negatives_per_anchor()
    cfg = trainer.accelerator.unwrap_model(trainer.model).config
    if trainer.has_queue:
        pool = cfg.queue_size  # the queue before any masking (MoCo v3: its in-batch keys come on top)
    features = getattr(getattr(dataset, "dataset", dataset), "features", None) or {}
    classes = next((f.num_classes for f in features.values() if isinstance(f, datasets.ClassLabel)), None)
    model = trainer.accelerator.unwrap_model(trainer.model)
    estimate = false_negative_estimate(pool, len(dataset), classes, queued=trainer.has_queue,
                                       keys_per_image=model.queued_views if trainer.has_queue else 1)
    if estimate.fraction < 0.1:
        return
    remedy = ""
    if trainer.has_queue and not getattr(cfg, "exclude_same_instance", False):
        remedy = ("exclude_same_instance=True masks the own-image keys (it needs items with 'instance_id', as "
                  "TwoViewDataset gives); ")
    if getattr(cfg, "false_negatives", None) is None:
        remedy += "false_negatives='eliminate' cancels likely same-class ones; "
    size = ""
    if trainer.has_queue and estimate.suggested_pool < cfg.queue_size:
        size = (f" Try queue_size={estimate.suggested_pool}: the largest queue whose own-image probability stays "
                f"under {estimate.own_image_budget:.0%} on {len(dataset):,} images (K <= 0.14 N per queued view; "
                "on the 4,000 digits 256 gave kNN 0.806 and 4,096 gave 0.768).")
    logger.warning(f"Narrow corpus: {estimate.describe()}. Every extra negative is another chance of a false "
                   f"negative: {remedy}a smaller pool may train better.{size}")


class CollapseDetector:
    """Counts logging windows in a row whose loss sits at the no-signal value or whose embeddings collapsed;
    warns at the third."""

    def __init__(self):
        self.windows = 0

    def check(self, logs: dict[str, float], dim: int, loss_scale: float, step: int) -> None:
        """Warn when the loss is pinned at the no-signal value ln(K + 1) (times MoCo v3's ``4T`` loss
        scale) or the embeddings collapsed."""
        no_signal = math.log(logs["num_negatives"] + 1) * loss_scale
        pinned = abs(logs["loss"] - no_signal) < 0.02 * no_signal and logs["num_negatives"] > 0
        collapsed = logs["embedding_std"] < 0.2 / math.sqrt(dim)
        self.windows = self.windows + 1 if (pinned or collapsed) else 0
        if self.windows == 3:  # three logging windows in a row: not a start-up transient
            what = (
                f"the loss {logs['loss']:.3f} sits at {'' if loss_scale == 1 else f'{loss_scale:g}·'}ln(K+1) = {no_signal:.3f}, the value of a model that cannot tell "
                "its positive from the negatives" if pinned else
                f"the normalised embeddings collapsed onto one direction (per-dimension std "
                f"{logs['embedding_std']:.4f}, healthy is about {1 / math.sqrt(dim):.3f})"
            )
            logger.warning(
                f"Step {step}: no learning signal: {what}. Usual causes: learning rate too high, "
                "a projection head without BatchNorm on small data, momentum too low (MoCo), a queue larger than "
                "the dataset, or augmentations too weak or too strong."
            )
