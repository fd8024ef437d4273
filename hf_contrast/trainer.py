"""ContrastiveTrainer: transformers' Trainer plus the queue, the EMA and honest contrastive metrics."""

from __future__ import annotations

import copy
import functools
import math
import os
import time
import warnings
from dataclasses import dataclass, field

import datasets
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from . import distributed
from .checkpointing import (
    RESUME_LAST,
    CheckpointError,
    check_checkpoint,
    incomplete_checkpoints,
    last_complete_checkpoint,
    load_rank_buffers,
    load_stream_state,
    mark_complete,
    resume_target,
    save_rank_buffers,
    save_stream_state,
)
from .corpus import false_negative_estimate
from .device_augment import DeviceAugmentation
from .grad_cache import grad_cache_step
from .hub import push_encoder_to_hub
from .loss_guard import NonFiniteLossError, NonFiniteLossGuard
from .metrics import ContrastiveMetrics
from .modeling_base import ContrastivePreTrainedModel
from .momentum import momentum_at
from .negatives import negatives_per_anchor
from .streaming import StreamingTwoViewDataset
from .throughput import ThroughputMeter, batch_size_of

logger = logging.get_logger(__name__)


__all__ = ["ContrastiveTrainer", "ContrastiveTrainingArguments", "MomentumCallback", "EpochCallback",
           "NonFiniteLossError"]


