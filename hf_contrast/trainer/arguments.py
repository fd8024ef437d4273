"""ContrastiveTrainingArguments: TrainingArguments with defaults right for contrastive pretraining."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments


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
    :class:`~hf_contrast.trainer.loss_guard.NonFiniteLossGuard`).

    Args:
        channels_last: keep the model and the views in ``torch.channels_last`` (NHWC), where cuDNN's
            convolutions and BatchNorm run without layout conversions. ``None`` (default): on for a CUDA
            device and a convolutional backbone (not a ViT); ``True`` forces it, ``False`` turns it off.
        collapse_warning: warn when the loss sits at the no-signal value ``ln(K + 1)`` or the
            normalised embeddings collapse onto one direction.
        device_augmentation: with a :class:`~hf_contrast.data.streaming.StreamingTwoViewDataset` or a
            :class:`~hf_contrast.TwoViewDataset`, the workers only decode and resize to ``uint8`` and draw
            each view's parameters; both views are made in the training step on the model's device
            (:class:`~hf_contrast.DeviceAugmentation`, a few batched kernels).
        save_on_sigterm: on SIGTERM (preemption), write a complete checkpoint at the end of the optimizer step
            and stop (``train`` raises :class:`~hf_contrast.trainer.preemption.TrainingPreempted`; the scripts
            exit 143). Replaces transformers' ``enable_jit_checkpoint``, whose run went on to the end.

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
    save_on_sigterm: bool = field(default=True, metadata={
        "help": "On SIGTERM (preemption) save a complete checkpoint at the end of the step and stop (exit 143)."})

    def __post_init__(self):
        cuda = torch.cuda.is_available() and not self.use_cpu
        if self.accelerator_config is None and cuda:
            self.accelerator_config = {"non_blocking": True}  # pinned batches copied without a host-device sync
        if not cuda:
            self.dataloader_pin_memory = False  # pinning without an accelerator only warns
        super().__post_init__()
