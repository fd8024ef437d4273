"""The trainer's data hooks: a stream owns its split, position and loader (never Accelerate's), and a
device-augmentation batch (uint8 images + view parameters) becomes two views on the model's device."""

from __future__ import annotations

import torch

from ..data.device_augment import DeviceAugmentation
from ..data.streaming import StreamingTwoViewDataset


class DataHooks:
    """Mixed into :class:`~hf_contrast.ContrastiveTrainer` (before ``transformers.Trainer``)."""

    def configure_stream(self) -> StreamingTwoViewDataset:
        a = self.args
        return self.train_dataset.configure(a.per_device_train_batch_size, a.process_index, a.world_size,
                                            a.dataloader_num_workers, getattr(a, "device_augmentation", False))

    def get_train_dataloader(self):
        """Trainer's dataloader; for a :class:`StreamingTwoViewDataset` its own
        :class:`~hf_contrast.data.streaming.StreamLoader`, never passed to ``accelerator.prepare``: Accelerate
        would dispatch every batch from rank 0 or shard the stream a second time."""
        if not isinstance(self.train_dataset, StreamingTwoViewDataset):
            return super().get_train_dataloader()
        a = self.args
        return self.configure_stream().loader(
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
