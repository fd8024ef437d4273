#!/usr/bin/env python
"""Device augmentation, old against new, side by side in one run: images/s and op count of one call.

Two views at ``--image_size`` (224) from ``(B, 3, R, R)`` uint8 with ``R = 8/7 x image_size`` (256),
MoCo v2's augmentations (crop 0.2-1, jitter 0.8, grayscale 0.2, blur 0.5, flip 0.5), at each batch
of ``--batches``:

  old   the previous DeviceAugmentation (kept below, verbatim in substance): parameters drawn on the
        CPU inside the call and moved with ``.to(device)``, one antialiased ``interpolate`` per
        image, each op on the subset it applies to (``nonzero`` + ``index_select``/``index_copy``)
  new   :class:`hf_contrast.DeviceAugmentation`: parameters ``(B, 2, P)`` drawn where the batch is
        made (outside the call), one ``grid_sample`` per view, branch-free ops

Op count: top-level aten ops of one call (torch.profiler); on CUDA each is about one kernel launch,
so this is the number that must not grow with the batch. Images/s: median of ``--repeats`` calls
after a warm-up, on this machine's device (``--device cuda`` on a GPU).

    python benchmarks/device_augment.py                       # CPU, batches 64 and 256
    python benchmarks/device_augment.py --device cuda --batches 256,1024
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from hf_contrast import DeviceAugmentation, TwoViewAugmentation, augment

# --- the previous implementation (hf_contrast 4112c4c: augment.py + TwoViewAugmentation._tensor_view) ---
_YIQ = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])


def _old_apply(x, apply, fn):
    idx = apply.nonzero().squeeze(1).to(x.device)  # (m,)
    if len(idx) == 0:
        return x
    return x.index_copy_(0, idx, fn(x.index_select(0, idx), idx))


def _old_gray(x):
    return F.conv2d(x, torch.tensor((0.2989, 0.587, 0.114), dtype=x.dtype, device=x.device).view(1, 3, 1, 1))


def _old_view(aug: TwoViewAugmentation, images: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    n, s, dev = len(images), aug.jitter_strength, images.device
    uni = lambda lo, hi: torch.rand(n, generator=g) * (hi - lo) + lo  # noqa: E731
    sizes = torch.tensor([im.shape[-2:] for im in images], dtype=torch.float32)
    boxes = augment.crop_boxes(n, sizes[:, 0], sizes[:, 1], tuple(aug.crop_scale), generator=g)
    y = augment.resized_crops(images, boxes, aug.image_size).div_(255)  # the per-image loop
    apply = torch.rand(n, generator=g) < aug.jitter_p
    b, c, sat = (uni(max(0.0, 1 - s), 1 + s).to(dev) for _ in range(3))
    hue = uni(-s / 4, s / 4) * 2 * math.pi
    rot = torch.zeros(n, 3, 3)
    rot[:, 0, 0] = 1
    rot[:, 1, 1], rot[:, 1, 2], rot[:, 2, 1], rot[:, 2, 2] = hue.cos(), -hue.sin(), hue.sin(), hue.cos()
    hue_m = (torch.linalg.inv(_YIQ) @ rot @ _YIQ).to(dev)

    def jitter(z, idx):
        m, _, h, w = z.shape
        v = (m, 1, 1, 1)
        z.mul_(b[idx].view(v)).clamp_(0, 1)
        mean = _old_gray(z).mean(dim=(1, 2, 3), keepdim=True)
        z.mul_(c[idx].view(v)).add_(mean * (1 - c[idx].view(v))).clamp_(0, 1)
        gray = _old_gray(z).mul_(1 - sat[idx].view(v))
        z.mul_(sat[idx].view(v)).add_(gray).clamp_(0, 1)
        return F.conv2d(z.view(1, m * 3, h, w), hue_m[idx].view(m * 3, 3, 1, 1), groups=m).view(m, 3, h, w).clamp_(0, 1)

    y = _old_apply(y, apply, jitter)
    y = _old_apply(y, torch.rand(n, generator=g) < aug.grayscale_p, lambda z, _: _old_gray(z).expand_as(z))
    k = aug._blur_kernel()
    apply = torch.rand(n, generator=g) < aug.blur_p
    sig = uni(0.1, 2.0).view(n, 1).to(dev)
    r = torch.arange(k, dtype=y.dtype, device=dev) - (k - 1) / 2

    def blur(z, idx):
        m, ch, h, w = z.shape
        kern = torch.exp(-(r**2) / (2 * sig[idx] ** 2))
        kern = (kern / kern.sum(1, keepdim=True)).repeat_interleave(ch, 0)
        z = z.reshape(1, m * ch, h, w)
        z = F.conv2d(F.pad(z, (k // 2, k // 2, 0, 0), mode="reflect"), kern.view(m * ch, 1, 1, k), groups=m * ch)
        z = F.conv2d(F.pad(z, (0, 0, k // 2, k // 2), mode="reflect"), kern.view(m * ch, 1, k, 1), groups=m * ch)
        return z.view(m, ch, h, w)

    y = _old_apply(y, apply, blur)
    y = _old_apply(y, torch.rand(n, generator=g) < aug.flip_p, lambda z, _: z.flip(-1))
    mean = torch.tensor(aug.mean, device=dev).view(1, -1, 1, 1)
    return y.sub_(mean).div_(torch.tensor(aug.std, device=dev).view(1, -1, 1, 1))


def old_call(aug, images, seed):
    g = torch.Generator().manual_seed(seed)
    return _old_view(aug, images, g), _old_view(aug, images, g)
# --- end of the previous implementation ---


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, n: int, repeats: int, device) -> tuple[float, int]:
    """Images/s (median of ``repeats`` timed calls) and the op count of one more, profiled, call."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        sync(device)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return n / statistics.median(times), ops


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=1, help="timed calls per path (the median is printed)")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    aug = TwoViewAugmentation(image_size=a.image_size)
    source = round(a.image_size * 8 / 7)
    new = DeviceAugmentation(aug)
    print(f"two views at {a.image_size} px from {source} px uint8, {device} ({torch.get_num_threads()} threads), "
          f"median of {a.repeats}; ops: top-level aten ops of one call")
    print(f"{'batch':>6} {'old img/s':>10} {'new img/s':>10} {'speed-up':>9} {'old ops':>8} {'new ops':>8} {'ops ratio':>9}")
    batches = [int(b) for b in a.batches.split(",")]
    for n in batches:
        images = torch.randint(0, 256, (n, 3, source, source), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0)).to(device)
        params = aug.view_params(n, source, source, torch.Generator().manual_seed(0))  # drawn in the worker
        params = params.pin_memory() if device.type == "cuda" else params
        run_old = lambda x=images: old_call(aug, x, 0)  # noqa: E731
        run_new = lambda x=images, q=params: new(x, q)  # noqa: E731
        if n == batches[0]:  # warm-up: constants cached, allocator and kernels warm
            old_call(aug, images[:8], 0), new(images[:8], params[:8])
            sync(device)
        r_old, o_old = measure(run_old, n, a.repeats, device)
        r_new, o_new = measure(run_new, n, a.repeats, device)
        print(f"{n:>6} {r_old:>10.1f} {r_new:>10.1f} {r_new / r_old:>8.2f}x {o_old:>8} {o_new:>8} {o_old / o_new:>8.1f}x")


if __name__ == "__main__":
    main()
