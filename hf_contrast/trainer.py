"""ContrastiveTrainer: transformers' Trainer plus the queue, the EMA and honest contrastive metrics."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging

from . import distributed
from .metrics import ContrastiveMetrics
from .modeling_moco import MoCoModel
from .modeling_simclr import SimCLRModel
from .momentum import momentum_at

logger = logging.get_logger(__name__)


@dataclass
class ContrastiveTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with defaults right for contrastive pretraining.

    Differences from transformers' defaults: ``remove_unused_columns=False`` (the two views are
    made on the fly by ``with_transform``), ``dataloader_drop_last=True`` (a short last batch would
    change the negative count and break cross-process gathers), ``ddp_broadcast_buffers=False``
    (every process keeps an identical queue by enqueuing gathered keys; broadcasting 32 MiB of queue
    each step would be waste), ``ddp_find_unused_parameters=False`` (every query parameter gets a
    gradient; the key side is frozen), ``logging_steps=10``, ``save_safetensors`` only.

    Args:
        collapse_warning: warn when the loss sits at the no-signal value ``ln(K + 1)`` or the
            normalised embeddings collapse onto one direction.
    """

    output_dir: str | None = field(default="outputs", metadata={"help": "Where checkpoints and the final model go."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep pixel_values_2 (made by with_transform)."})
    dataloader_drop_last: bool = field(default=True, metadata={"help": "Constant batch size: constant negatives."})
    ddp_broadcast_buffers: bool = field(default=False, metadata={"help": "Queues stay equal by gathering keys."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every query parameter is used; the key side has no gradient."})
    logging_steps: float = field(default=10, metadata={"help": "Log contrastive metrics every N steps."})
    collapse_warning: bool = field(default=True, metadata={"help": "Warn on the collapse / no-signal signature."})


class MomentumCallback(TrainerCallback):
    """Applies MoCo's EMA exactly once per optimizer step, with the momentum of the schedule.

    ``on_optimizer_step`` fires once per real optimizer step (after the last micro-batch of a
    gradient accumulation window), before ``global_step`` is incremented, so ``state.global_step``
    is the 0-based index of the step just taken. A step the fp16 grad scaler skipped is not an
    update of the query encoder, so the key encoder does not move either.
    """

    def __init__(self):
        self.last_momentum: float | None = None

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(optimizer, "step_was_skipped", False):
            return
        cfg = model.config
        self.last_momentum = momentum_at(state.global_step, state.max_steps, cfg.momentum, cfg.momentum_schedule)
        model.momentum_update(self.last_momentum)


class ContrastiveTrainer(Trainer):
    """Trainer for :class:`MoCoModel` and :class:`SimCLRModel`.

    It accepts any dataset whose items hold ``pixel_values`` and ``pixel_values_2`` tensors.
    On top of ``Trainer`` it enqueues MoCo's keys after each micro-batch's loss, applies the key
    encoder's EMA once per optimizer step (:class:`MomentumCallback`) and logs, at every logging
    step: ``num_negatives`` (the true per-anchor count), ``contrastive_top1`` (how often the
    positive scores highest), ``pos_cosine``/``neg_cosine``, ``embedding_std`` (collapse check),
    and for MoCo ``momentum`` and ``queue_fill``.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, **kwargs):
        args = args if args is not None else ContrastiveTrainingArguments()
        if not isinstance(model, (MoCoModel, SimCLRModel)):
            raise ValueError(f"ContrastiveTrainer needs a MoCoModel or SimCLRModel, got {type(model).__name__}")
        sharded = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or os.environ.get(
            "ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if args.fsdp or args.deepspeed or sharded:
            raise ValueError(
                "ContrastiveTrainer does not support FSDP or DeepSpeed (fsdp="
                f"{args.fsdp!r}, deepspeed={args.deepspeed!r}): MoCo's key encoder EMA needs the full query weights "
                "next to the key weights on every process, and the queue must stay identical across processes. "
                "Use DDP (plain torchrun / accelerate launch), which is what the default arguments give."
            )
        super().__init__(model=model, args=args, **kwargs)
        self.is_moco = isinstance(model, MoCoModel)
        self.momentum_callback = MomentumCallback() if self.is_moco else None
        if self.momentum_callback is not None:
            self.add_callback(self.momentum_callback)
        self.contrastive_metrics = ContrastiveMetrics(model.config.temperature)
        self._collapse_windows = 0
        if not self.is_moco and args.world_size > 1 and not model.config.gather_distributed:
            logger.warning(
                f"gather_distributed=False on {args.world_size} processes: each anchor sees only its own device's "
                f"{2 * args.per_device_train_batch_size - 2} negatives, not the "
                f"{2 * args.per_device_train_batch_size * args.world_size - 2} of the global batch."
            )
        if not self.is_moco and args.gradient_accumulation_steps > 1:
            logger.warning(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} does not add negatives: "
                "the NT-Xent loss is computed inside each micro-batch, so each anchor still has "
                f"2 * per_device_train_batch_size * world_size - 2 negatives. Accumulation only averages "
                "gradients over more images."
            )

    def negatives_per_anchor(self) -> int:
        """Negatives each anchor will see once training runs (MoCo: with a full queue)."""
        model = self.accelerator.unwrap_model(self.model)
        if self.is_moco:
            return model.config.queue_size
        world = self.args.world_size if model.config.gather_distributed else 1
        return 2 * self.args.per_device_train_batch_size * world - 2

    def train(self, *args, **kwargs):
        a = self.args
        logger.warning(
            f"Contrastive setup: per-device batch {a.per_device_train_batch_size}, world size {a.world_size}, "
            f"gradient accumulation {a.gradient_accumulation_steps}, global batch "
            f"{a.per_device_train_batch_size * a.world_size * a.gradient_accumulation_steps}, "
            f"negatives per anchor {self.negatives_per_anchor()}"
            + (" (queue; fills during the first steps)" if self.is_moco else "")
            + " (accumulation adds none)"
        )
        return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(pixel_values=inputs["pixel_values"], pixel_values_2=inputs["pixel_values_2"])
        if model.training:
            unwrapped = self.accelerator.unwrap_model(model)
            if outputs.queue_keys is not None:
                unwrapped.enqueue(distributed.gather_no_grad(outputs.queue_keys))  # after the loss used the queue
                self._notify_enqueue(unwrapped, inputs, outputs)
            self.contrastive_metrics.update(outputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _notify_enqueue(self, model, inputs, outputs) -> None:
        """Call ``on_enqueue(model=, key_pixel_values=, keys=, state=)`` on every callback that has it.

        ``keys`` are this process's keys ``(B', D)`` (before the cross-process gather) and
        ``key_pixel_values`` the images they were computed from, row for row (MoCo's second views,
        then the first views with ``symmetric_loss``). Diagnostics such as queue consistency use it."""
        listeners = [cb for cb in self.callback_handler.callbacks if hasattr(cb, "on_enqueue")]
        if not listeners:
            return
        key_images = inputs["pixel_values_2"]
        if outputs.queue_keys.shape[0] != key_images.shape[0]:  # symmetric: keys of view 2, then of view 1
            key_images = torch.cat([inputs["pixel_values_2"], inputs["pixel_values"]])
        for cb in listeners:
            cb.on_enqueue(model=model, key_pixel_values=key_images, keys=outputs.queue_keys, state=self.state)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.contrastive_metrics.count:  # a training log, not eval
            metrics = self.contrastive_metrics.compute_and_reset()
            logs.update(metrics)
            model = self.accelerator.unwrap_model(self.model)
            if self.is_moco:
                if self.momentum_callback.last_momentum is not None:
                    logs["momentum"] = self.momentum_callback.last_momentum
                logs["queue_fill"] = int(model.queue_filled) / model.config.queue_size
            if self.args.collapse_warning:
                self._check_collapse(logs, model.config.projection_dim)
        super().log(logs, start_time)

    def _check_collapse(self, logs: dict[str, float], dim: int) -> None:
        """Warn when the loss is pinned at the no-signal value ln(K + 1) or the embeddings collapsed."""
        no_signal = math.log(logs["num_negatives"] + 1)
        pinned = abs(logs["loss"] - no_signal) < 0.02 * no_signal and logs["num_negatives"] > 0
        collapsed = logs["embedding_std"] < 0.2 / math.sqrt(dim)
        self._collapse_windows = self._collapse_windows + 1 if (pinned or collapsed) else 0
        if self._collapse_windows == 3:  # three logging windows in a row: not a start-up transient
            what = (
                f"the loss {logs['loss']:.3f} sits at ln(K+1) = {no_signal:.3f}, the value of a model that cannot tell "
                "its positive from the negatives" if pinned else
                f"the normalised embeddings collapsed onto one direction (per-dimension std "
                f"{logs['embedding_std']:.4f}, healthy is about {1 / math.sqrt(dim):.3f})"
            )
            logger.warning(
                f"Step {self.state.global_step}: no learning signal: {what}. Usual causes: learning rate too high, "
                "a projection head without BatchNorm on small data, momentum too low (MoCo), a queue larger than "
                "the dataset, or augmentations too weak or too strong."
            )
