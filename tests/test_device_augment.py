"""Device augmentation: per-sample parameters, seeded, and the same views as the worker path."""

from collections import Counter

import datasets
import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from hf_contrast import DeviceAugmentation, TwoViewAugmentation, write_shards
from hf_contrast.data.shards import read_shard_sizes, resolve_shards
from hf_contrast.data.streaming import StreamingTwoViewDataset


def colour_images(n: int, size: int = 16) -> torch.Tensor:
    x = torch.linspace(0, 255, size)
    image = torch.stack([x.view(1, -1).expand(size, size), x.view(-1, 1).expand(size, size),
                         255 - x.view(1, -1).expand(size, size)])  # (3, S, S): every pixel a different colour
    return image.round().to(torch.uint8).expand(n, 3, size, size).contiguous()  # (n, 3, S, S), all identical


def params(augmentation, n: int, size: int, seed: int) -> torch.Tensor:
    return augmentation.view_params(n, size, size, torch.Generator().manual_seed(seed))  # (n, 2, P)


def test_parameters_differ_per_sample_and_follow_the_seed():
    augmentation = TwoViewAugmentation(image_size=12, blur_p=0.5)
    augment = DeviceAugmentation(augmentation)
    images = colour_images(16)
    v1, v2 = augment(images, params(augmentation, 16, 16, 7))
    assert v1.shape == v2.shape == (16, 3, 12, 12)
    distinct = {tuple(v.flatten().tolist()) for v in v1}
    assert len(distinct) == 16  # identical inputs, 16 different views: parameters are drawn per sample
    assert not torch.equal(v1, v2)  # the two views of an image differ
    again = augment(images, params(augmentation, 16, 16, 7))
    assert torch.equal(again[0], v1) and torch.equal(again[1], v2)  # deterministic for a seed
    assert not torch.equal(augment(images, params(augmentation, 16, 16, 8))[0], v1)
    with pytest.raises(ValueError, match="uint8"):
        augment(images.float(), params(augmentation, 16, 16, 0))


def test_grayscale_rate_matches_the_probability():
    augmentation = TwoViewAugmentation(image_size=8, jitter_p=0.0, blur_p=0.0, grayscale_p=0.2,
                                       mean=(0, 0, 0), std=(1, 1, 1))
    v1, v2 = DeviceAugmentation(augmentation)(colour_images(2000, 8), params(augmentation, 2000, 8, 0))
    views = torch.cat([v1, v2])  # (4000, 3, 8, 8)
    gray = ((views[:, 0] - views[:, 1]).abs().amax((1, 2)) < 1e-6) & ((views[:, 1] - views[:, 2]).abs().amax((1, 2)) < 1e-6)
    assert abs(gray.float().mean().item() - 0.2) < 0.03  # binomial sd 0.006


def test_rates_and_crop_scale_on_the_device_path():
    """Jitter, flip and crop area of the views DeviceAugmentation makes, measured on the views."""
    n = 3000
    augmentation = TwoViewAugmentation(image_size=14, crop_scale=(0.2, 1.0), jitter_p=0.8, grayscale_p=0.0,
                                       blur_p=0.0, flip_p=0.5, mean=(0, 0, 0), std=(1, 1, 1))
    ramp = torch.arange(16, dtype=torch.uint8).mul_(16)  # a horizontal ramp: a flip reverses its slope
    images = torch.stack([ramp.view(1, 16).expand(16, 16), torch.full((16, 16), 100, dtype=torch.uint8),
                          torch.full((16, 16), 60, dtype=torch.uint8)]).expand(n, 3, 16, 16)
    p = params(augmentation, n, 16, 1)
    plain = TwoViewAugmentation(image_size=14, crop_scale=(0.2, 1.0), jitter_p=0.0, grayscale_p=0.0, blur_p=0.0,
                                flip_p=0.5, mean=(0, 0, 0), std=(1, 1, 1))
    v1, _ = DeviceAugmentation(augmentation)(images, p)
    u1, _ = DeviceAugmentation(plain)(images, p)  # the same crops and flips, no jitter
    jittered = (v1 != u1).flatten(1).any(1)
    assert abs(jittered.float().mean().item() - 0.8) < 0.025
    slope = u1[:, 0, :, -1].mean(1) - u1[:, 0, :, 0].mean(1)  # right minus left of the red ramp
    assert abs((slope < 0).float().mean().item() - 0.5) < 0.03
    x1, box = p[:, 0, 0], p[:, 0, 2] - p[:, 0, 0]
    first = (x1 + 0.5 * box / 14 - 0.5).clamp(0, 15)  # torchvision's sample positions of the first and last
    last = (x1 + 13.5 * box / 14 - 0.5).clamp(0, 15)  # output column, at the image's border clamped
    torch.testing.assert_close(slope.abs() * 255, 16 * (last - first), atol=0.01, rtol=0)  # the view spans the box
    torch.manual_seed(0)
    ref = torch.tensor([RandomResizedCrop.get_params(torch.zeros(1, 16, 16), (0.2, 1.0), (3 / 4, 4 / 3))[3]
                        for _ in range(n)], dtype=torch.float32)  # torchvision's box widths at 16 px
    assert abs(box.mean().item() - ref.mean().item()) < 0.15 and abs(box.std().item() - ref.std().item()) < 0.15


