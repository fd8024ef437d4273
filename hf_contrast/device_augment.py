"""The two views made on the model's device from fixed-size ``uint8`` images.

With ``device_augmentation`` the DataLoader workers only decode and resize (see
:class:`~hf_contrast.streaming.StreamingTwoViewDataset`); the random resized crop, colour jitter,
grayscale, blur and flip of both views run here, batched, with per-sample parameters. They are the
very kernels of the worker path (:mod:`hf_contrast.augment`, through
``TwoViewAugmentation._tensor_view``) with the same draws from the same generator: the views follow
the worker pipeline's distribution, and a batch seed gives the same views on the CPU as in a worker.
Parameters are drawn on the CPU (a few numbers per image) and applied on the images' device, so
the views depend only on the seed shipped with the batch: resume stays exact.
"""

from __future__ import annotations

import torch

from .data import TwoViewAugmentation


class DeviceAugmentation:
    """Two views ``(B, 3, S, S)`` from ``images`` ``(B, 3, R, R)`` uint8 on any device.

    Args:
        augmentation: the views' augmentation (its crop scale, jitter, probabilities, mean/std).
    """

    def __init__(self, augmentation: TwoViewAugmentation):
        self.augmentation = augmentation

    def __call__(self, images: torch.Tensor, seed: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, R, R) uint8, got {tuple(images.shape)} {images.dtype}")
        generator = torch.Generator().manual_seed(int(seed))  # CPU: the same parameters on every device
        return self.augmentation._tensor_view(images, generator), self.augmentation._tensor_view(images, generator)

    def inputs(self, batch: dict) -> dict:
        """A worker batch ``{"images", "view_seed", ...}`` -> ``{"pixel_values", "pixel_values_2", ...}``."""
        batch = dict(batch)
        v1, v2 = self(batch.pop("images"), batch.pop("view_seed"))
        batch.update(pixel_values=v1, pixel_values_2=v2)
        return batch
