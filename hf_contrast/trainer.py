"""ContrastiveTrainer: transformers' Trainer plus the queue, the EMA and honest contrastive metrics."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from . import distributed
from .checkpointing import (
    CheckpointError,
    check_checkpoint,
    incomplete_checkpoints,
    is_complete,
    last_complete_checkpoint,
    load_rank_buffers,
    mark_complete,
    save_rank_buffers,
)
from .grad_cache import grad_cache_step
from .hub import push_encoder_to_hub
from .metrics import ContrastiveMetrics
from .modeling_moco import MoCoModel
from .modeling_mocov3 import MoCoV3Model
from .modeling_simclr import SimCLRModel
from .momentum import momentum_at
from .negatives import negatives_per_anchor

logger = logging.get_logger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; raised before the step changes weights or queue."""


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

    MoCo v3 (:class:`~hf_contrast.MoCoV3Model`): the official code updates inside ``forward``, at the
    start of iteration ``i``, with ``m_i``; here the update after optimizer step ``i`` uses ``m_{i+1}``
    (``model.momentum_schedule_offset = 1``), so every forward sees the same momentum encoder as
    there. The official no-op update of iteration 0 (momentum side still equal to the query side) is
    skipped, and the update after the last step uses ``m = 1`` (cosine): it changes nothing.
    """

    def __init__(self):
        self.last_momentum: float | None = None

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if getattr(optimizer, "step_was_skipped", False):
            return
        cfg = model.config
        step = state.global_step + getattr(model, "momentum_schedule_offset", 0)
        self.last_momentum = momentum_at(step, state.max_steps, cfg.momentum, cfg.momentum_schedule)
        model.momentum_update(self.last_momentum)


class EpochCallback(TrainerCallback):
    """Tells the training dataset which epoch starts, on every path.

    Accelerate's ``DataLoaderShard.set_epoch`` forwards the epoch to the dataset only when the
    sampler has no ``set_epoch`` of its own, which is never the case under DDP
    (``BatchSamplerShard``) or on resume (``SkipBatchSampler``): a resumed run would augment with the
    seeds of epoch 0. ``on_epoch_begin`` runs before the epoch's dataloader iterator is created, and
    ``state.epoch`` is then the (fractional, on resume) epoch reached so far.
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        dataset = self.trainer.train_dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(math.floor((state.epoch or 0.0) + 1e-6))