def profile_ops(augment, images, view_params) -> tuple[Counter, Counter]:
    """The aten ops one call dispatches (top level: what the code calls, the CPU backend's own pick of
    a convolution algorithm by size left out) and all aten events, nested ones included."""
    augment(images, view_params)  # warm-up: constants made and cached
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        augment(images, view_params)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    return Counter(e.name for e in events if e.cpu_parent is None), Counter(e.name for e in events)


@pytest.mark.parametrize("recipe", ["mocov2", "mocov3"])
def test_op_count_is_flat_in_the_batch_size_and_nothing_is_read_back(recipe):
    # every op on: crop, flip, jitter, gray, blur (and mocov3's solarize on view 2)
    augmentation = TwoViewAugmentation(image_size=28) if recipe == "mocov2" else TwoViewAugmentation.mocov3(28)
    augment = DeviceAugmentation(augmentation)
    ops, every = {}, {}
    for n in (8, 64):
        ops[n], every[n] = profile_ops(augment, colour_images(n, 32), params(augmentation, n, 32, n))
    assert ops[8] == ops[64] and sum(ops[64].values()) < 250  # the same ops, whatever the batch
    for name in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::index_select", "aten::index_copy"):
        assert every[64][name] == 0, name  # no value read back to the host, no data-dependent subset


@pytest.mark.parametrize("recipe", ["small_images", "mocov3"])
def test_device_views_equal_the_worker_views_of_the_same_batch(digits, tmp_path, recipe):
    files = write_shards(digits["train"].select(range(16)), str(tmp_path), images_per_shard=8)
    files = resolve_shards(files)
    augmentation = getattr(TwoViewAugmentation, recipe)(32, flip_p=0.5)  # mocov3: blur and solarize per view

    def batches(device_augmentation):
        stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
        ds = StreamingTwoViewDataset(stream, augmentation, shard_sizes=read_shard_sizes(files))
        return list(ds.configure(batch_size=4, device_augmentation=device_augmentation).loader())

    worker, device = batches(False), batches(True)
    assert len(worker) == len(device) == 4
    for w, d in zip(worker, device, strict=True):
        assert d["images"].dtype == torch.uint8 and "pixel_values" not in d  # workers only decode and resize
        made = DeviceAugmentation(augmentation).inputs(d)  # what the trainer does in its step
        assert torch.equal(made["pixel_values"], w["pixel_values"])
        assert torch.equal(made["pixel_values_2"], w["pixel_values_2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("recipe", ["mocov2", "mocov3"])
def test_same_views_on_cuda(recipe):
    augmentation = TwoViewAugmentation(image_size=24) if recipe == "mocov2" else TwoViewAugmentation.mocov3(24)
    augment = DeviceAugmentation(augmentation)
    images, p = colour_images(8, 32), params(augmentation, 8, 32, 3)
    cpu, gpu = augment(images, p), augment(images.cuda(), p.pin_memory())
    for a, b in zip(cpu, gpu, strict=True):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)
