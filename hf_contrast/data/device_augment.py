"""The two views made on the model's device from fixed-size ``uint8`` images and their parameters.

With ``device_augmentation`` the DataLoader workers only decode, resize to a fixed ``R`` x ``R``
(``source_size``, 8/7 of the crop size by default) and draw each view's per-sample parameters from
the batch's seed (:meth:`~hf_contrast.TwoViewAugmentation.view_params`); the batch carries
``images`` ``(B, 3, R, R)`` uint8 and ``view_params`` ``(B, 2, P)`` float32. Here the random
resized crop and flip (one ``grid_sample`` per view), colour jitter, grayscale, blur, solarize
and normalisation run batched and branch-free on the images' device: the number of kernel launches
does not depend on the batch size, and no value is read back to the host. They are the very
kernels of the worker path for fixed-size images (:meth:`~hf_contrast.TwoViewAugmentation.views`),
so a batch gives the same views in a worker as here, and the views depend only on
``(seed, epoch, batch)``: resume stays exact.

Antialiasing: none on this path. The crop samples an ``R = 8/7 S`` image, so a view is at most a
1.14x downscale (the whole image), and crops under ``S`` pixels a side are upscales, which need
none. Measured against torchvision's antialiased ``resized_crop`` on noisy synthetic photos
(``benchmarks/data_throughput.py``'s corpus) at 256 -> 224: the whole image differs by 0.49 grey
levels on average (99th percentile 2.3, max 7.8), a 256 x 192 box by 0.30, a 170 px box by 0.
Sources above 1.5x the crop size fall back to per-image antialiased crops (see
``TwoViewAugmentation.views``): a Python loop with a host read of the boxes, so keep
``source_size`` at most 1.5x ``image_size`` on this path.
"""

from __future__ import annotations

import torch

from .views import TwoViewAugmentation


class DeviceAugmentation:
    """Two views ``(B, 3, S, S)`` from ``images`` ``(B, 3, R, R)`` uint8 and ``view_params`` ``(B, 2, P)``.

    Make it once (the trainer keeps one); constants are cached per device on first use.

    Args:
        augmentation: the views' augmentation (its crop size, enabled ops, mean/std).
        memory_format: layout of the returned views (``torch.channels_last`` for a channels-last model).
    """

    def __init__(self, augmentation: TwoViewAugmentation, memory_format: torch.memory_format = torch.contiguous_format):
        self.augmentation = augmentation
        self.memory_format = memory_format

    def __call__(self, images: torch.Tensor, view_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both views of ``images``; ``view_params`` is moved to the images' device without blocking."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, R, R) uint8, got {tuple(images.shape)} {images.dtype}")
        if tuple(view_params.shape[:2]) != (images.shape[0], 2):
            raise ValueError(f"view_params must be (B, 2, P) for B={images.shape[0]}, got {tuple(view_params.shape)}")
        params = view_params.to(images.device, torch.float32, non_blocking=True)  # pinned by the DataLoader
        v1, v2 = self.augmentation.views(images, params)
        return v1.contiguous(memory_format=self.memory_format), v2.contiguous(memory_format=self.memory_format)

    def inputs(self, batch: dict) -> dict:
        """A batch ``{"images", "view_params", ...}`` -> ``{"pixel_values", "pixel_values_2", ...}``
        (the other keys pass through)."""
        batch = dict(batch)
        v1, v2 = self(batch.pop("images"), batch.pop("view_params"))
        batch.update(pixel_values=v1, pixel_values_2=v2)
        return batch
