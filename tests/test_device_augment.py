"""Device augmentation: per-sample parameters, seeded, and the same views as the worker path."""

import datasets
import pytest
import torch

from hf_contrast import DeviceAugmentation, TwoViewAugmentation, write_shards
from hf_contrast.shards import read_shard_sizes, resolve_shards
from hf_contrast.streaming import StreamingTwoViewDataset


def colour_images(n: int, size: int = 16) -> torch.Tensor:
    x = torch.linspace(0, 255, size)
    image = torch.stack([x.view(1, -1).expand(size, size), x.view(-1, 1).expand(size, size),
                         255 - x.view(1, -1).expand(size, size)])  # (3, S, S): every pixel a different colour
    return image.round().to(torch.uint8).expand(n, 3, size, size).contiguous()  # (n, 3, S, S), all identical


def test_parameters_differ_per_sample_and_follow_the_seed():
    augment = DeviceAugmentation(TwoViewAugmentation(image_size=12, blur_p=0.5))
    images = colour_images(16)
    v1, v2 = augment(images, seed=7)
    assert v1.shape == v2.shape == (16, 3, 12, 12)
    distinct = {tuple(v.flatten().tolist()) for v in v1}
    assert len(distinct) == 16  # identical inputs, 16 different views: parameters are drawn per sample
    assert not torch.equal(v1, v2)  # the two views of an image differ
    again = augment(images, seed=7)
    assert torch.equal(again[0], v1) and torch.equal(again[1], v2)  # deterministic for a seed
    assert not torch.equal(augment(images, seed=8)[0], v1)
    with pytest.raises(ValueError, match="uint8"):
        augment(images.float(), seed=0)


def test_grayscale_rate_matches_the_probability():
    augmentation = TwoViewAugmentation(image_size=8, jitter_p=0.0, blur_p=0.0, grayscale_p=0.2,
                                       mean=(0, 0, 0), std=(1, 1, 1))
    v1, v2 = DeviceAugmentation(augmentation)(colour_images(2000, 8), seed=0)
    views = torch.cat([v1, v2])  # (4000, 3, 8, 8)
    gray = ((views[:, 0] - views[:, 1]).abs().amax((1, 2)) < 1e-6) & ((views[:, 1] - views[:, 2]).abs().amax((1, 2)) < 1e-6)
    assert abs(gray.float().mean().item() - 0.2) < 0.03  # binomial sd 0.006


def test_device_views_equal_the_worker_views_of_the_same_batch(digits, tmp_path):
    files = write_shards(digits["train"].select(range(16)), str(tmp_path), images_per_shard=8)
    files = resolve_shards(files)
    augmentation = TwoViewAugmentation.small_images(32, flip_p=0.5)

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
def test_same_views_on_cuda():
    augment = DeviceAugmentation(TwoViewAugmentation(image_size=24))
    images = colour_images(8, 32)
    cpu, gpu = augment(images, 3), augment(images.cuda(), 3)
    for a, b in zip(cpu, gpu, strict=True):
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-4)