@dataclass
class ContrastiveTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with defaults right for contrastive pretraining.

    Differences from transformers' defaults: ``remove_unused_columns=False`` (the two views are
    made on the fly by ``with_transform``), ``dataloader_drop_last=True`` (a short last batch would
    change the negative count and break cross-process gathers), ``ddp_broadcast_buffers=False``
    (every process keeps an identical queue by enqueuing gathered keys; broadcasting 32 MiB of queue
    each step would be waste), ``ddp_find_unused_parameters=False`` (every query parameter gets a
    gradient; the key side is frozen), ``logging_steps=10``, ``save_safetensors`` only,
    ``logging_nan_inf_filter=False`` (its check reads the loss on the host at every step; the trainer's
    own guard raises on a non-finite loss at the next logging step, see
    :class:`~hf_contrast.loss_guard.NonFiniteLossGuard`).

    Args:
        channels_last: keep the model and the views in ``torch.channels_last`` (NHWC), where cuDNN's
            convolutions and BatchNorm run without layout conversions. ``None`` (default): on for a CUDA
            device and a convolutional backbone (not a ViT); ``True`` forces it, ``False`` turns it off.
        collapse_warning: warn when the loss sits at the no-signal value ``ln(K + 1)`` or the
            normalised embeddings collapse onto one direction.
        device_augmentation: with a :class:`~hf_contrast.streaming.StreamingTwoViewDataset` or a
            :class:`~hf_contrast.TwoViewDataset`, the workers only decode and resize to ``uint8`` and draw
            each view's parameters; both views are made in the training step on the model's device
            (:class:`~hf_contrast.DeviceAugmentation`, a few batched kernels).

    ``accelerator_config`` defaults to ``{"non_blocking": True}`` on CUDA: batches are copied to the device
    from pinned memory without waiting for it (a blocking copy is a host-device sync in every step).
    """

    output_dir: str | None = field(default="outputs", metadata={"help": "Where checkpoints and the final model go."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep pixel_values_2 (made by with_transform)."})
    dataloader_drop_last: bool = field(default=True, metadata={"help": "Constant batch size: constant negatives."})
    ddp_broadcast_buffers: bool = field(default=False, metadata={"help": "Queues stay equal by gathering keys."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every query parameter is used; the key side has no gradient."})
    logging_nan_inf_filter: bool = field(default=False, metadata={
        "help": "Off: its per-step host read of the loss is a device sync; non-finite losses raise instead."})
    channels_last: bool | None = field(default=None, metadata={
        "help": "Model and views in channels_last (NHWC). Default: on for CUDA with a convolutional backbone."})
    logging_steps: float = field(default=10, metadata={"help": "Log contrastive metrics every N steps."})
    collapse_warning: bool = field(default=True, metadata={"help": "Warn on the collapse / no-signal signature."})
    device_augmentation: bool = field(default=False, metadata={
        "help": "Workers only decode and resize; the views are made batched on the model's device."})

    def __post_init__(self):
        cuda = torch.cuda.is_available() and not self.use_cpu
        if self.accelerator_config is None and cuda:
            self.accelerator_config = {"non_blocking": True}  # pinned batches copied without a host-device sync
        if not cuda:
            self.dataloader_pin_memory = False  # pinning without an accelerator only warns
        super().__post_init__()


class MomentumCallback(TrainerCallback):
    """Applies MoCo's EMA exactly once per optimizer step, with the momentum of the schedule.

    ``on_optimizer_step`` fires once per real optimizer step (after the last micro-batch of a
    gradient accumulation window), before ``global_step`` is incremented, so ``state.global_step``
    is the 0-based index of the step just taken. A step the fp16 grad scaler skipped is not an
    update of the query encoder, so the key encoder does not move either.

    A skip is seen two ways: accelerate's ``step_was_skipped`` (set when the scaler did not call the
    optimizer), and a drop of the scaler's scale across the step. The second is needed for fused
    optimizers (Trainer's default ``adamw_torch_fused``): the scaler always calls them and they skip
    the update themselves, so ``step_was_skipped`` stays False. Reading the scale is a host sync, paid
    only when a grad scaler is enabled (fp16).

    MoCo v3 (:class:`~hf_contrast.MoCoV3Model`): the official code updates inside ``forward``, at the
    start of iteration ``i``, with ``m_i``; here the update after optimizer step ``i`` uses ``m_{i+1}``
    (``model.momentum_schedule_offset = 1``), so every forward sees the same momentum encoder as
    there. The official no-op update of iteration 0 (momentum side still equal to the query side) is
    skipped, and the update after the last step uses ``m = 1`` (cosine): it changes nothing.
    """

    def __init__(self):
        self.last_momentum: float | None = None
        self._scale: float | None = None

    @staticmethod
    def _grad_scale(optimizer) -> float | None:
        scaler = getattr(optimizer, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._scale = self._grad_scale(optimizer)

    def _step_was_skipped(self, optimizer) -> bool:
        scale, before = self._grad_scale(optimizer), self._scale
        self._scale = scale
        shrunk = scale is not None and before is not None and scale < before  # the scaler backs off only on inf
        return bool(getattr(optimizer, "step_was_skipped", False)) or shrunk

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._step_was_skipped(optimizer):
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


class StreamEpochCallback(TrainerCallback):
    """``state.epoch`` of a streamed run: the stream's own position (epoch + batches taken / batches per epoch).

    transformers counts an epoch as ``max_steps`` when the dataset has no length, so a 20-step run over a
    stream of 4,000 images logged ``epoch: 1`` after 640 of them; the logs, the checkpoints' trainer state and
    the model card read ``state.epoch``, set here after every step.
    """

    def __init__(self, stream):
        self.stream = stream
        self._per_epoch: dict[int, int] = {}

    def on_step_end(self, args, state, control, **kwargs):
        position = self.stream.state_dict()
        epoch = position["epoch"]
        if epoch not in self._per_epoch:  # a shard plan per epoch: computed once
            self._per_epoch[epoch] = self.stream.batches_per_epoch(epoch)
        state.epoch = epoch + position["batches"] / self._per_epoch[epoch]


class ContrastiveTrainer(Trainer):
    """Trainer for any :class:`~hf_contrast.modeling_base.ContrastivePreTrainedModel` (:class:`MoCoModel`,
    :class:`MoCoV3Model`, :class:`SimCLRModel`, or a method of your own: it asks only the method interface).

    It accepts any dataset whose items hold ``pixel_values`` and ``pixel_values_2`` tensors.
    On top of ``Trainer`` it enqueues MoCo's keys after each micro-batch's loss, applies the key
    encoder's EMA once per optimizer step (:class:`MomentumCallback`) and logs, at every logging
    step: ``num_negatives`` (the true per-anchor count), ``contrastive_top1`` (how often the
    positive scores highest), ``pos_cosine``/``neg_cosine``, ``embedding_std`` (collapse check),
    for MoCo ``momentum`` and ``queue_fill``, for MoCo v3 ``momentum`` (and ``queue_fill`` with
    ``queue_size > 0``: its queue is enqueued as MoCo's, both views' keys once per micro-batch).
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, **kwargs):
        args = args if args is not None else ContrastiveTrainingArguments()
        if not isinstance(model, ContrastivePreTrainedModel):
            raise ValueError(f"ContrastiveTrainer needs a contrastive model (a ContrastivePreTrainedModel: MoCoModel, "
                             f"MoCoV3Model, SimCLRModel or your own method), got {type(model).__name__}")
        sharded = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or os.environ.get(
            "ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if args.fsdp or args.deepspeed or sharded:
            raise ValueError(
                "ContrastiveTrainer does not support FSDP or DeepSpeed (fsdp="
                f"{args.fsdp!r}, deepspeed={args.deepspeed!r}): MoCo's key encoder EMA needs the full query weights "
                "next to the key weights on every process, and the queue must stay identical across processes. "
                "Use DDP (plain torchrun / accelerate launch), which is what the default arguments give."
            )
        if isinstance(kwargs.get("train_dataset"), StreamingTwoViewDataset) and args.max_steps <= 0:
            raise ValueError(f"max_steps={args.max_steps}: a streamed train_dataset has no length, so training needs "
                             "max_steps > 0 (pretrain.py: --max_steps N; hf_contrast.streaming.steps_for_epochs "
                             "gives the steps of a number of epochs)")
        super().__init__(model=model, args=args, **kwargs)
        self.has_queue = model.has_queue  # keys enqueued after each loss
        self.add_callback(EpochCallback(self))
        if isinstance(self.train_dataset, StreamingTwoViewDataset):  # epoch = the stream's position
            self.add_callback(StreamEpochCallback(self.train_dataset))
        self.momentum_callback = MomentumCallback() if model.has_momentum_encoder else None
        if self.momentum_callback is not None:
            self.add_callback(self.momentum_callback)
        self.contrastive_metrics = ContrastiveMetrics(model.config.temperature)
        self.loss_guard = NonFiniteLossGuard()
        self.throughput = ThroughputMeter()
        self.add_callback(self.throughput)
        self._collapse_windows = 0
        self.channels_last = self._use_channels_last(model)
        if self.channels_last:  # parameters keep their identity: optimizer, EMA pairs and names are unchanged
            model.to(memory_format=torch.channels_last)
        self._validate_setup()
        if model.in_batch_negatives and args.world_size > 1 and not getattr(model.config, "gather_distributed", True):
            as_gathered = copy.copy(model.config)
            as_gathered.gather_distributed = True
            gathered = negatives_per_anchor(as_gathered, args.per_device_train_batch_size, args.world_size)
            logger.warning(
                f"gather_distributed=False on {args.world_size} processes: each anchor sees only its own device's "
                f"{self.negatives_per_anchor()} negatives, not the {gathered} of the global batch."
            )
        if model.in_batch_negatives and not model.has_queue and args.gradient_accumulation_steps > 1:
            logger.warning(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} does not add negatives: "
                "the loss is computed inside each micro-batch, so each anchor still has "
                f"{self.negatives_per_anchor()} negatives. Accumulation only averages gradients over more images."
            )

    def _validate_setup(self) -> None:
        """Clear errors before any work is wasted: no negatives, a queue the batch overwrites, bad data."""
        a = self.args
        self.model.check_training_setup(a.per_device_train_batch_size, a.world_size)  # the method's own checks
        streamed = isinstance(self.train_dataset, StreamingTwoViewDataset)
        device_views = getattr(a, "device_augmentation", False) and not streamed
        if device_views and not hasattr(self.train_dataset, "configure_device_augmentation"):
            raise ValueError("device_augmentation=True needs a TwoViewDataset (hf_contrast.two_view_dataset) or a "
                             "streamed StreamingTwoViewDataset: their workers ship the uint8 images and view "
                             f"parameters the device augments, got {type(self.train_dataset).__name__}")
        if device_views:
            self.train_dataset.configure_device_augmentation()  # items: images (uint8) + view_params
        if streamed:
            self._configure_stream()  # too few shards for ranks x workers: a clear error before training
        elif (self.train_dataset is not None and not device_views
              and not isinstance(self.train_dataset, torch.utils.data.IterableDataset)):
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
        if not streamed:
            self._check_steps()

    def _check_steps(self) -> None:
        """Refuse a map-style run that would take 0 optimizer steps (transformers would train nothing and
        report success): fewer samples than one global batch with ``dataloader_drop_last``, or 0 epochs."""
        a, data = self.args, self.train_dataset
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
    def _configure_stream(self) -> StreamingTwoViewDataset:
        a = self.args
        return self.train_dataset.configure(a.per_device_train_batch_size, a.process_index, a.world_size,
                                            a.dataloader_num_workers, getattr(a, "device_augmentation", False))

    def get_train_dataloader(self):
        """Trainer's dataloader; for a :class:`StreamingTwoViewDataset` its own
        :class:`~hf_contrast.streaming.StreamLoader`, never passed to ``accelerator.prepare``: Accelerate
        would dispatch every batch from rank 0 or shard the stream a second time."""
        if not isinstance(self.train_dataset, StreamingTwoViewDataset):
            return super().get_train_dataloader()
        a = self.args
        return self._configure_stream().loader(
            pin_memory=a.dataloader_pin_memory and torch.cuda.is_available(),
            prefetch_factor=a.dataloader_prefetch_factor, multiprocessing_context=a.dataloader_multiprocessing_context)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """A stream resumes from the position restored with the checkpoint, not by iterating
        ``num_batches`` batches (which would decode and augment them all again)."""
        if isinstance(self.train_dataset, StreamingTwoViewDataset):
            return dataloader
        return super().get_resumed_dataloader(dataloader, num_batches)

    def _prepare_inputs(self, inputs):
        """Trainer's device placement; then, for a device-augmentation batch (``images``, ``view_params``),
        the two views made on the model's device (uint8 images and parameters copied without blocking)."""
        if "view_params" not in inputs:
            return super()._prepare_inputs(inputs)
        inputs = dict(inputs)
        device = self.args.device
        raw = {k: inputs.pop(k).to(device, non_blocking=True) for k in ("images", "view_params")}
        if getattr(self, "_device_augmentation", None) is None:  # made once: its constants are cached per device
            layout = torch.channels_last if self.channels_last else torch.contiguous_format
            self._device_augmentation = DeviceAugmentation(self.train_dataset.augmentation, memory_format=layout)
        return self._device_augmentation.inputs({**self._prepare_input(inputs), **raw})  # the rest may be empty

    def negatives_per_anchor(self) -> int:
        """Negatives each anchor will see once training runs (MoCo: with a full queue); see
        :func:`hf_contrast.negatives.negatives_per_anchor`."""
        model = self.accelerator.unwrap_model(self.model)
        return model.negatives_per_anchor(self.args.per_device_train_batch_size, self.args.world_size)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``, resuming as the command line says it.

        Args:
            resume_from_checkpoint: ``True``, ``"true"`` or ``"last"``: the last COMPLETE checkpoint of
                ``output_dir`` (folders half-written when a process died are skipped, with a warning); a path: that
                checkpoint folder, which must be complete; ``None``, ``False`` or ``"false"``: start afresh.

        Raises:
            CheckpointError: before any step, when there is no checkpoint to resume from or the path is not one.

        An error during training names the last complete checkpoint (kept on disk) and how to resume from it.
        """
        if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str)
                                              and resume_from_checkpoint.strip().lower() in RESUME_LAST):
            for folder in incomplete_checkpoints(self.args.output_dir):
                logger.warning(f"Skipping {folder}: it was not completely written (the process died while saving it)")
        resume_from_checkpoint = resume_target(resume_from_checkpoint, self.args.output_dir)
        self._log_setup()
        try:
            with warnings.catch_warnings():
                # torch >= 2.13 deprecates DDP's broadcast_buffers (transformers passes ddp_broadcast_buffers=False
                # through accelerate) for forward_sync_buffers, which would still broadcast rank 0's buffers at
                # wrap time and so overwrite the per-process BatchNorm statistics a resume just restored. The
                # warning itself says to keep broadcast_buffers=False for rank-local buffers: there is nothing to act on.
                warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
                output = super().train(resume_from_checkpoint, *args, **kwargs)
        except (Exception, KeyboardInterrupt) as error:
            last = last_complete_checkpoint(self.args.output_dir) if self.args.should_save else None
            note = (f"hf_contrast: the last complete checkpoint, {last}, is kept: resume from it with "
                    f"resume_from_checkpoint='last' (training/pretrain.py: --resume_from_checkpoint last)." if last
                    else f"hf_contrast: no complete checkpoint was saved in {self.args.output_dir} before this error.")
            if self.args.should_save:
                if hasattr(error, "add_note"):  # Python >= 3.11: shown under the traceback
                    error.add_note(note)
                logger.error(note)
            raise
        self._check_loss_guard()  # steps after the last logging step
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's ``save_model``, refused (:class:`NonFiniteLossError`) after a non-finite loss."""
        self._check_loss_guard()
        return super().save_model(output_dir, _internal_call)

    def _check_loss_guard(self) -> None:
        self.loss_guard.check(self.accelerator.unwrap_model(self.model).config.temperature, self.args.world_size)

    def _use_channels_last(self, model) -> bool:
        """``args.channels_last``, or when None: a CUDA device and a convolutional (not patch) backbone."""
        want = getattr(self.args, "channels_last", None)
        if want is not None:
            return bool(want)
        convolutional = any(isinstance(m, torch.nn.Conv2d) for m in model.encoder.modules()) and not hasattr(
            getattr(model.encoder, "patch_embed", None), "proj")
        return self.args.device.type == "cuda" and convolutional

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """Trainer's fetch of the next micro-batches, timed for ``data_wait_fraction`` and counted for
        ``images_per_second``."""
        start = time.perf_counter()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.throughput.fetched(time.perf_counter() - start, sum(batch_size_of(b) for b in batches))
        return batches, num_items

    def floating_point_ops(self, inputs) -> int:
        """Trainer's FLOP estimate (6 x parameters x elements of the main input, its convention), with the
        parameter count computed once instead of on every micro-batch (1.2 ms for MoCo resnet50)."""
        main = getattr(self.model, "main_input_name", "pixel_values")
        if main not in inputs:
            return 0
        if getattr(self, "_num_parameters", None) is None:
            self._num_parameters = self.accelerator.unwrap_model(self.model).num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._num_parameters

    def _log_setup(self) -> None:
        a = self.args
        if not a.should_log:  # the main process speaks for all
            return
        logger.info(  # INFO: a description, not a problem (pretrain.py's logging shows INFO)
            f"Contrastive setup: per-device batch {a.per_device_train_batch_size}, world size {a.world_size}, "
            f"gradient accumulation {a.gradient_accumulation_steps}, global batch "
            f"{a.per_device_train_batch_size * a.world_size * a.gradient_accumulation_steps}, "
            f"negatives per anchor {self.negatives_per_anchor()}"
            + (" (queue; fills during the first steps)" if self.has_queue else "")
            + " (accumulation adds none)"
        )
        self._warn_narrow_corpus()

    def _warn_narrow_corpus(self) -> None:
        """Warn when the negative pool is a large fraction (>= 10%) of the training set: it then holds
        earlier keys of the anchor's own image (MoCo) and many of its class (see :mod:`hf_contrast.corpus`)."""
        dataset = self.train_dataset
        if not hasattr(dataset, "__len__") or not len(dataset):
            return
        pool = self.negatives_per_anchor()
        cfg = self.accelerator.unwrap_model(self.model).config
        if self.has_queue:
            pool = cfg.queue_size  # the queue before any masking (MoCo v3: its in-batch keys come on top)
        features = getattr(getattr(dataset, "dataset", dataset), "features", None) or {}
        classes = next((f.num_classes for f in features.values() if isinstance(f, datasets.ClassLabel)), None)
        model = self.accelerator.unwrap_model(self.model)
        estimate = false_negative_estimate(pool, len(dataset), classes, queued=self.has_queue,
                                           keys_per_image=model.queued_views if self.has_queue else 1)
        if estimate.fraction < 0.1:
            return
        remedy = ""
        if self.has_queue and not getattr(cfg, "exclude_same_instance", False):
            remedy = ("exclude_same_instance=True masks the own-image keys (it needs items with 'instance_id', as "
                      "TwoViewDataset gives); ")
        if getattr(cfg, "false_negatives", None) is None:
            remedy += "false_negatives='eliminate' cancels likely same-class ones; "
        size = ""
        if self.has_queue and estimate.suggested_pool < cfg.queue_size:
            size = (f" Try queue_size={estimate.suggested_pool}: the largest queue whose own-image probability stays "
                    f"under {estimate.own_image_budget:.0%} on {len(dataset):,} images (K <= 0.14 N per queued view; "
                    "on the 4,000 digits 256 gave kNN 0.806 and 4,096 gave 0.768).")
        logger.warning(f"Narrow corpus: {estimate.describe()}. Every extra negative is another chance of a false "
                       f"negative: {remedy}a smaller pool may train better.{size}")

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
        if unwrapped.has_queue:
            unwrapped.queue.sync_from_buffers()  # the host-side pointer and fill count (one sync, at load)
        rank = self.args.process_index
        if isinstance(self.train_dataset, StreamingTwoViewDataset):
            state = load_stream_state(resume_from_checkpoint, rank)
            if state is None:
                raise CheckpointError(f"{resume_from_checkpoint} holds no stream position of process {rank}: the "
                                      "stream cannot resume exactly (it was written without a streamed dataset?)")
            self.train_dataset.load_state_dict(state)
        if not load_rank_buffers(resume_from_checkpoint, unwrapped, rank) and rank > 0:
            logger.warning(f"{resume_from_checkpoint} holds no buffers of process {rank} (written by fewer processes?): "
                           "it starts from rank 0's BatchNorm statistics")

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, plus each process's own buffers, then the completion marker once every
        process has written its part, and only then the rotation of old checkpoints (transformers rotates
        before our marker exists: with ``save_total_limit=1`` a kill in that window left no complete
        checkpoint)."""
        self._check_loss_guard()  # never a checkpoint of weights that a non-finite step touched
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # no rotation inside: the new checkpoint is not complete yet
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        save_rank_buffers(folder, self.accelerator.unwrap_model(self.model), self.args.process_index)
        if isinstance(self.train_dataset, StreamingTwoViewDataset):
            save_stream_state(folder, self.train_dataset.state_dict(), self.args.process_index)
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
        if chunk_size is None:  # grad_cache_chunk_size: an in-batch method's (SimCLR's) option
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
            on_loss=lambda out: self.loss_guard.update(out.loss, self.state.global_step),  # recorded on the device
        )
        self.contrastive_metrics.update(outputs)
        return outputs.loss / accumulation

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's contrastive loss of the two views; in training, then the loss guard's device-side
        record and the enqueue of the micro-batch's gathered keys (after the loss used the queue). No
        value is read on the host here: a non-finite loss is reported at the next logging step or save."""
        ids = inputs.get("instance_id") if self.has_queue else None  # TwoViewDataset items carry it
        views = inputs["pixel_values"], inputs["pixel_values_2"]
        if self.channels_last:  # a no-op for views already in channels_last
            views = tuple(v.contiguous(memory_format=torch.channels_last) for v in views)
        outputs = model(pixel_values=views[0], pixel_values_2=views[1], **({} if ids is None else {"instance_ids": ids}))
        if model.training:
            accept = self.loss_guard.update(outputs.loss, self.state.global_step)  # () bool: all losses finite so far
            unwrapped = self.accelerator.unwrap_model(model)
            if outputs.queue_keys is not None:
                ids = outputs.queue_instance_ids
                unwrapped.enqueue(  # keys of a non-finite step (and later) do not enter: accept is False
                    distributed.gather_no_grad(outputs.queue_keys),
                    None if ids is None else distributed.gather_no_grad(ids), step=self.state.global_step,
                    check_finite=False, accept=accept)
                self._notify_enqueue(unwrapped, inputs, outputs)
            self.contrastive_metrics.update(outputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def get_eval_dataloader(self, eval_dataset=None):
        """Trainer's, but keeping the last short batch: ``dataloader_drop_last`` (on by default, for a constant
        number of negatives in training) must not leave images out of an evaluation."""
        return self._keeping_last_batch(super().get_eval_dataloader, eval_dataset)

    def get_test_dataloader(self, test_dataset):
        """Trainer's, keeping the last short batch: :meth:`predict` returns one row per image."""
        return self._keeping_last_batch(super().get_test_dataloader, test_dataset)

    def _keeping_last_batch(self, make, dataset):
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            return make(dataset)
        finally:
            self.args.dataloader_drop_last = drop_last

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """One evaluation / prediction batch, read-only: the queue, the key encoder's EMA, BatchNorm
        statistics and the training metrics are left as they were.

        Returns ``(loss, embeddings, None)``: ``loss`` is the contrastive loss of the two views (``None``
        when items have no ``pixel_values_2``), and ``embeddings`` are the query encoder's features
        ``(B, F)`` of ``pixel_values`` (what the exported encoder gives), only when predictions are asked
        for (:meth:`predict`). MoCo's ``(B, 1 + K)`` logits are never kept, so an evaluation over 10,000
        images at ``K = 65536`` holds no 2.6 GB of logits. The contrastive metrics of the batch go into
        the evaluation's running metrics (``eval_contrastive_top1``, ``eval_pos_cosine``...).
        """
        inputs = self._prepare_inputs(inputs)
        loss, features = None, None
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad(), self.compute_loss_context_manager():
            if "pixel_values_2" in inputs:
                outputs = model(pixel_values=inputs["pixel_values"], pixel_values_2=inputs["pixel_values_2"])
                loss = outputs.loss.detach().float()
                self._eval_metrics.update(outputs)
            if not prediction_loss_only:
                features = unwrapped.encoder(inputs["pixel_values"]).float()  # (B, F)
        return loss, features, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop (global RNG state restored afterwards), with the contrastive metrics of the evaluated
        pairs added as ``{metric_key_prefix}_contrastive_top1``, ``_pos_cosine``, ``_neg_cosine``, ``_embedding_std``,
        ``_num_negatives`` (averaged over batches and processes)."""
        self._eval_metrics = ContrastiveMetrics(self.accelerator.unwrap_model(self.model).config.temperature)
        # The DataLoader draws its base seed from the global RNG: fork it, so that evaluating mid-training
        # leaves the training run's random stream (split-BN permutations, dropout) exactly as it was.
        devices = [self.args.device] if self.args.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        if self._eval_metrics.count:
            metrics = self._eval_metrics.compute_and_reset()
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in metrics.items()})
        return output

    def _notify_enqueue(self, model, inputs, outputs) -> None:
        """Call ``on_enqueue(model=, key_pixel_values=, keys=, state=)`` on every callback that has it.

        ``keys`` are this process's keys ``(B', D)`` (before the cross-process gather) and
        ``key_pixel_values`` the images they were computed from, row for row (MoCo's second views,
        then the first views with ``symmetric_loss`` and for MoCo v3). Diagnostics such as queue consistency use it."""
        listeners = [cb for cb in self.callback_handler.callbacks if hasattr(cb, "on_enqueue")]
        if not listeners:
            return
        key_images = inputs["pixel_values_2"]
        if outputs.queue_keys.shape[0] != key_images.shape[0]:  # symmetric: keys of view 2, then of view 1
            key_images = torch.cat([inputs["pixel_values_2"], inputs["pixel_values"]])
        for cb in listeners:
            cb.on_enqueue(model=model, key_pixel_values=key_images, keys=outputs.queue_keys, state=self.state)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log; a training log first checks the loss guard (on every process: it raises
        :class:`NonFiniteLossError` there), then adds the contrastive metrics accumulated on the device
        since the last log, the throughput (``images_per_second``, ``images_per_second_per_process``,
        ``data_wait_fraction``) and, for MoCo, ``momentum`` and ``queue_fill``."""
        if "loss" in logs:
            self._check_loss_guard()
            logs.update(self.throughput.read_and_reset(self.args.device))
            if getattr(self.train_dataset, "skip_bad_samples", 0):  # unreadable images replaced so far, all ranks
                ids = distributed.gather_objects(self.train_dataset.skipped_sample_ids())
                logs["skipped_samples"] = len(set().union(*ids))
        if "loss" in logs and self.contrastive_metrics.count:  # a training log, not eval
            metrics = self.contrastive_metrics.compute_and_reset()
            logs.update(metrics)
            model = self.accelerator.unwrap_model(self.model)
            if self.momentum_callback is not None and self.momentum_callback.last_momentum is not None:
                logs["momentum"] = self.momentum_callback.last_momentum
            if self.has_queue:
                logs["queue_fill"] = int(model.queue_filled) / model.config.queue_size
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