class ContrastiveTrainer(Trainer):
    """Trainer for :class:`MoCoModel`, :class:`MoCoV3Model` and :class:`SimCLRModel`.

    It accepts any dataset whose items hold ``pixel_values`` and ``pixel_values_2`` tensors.
    On top of ``Trainer`` it enqueues MoCo's keys after each micro-batch's loss, applies the key
    encoder's EMA once per optimizer step (:class:`MomentumCallback`) and logs, at every logging
    step: ``num_negatives`` (the true per-anchor count), ``contrastive_top1`` (how often the
    positive scores highest), ``pos_cosine``/``neg_cosine``, ``embedding_std`` (collapse check),
    and for MoCo ``momentum`` and ``queue_fill``.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, **kwargs):
        args = args if args is not None else ContrastiveTrainingArguments()
        if not isinstance(model, (MoCoModel, MoCoV3Model, SimCLRModel)):
            raise ValueError(
                f"ContrastiveTrainer needs a MoCoV3Model, MoCoModel or SimCLRModel, got {type(model).__name__}")
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
        self.is_moco = isinstance(model, MoCoModel)  # the queue-based MoCo (v2)
        self.is_mocov3 = isinstance(model, MoCoV3Model)
        self.add_callback(EpochCallback(self))
        self.momentum_callback = MomentumCallback() if self.is_moco or self.is_mocov3 else None
        if self.momentum_callback is not None:
            self.add_callback(self.momentum_callback)
        self.contrastive_metrics = ContrastiveMetrics(model.config.temperature)
        self._collapse_windows = 0
        self._validate_setup()
        if self.is_mocov3 and args.world_size > 1 and not model.config.gather_distributed:
            logger.warning(
                f"gather_distributed=False on {args.world_size} processes: each query sees only its own device's "
                f"{args.per_device_train_batch_size - 1} negative keys, not the "
                f"{args.per_device_train_batch_size * args.world_size - 1} of the global batch."
            )
        if isinstance(model, SimCLRModel) and args.world_size > 1 and not model.config.gather_distributed:
            logger.warning(
                f"gather_distributed=False on {args.world_size} processes: each anchor sees only its own device's "
                f"{2 * args.per_device_train_batch_size - 2} negatives, not the "
                f"{2 * args.per_device_train_batch_size * args.world_size - 2} of the global batch."
            )
        if isinstance(model, SimCLRModel) and args.gradient_accumulation_steps > 1:
            logger.warning(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} does not add negatives: "
                "the NT-Xent loss is computed inside each micro-batch, so each anchor still has "
                f"2 * per_device_train_batch_size * world_size - 2 negatives. Accumulation only averages "
                "gradients over more images."
            )

    def _validate_setup(self) -> None:
        """Clear errors before any work is wasted: no negatives, a queue the batch overwrites, bad data."""
        a, cfg = self.args, self.model.config
        if self.is_moco:
            keys_per_step = a.per_device_train_batch_size * a.world_size * (2 if cfg.symmetric_loss else 1)
            if keys_per_step > cfg.queue_size:
                raise ValueError(
                    f"queue_size={cfg.queue_size} is smaller than the {keys_per_step} keys enqueued per micro-batch "
                    f"(per_device_train_batch_size={a.per_device_train_batch_size} x world size {a.world_size}"
                    + (" x 2 views (symmetric_loss)" if cfg.symmetric_loss else "") + "): each step would overwrite "
                    "the whole queue. Use queue_size >= that (65536 in MoCo) or a smaller batch."
                )
            splits = cfg.key_bn_splits if cfg.shuffle_bn and a.world_size == 1 else 1
            b = a.per_device_train_batch_size
            if splits > 1 and (b % splits or b // splits < 2):
                raise ValueError(
                    f"per_device_train_batch_size={b} cannot be split into key_bn_splits={splits} equal sub-batches of "
                    f"at least 2 images (split-BN on one process): use a batch that is a multiple of {splits} and at "
                    f"least {2 * splits}, or key_bn_splits=1."
                )
        elif self.is_mocov3 and self.negatives_per_anchor() < 1:
            raise ValueError(
                f"per_device_train_batch_size={a.per_device_train_batch_size} gives MoCo v3 no negatives "
                f"(N * world size - 1 = {self.negatives_per_anchor()}): use a batch of at least 2 images."
            )
        elif self.negatives_per_anchor() < 1:
            raise ValueError(
                f"per_device_train_batch_size={a.per_device_train_batch_size} gives SimCLR no negatives "
                f"(2 * N * world size - 2 = {self.negatives_per_anchor()}): use a per-device batch of at least 2."
            )
        if self.train_dataset is not None:
            if hasattr(self.train_dataset, "__len__") and len(self.train_dataset) == 0:
                raise ValueError("train_dataset is empty: there is nothing to pretrain on")
            if hasattr(self.train_dataset, "__getitem__"):
                item = self.train_dataset[0]
                missing = {"pixel_values", "pixel_values_2"} - set(item)
                if missing:
                    raise ValueError(
                        f"train_dataset items must hold 'pixel_values' and 'pixel_values_2' tensors; item 0 lacks "
                        f"{sorted(missing)} (it has {sorted(item)}). Wrap an image dataset with "
                        "hf_contrast.two_view_dataset(dataset, TwoViewAugmentation(...))."
                    )

    def negatives_per_anchor(self) -> int:
        """Negatives each anchor will see once training runs (MoCo: with a full queue); see
        :func:`hf_contrast.negatives.negatives_per_anchor`."""
        model = self.accelerator.unwrap_model(self.model)
        return negatives_per_anchor(model.config, self.args.per_device_train_batch_size, self.args.world_size)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` picks the last COMPLETE checkpoint
        (folders half-written when a process died are skipped, with a warning)."""
        if resume_from_checkpoint is True:
            for folder in incomplete_checkpoints(self.args.output_dir):
                logger.warning(f"Skipping {folder}: it was not completely written (the process died while saving it)")
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise CheckpointError(f"No complete checkpoint to resume from in output_dir={self.args.output_dir!r}")
        elif (isinstance(resume_from_checkpoint, str) and not is_complete(resume_from_checkpoint)
              and not os.path.isfile(os.path.join(resume_from_checkpoint, "trainer_state.json"))):
            raise CheckpointError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} is not a complete checkpoint (no trainer_state.json, "
                "which the Trainer writes last). Pass resume_from_checkpoint=True to pick the last complete one."
            )
        self._log_setup()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _log_setup(self) -> None:
        a = self.args
        if not a.should_log:  # the main process speaks for all
            return
        logger.warning(
            f"Contrastive setup: per-device batch {a.per_device_train_batch_size}, world size {a.world_size}, "
            f"gradient accumulation {a.gradient_accumulation_steps}, global batch "
            f"{a.per_device_train_batch_size * a.world_size * a.gradient_accumulation_steps}, "
            f"negatives per anchor {self.negatives_per_anchor()}"
            + (" (queue; fills during the first steps)" if self.is_moco else "")
            + " (accumulation adds none)"
        )

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """Push the query encoder (timm format) with its model card, not the full checkpoint, to
        ``args.hub_model_id``; main process only. ``kwargs`` as :func:`hf_contrast.push_encoder_to_hub`."""
        return push_encoder_to_hub(self, commit_message=commit_message or "End of training", **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints stay local (full training state, and transformers pickles its training args there):
        the Hub gets the encoder export, via :meth:`push_to_hub`."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Refuse checkpoints that lack any tensor of the model (queue, key encoder, ...) before
        transformers' lenient (``strict=False``) load; then restore this process's own BatchNorm
        statistics (ranks > 0)."""
        unwrapped = self.accelerator.unwrap_model(model or self.model)
        check_checkpoint(resume_from_checkpoint, unwrapped)
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        rank = self.args.process_index
        if not load_rank_buffers(resume_from_checkpoint, unwrapped, rank) and rank > 0:
            logger.warning(f"{resume_from_checkpoint} holds no buffers of process {rank} (written by fewer processes?): "
                           "it starts from rank 0's BatchNorm statistics")

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, plus each process's own buffers, then the completion marker once every
        process has written its part, and only then the rotation of old checkpoints (transformers rotates
        before our marker exists: with ``save_total_limit=1`` a kill in that window left no complete
        checkpoint)."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # no rotation inside: the new checkpoint is not complete yet
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        save_rank_buffers(folder, self.accelerator.unwrap_model(self.model), self.args.process_index)
        distributed.barrier()  # every process's files are on disk
        if self.args.should_save and os.path.isdir(folder):
            mark_complete(folder)  # last: weights, optimizer, RNG, trainer state and every rank's buffers
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step; for SimCLR with ``grad_cache_chunk_size`` set, the gradient-cached step.

        The cached step (:func:`~hf_contrast.grad_cache.grad_cache_step`) scales the loss by the
        micro-batch's accumulation steps as Trainer does, back-propagates it through
        ``accelerator.backward`` (mixed-precision grad scaler), runs the forwards under
        ``compute_loss_context_manager`` (autocast) and lets DDP all-reduce only after the last
        chunk (inside Trainer's own ``no_sync`` for the other micro-batches of an accumulation window).
        """
        chunk_size = getattr(self.accelerator.unwrap_model(model).config, "grad_cache_chunk_size", None)
        if self.is_moco or self.is_mocov3 or chunk_size is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if self.args.n_gpu > 1:
            raise ValueError(f"grad_cache_chunk_size={chunk_size} needs one device per process (torchrun or "
                             f"accelerate launch), not torch.nn.DataParallel over {self.args.n_gpu} GPUs")
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        accumulation = self.current_gradient_accumulation_steps

        outputs = grad_cache_step(
            model, inputs["pixel_values"], inputs["pixel_values_2"], chunk_size,
            loss_scale=1.0 / accumulation,  # as Trainer: compute_loss returns a per-micro-batch mean
            backward=self.accelerator.backward,  # applies the fp16 grad scaler
            no_sync=functools.partial(self.accelerator.no_sync, model=model),
            autocast=self.compute_loss_context_manager,
            on_loss=lambda out: self._check_finite(out.loss),  # before any backward: weights untouched if it raises
        )
        self.contrastive_metrics.update(outputs)
        return outputs.loss / accumulation

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Stop with :class:`NonFiniteLossError` before a NaN/inf loss can touch the weights or the queue."""
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"Step {self.state.global_step}: the contrastive loss is {loss.item()}. Training stopped before "
                "this step could update the weights or the queue. Likely causes: a learning rate too high (the "
                "weights diverged), fp16 overflow in the backbone (use bf16), "
                f"temperature={self.model.config.temperature} too low for the precision, or NaN/inf pixels in the "
                "input batch. Resume from the last checkpoint with a lower learning rate."
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(pixel_values=inputs["pixel_values"], pixel_values_2=inputs["pixel_values_2"])
        if model.training:
            self._check_finite(outputs.loss)
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
            if self.is_mocov3 and self.momentum_callback.last_momentum is not None:
                logs["momentum"] = self.momentum_callback.last_momentum
            if self.args.collapse_warning:
                self._check_collapse(logs, model.config.projection_dim, getattr(model, "loss_scale", 1.0))
        super().log(logs, start_time)

    def _check_collapse(self, logs: dict[str, float], dim: int, loss_scale: float = 1.0) -> None:
        """Warn when the loss is pinned at the no-signal value ln(K + 1) (times MoCo v3's ``4T`` loss
        scale) or the embeddings collapsed."""
        no_signal = math.log(logs["num_negatives"] + 1) * loss_scale
        pinned = abs(logs["loss"] - no_signal) < 0.02 * no_signal and logs["num_negatives"] > 0
        collapsed = logs["embedding_std"] < 0.2 / math.sqrt(dim)
        self._collapse_windows = self._collapse_windows + 1 if (pinned or collapsed) else 0
        if self._collapse_windows == 3:  # three logging windows in a row: not a start-up transient
            what = (
                f"the loss {logs['loss']:.3f} sits at {'' if loss_scale == 1 else f'{loss_scale:g}·'}ln(K+1) = {no_signal:.3f}, the value of a model that cannot tell "
                "its positive from the negatives" if pinned else
                f"the normalised embeddings collapsed onto one direction (per-dimension std "
                f"{logs['embedding_std']:.4f}, healthy is about {1 / math.sqrt(dim):.3f})"
            )
            logger.warning(
                f"Step {self.state.global_step}: no learning signal: {what}. Usual causes: learning rate too high, "
                "a projection head without BatchNorm on small data, momentum too low (MoCo), a queue larger than "
                "the dataset, or augmentations too weak or too strong."
            )
