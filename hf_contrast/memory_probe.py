"""Measured memory of a training step: peak allocator bytes, and a backbone's activation memory per view.

On CUDA the peak comes from ``torch.cuda.max_memory_allocated``. CPU has no peak counter, so on CPU
the peak is rebuilt from the allocator itself: with ``torch.profiler.profile(profile_memory=True)``
every allocation and free of PyTorch's CPU allocator is recorded with its size and time, and the
running sum of those events peaks where the step held the most bytes. That counts everything the
step allocates (activations saved for backward, temporaries, parameter gradients, the loss's
logits) and nothing it does not (Python objects, the allocator's own caching, oneDNN scratch
space that bypasses PyTorch's allocator), which is what ``max_memory_allocated`` reports on a GPU.
Process RSS was the alternative: glibc keeps freed pages, so RSS measures the allocator's history,
not the step.

:func:`probe_activation_memory` runs a real timm backbone (``pretrained=False``) plus a projection
head at two small batch sizes, with the parameters' gradients already allocated (as in every step
after the first), and fits ``peak(views) = fixed + per_view * views``: the slope is the activation
memory per view, which grows linearly with the batch; the intercept holds batch-independent
transients (a weight gradient computed before it is accumulated, workspace).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from .models.backbone import ProjectionHead, create_backbone

OPTIMIZER_STATE_BYTES_PER_PARAM = {"sgd": 4, "adamw": 8, "lars": 4}  # fp32 momentum; AdamW: two moments


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto prints start/stop lines from C++ for every profile)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated when it started.

    Args:
        fn: the work to measure, e.g. one forward + backward.
        device: where ``fn`` allocates. CUDA uses the allocator's peak counter; CPU replays the
            allocation and free events the profiler recorded (see the module docstring).

    Returns:
        The largest number of bytes held at once by tensors allocated during ``fn`` (including ones
        it freed before returning), minus any freed that existed before it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(
            f"device={device.type!r} is not supported: peak_memory_bytes measures 'cpu' or 'cuda'"
        )
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    events.sort(key=lambda e: e.start_ns())  # stable: ties keep the order they were recorded in
    held = peak = 0
    for e in events:
        held += e.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak


@dataclass
class ActivationProbe:
    """Activation memory of one backbone + projection head, measured and fitted linearly in the views.

    Attributes:
        backbone: timm architecture name.
        image_size: image side the estimate is for.
        probe_image_size: image side the probe ran at; per-view bytes are scaled by the pixel ratio
            ``(image_size / probe_image_size) ** 2`` when they differ.
        probe_views: the two batch sizes (views) the probe measured.
        num_params: parameters of backbone + head.
        per_view_bytes: activation bytes per view (fp32) at ``image_size``: the fitted slope.
        fixed_bytes: the fitted intercept: batch-independent transients of the step.
    """

    backbone: str
    image_size: int
    probe_image_size: int
    probe_views: tuple[int, int]
    num_params: int
    per_view_bytes: float
    fixed_bytes: float

    def activation_bytes(self, views: int) -> float:
        """Activation memory of a forward + backward over ``views`` views (excludes parameter gradients)."""
        return self.per_view_bytes * views

    def predicted_peak_bytes(self, views: int) -> float:
        """What :func:`measure_step_peak` should measure for a forward + backward of ``views`` views."""
        return self.fixed_bytes + self.per_view_bytes * views


def _backbone_with_head(backbone: str, image_size: int, hidden_dim: int, out_dim: int) -> torch.nn.Module:
    try:  # ViT-like models take their input size at construction
        encoder = create_backbone(backbone, {"img_size": image_size})
    except TypeError:
        encoder = create_backbone(backbone)
    head = ProjectionHead(encoder.num_features, hidden_dim, out_dim, num_layers=2, batch_norm=True)
    return torch.nn.Sequential(encoder, head)


def measure_step_peak(
    model: torch.nn.Module, views: int, image_size: int, device: torch.device | str = "cpu"
) -> int:
    """Peak bytes of one forward + backward of ``model`` on ``views`` random images, above the
    parameters, their (already allocated, zeroed) gradients and the input: the activation memory
    plus the step's transient buffers, as in every training step after the first."""
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(
        views, 3, image_size, image_size, device=device
    )  # (V, 3, H, W), allocated before measuring

    def step():
        model(x).float().pow(2).mean().backward()  # (V, D) -> scalar

    peak = peak_memory_bytes(step, device)
    model.zero_grad(set_to_none=True)
    return peak


def probe_activation_memory(
    backbone: str,
    image_size: int,
    *,
    views: int = 2,
    probe_image_size: int | None = None,
    projection_hidden_dim: int = 2048,
    projection_dim: int = 128,
    max_views: int = 256,
    device: torch.device | str = "cpu",
) -> ActivationProbe:
    """Measure a backbone's activation memory per view with two short forward + backward passes.

    Args:
        backbone: timm architecture name, built with ``pretrained=False``.
        image_size: image side to estimate for.
        views: the first probe batch (>= 2: BatchNorm needs two). The probe also runs ``2 * views``,
            and keeps doubling while the batch-dependent part of the peak is under a quarter of it (at
            tiny batches the parameter gradients, not the activations, set the peak).
        probe_image_size: run the probe at this side and scale per-view bytes by the pixel ratio
            (cheaper for large images; exact for convolutional nets up to rounding of the feature
            maps). Defaults to ``image_size``.
        projection_hidden_dim: hidden width of the (BatchNorm) projection head on top.
        projection_dim: output width of the head.
        max_views: stop doubling at this batch.
        device: where to run the probe.

    Returns:
        The fitted :class:`ActivationProbe` (fp32 activations).
    """
    if views < 2:
        raise ValueError(f"views={views!r} is invalid: views must be an integer >= 2 (BatchNorm needs two)")
    size = probe_image_size or image_size
    model = _backbone_with_head(backbone, size, projection_hidden_dim, projection_dim).to(device)
    measure_step_peak(model, views, size, device)  # warm-up: lazy inits and allocator caches
    small = measure_step_peak(model, views, size, device)
    while True:
        large = measure_step_peak(model, 2 * views, size, device)
        # At tiny batches the peak is set by the gradients, not the activations: double the batch
        # until the batch-dependent part dominates (or the probe would get expensive).
        if large - small >= 0.25 * small or 2 * views >= max_views:
            break
        views, small = 2 * views, large
    slope = max(large - small, 0) / views  # bytes per view at the probe size
    fixed = small - slope * views
    scale = (image_size / size) ** 2
    return ActivationProbe(
        backbone=backbone,
        image_size=image_size,
        probe_image_size=size,
        probe_views=(views, 2 * views),
        num_params=sum(p.numel() for p in model.parameters()),
        per_view_bytes=slope * scale,
        fixed_bytes=fixed,
    )


def training_state_bytes(num_params: int, optimizer: str = "sgd") -> int:
    """Parameters, their gradients and the optimizer state, all fp32.

    Args:
        num_params: trainable parameters.
        optimizer: ``"sgd"`` (momentum, 4 bytes/param), ``"lars"`` (same) or ``"adamw"`` (two moments, 8).
    """
    if optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAM:
        allowed = tuple(OPTIMIZER_STATE_BYTES_PER_PARAM)
        raise ValueError(f"optimizer={optimizer!r} is invalid: optimizer must be one of {allowed}")
    return num_params * (4 + 4 + OPTIMIZER_STATE_BYTES_PER_PARAM[optimizer])
