"""The batched augmentation kernels against torchvision's definitions: crop parameters and
resampling, colour jitter, blur, grayscale and flip rates, and mixed image sizes."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import ColorJitter, RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from hf_contrast import TwoViewAugmentation, augment


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    grid = np.sort(np.concatenate([a, b]))
    cdf = lambda v: np.searchsorted(np.sort(v), grid, side="right") / len(v)  # noqa: E731
    return float(np.abs(cdf(a) - cdf(b)).max())


@pytest.mark.parametrize("height,width", [(256, 256), (200, 500), (480, 210)])
def test_crop_scale_and_aspect_follow_torchvision(height, width):
    n = 3000
    ours = augment.crop_boxes(n, height, width, (0.2, 1.0), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    image = torch.zeros(1, height, width)
    ref = torch.tensor([RandomResizedCrop.get_params(image, (0.2, 1.0), (3 / 4, 4 / 3)) for _ in range(n)],
                       dtype=torch.float32)  # (n, 4) as top, left, h, w
    ref = torch.stack([ref[:, 1], ref[:, 0], ref[:, 1] + ref[:, 3], ref[:, 0] + ref[:, 2]], 1)  # x1, y1, x2, y2

    def stats(boxes):
        w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
        assert (boxes == boxes.round()).all()  # integer pixels
        centre = (boxes[:, 0] + boxes[:, 2]) / 2 / width, (boxes[:, 1] + boxes[:, 3]) / 2 / height
        return (w * h / (height * width)).numpy(), (w / h).log().numpy(), centre[0].numpy(), centre[1].numpy()

    for mine, theirs in zip(stats(ours), stats(ref), strict=True):
        assert ks_statistic(mine, theirs) < 0.05  # 5% critical value for n = 3000 each: 0.035


def test_crop_boxes_take_a_size_per_image():
    sizes = torch.tensor([[200.0, 500.0], [480.0, 210.0], [256.0, 256.0]]).repeat(100, 1)  # (300, 2) as H, W
    seed = torch.Generator().manual_seed(5)
    boxes = augment.crop_boxes(300, sizes[:, 0], sizes[:, 1], (0.2, 1.0), generator=seed)
    assert (boxes[:, 2] <= sizes[:, 1]).all() and (boxes[:, 3] <= sizes[:, 0]).all()
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / (sizes[:, 0] * sizes[:, 1])
    assert area.min() >= 0.19 and area.max() <= 1.0
    one = augment.crop_boxes(300, 256, 256, (0.2, 1.0), generator=torch.Generator().manual_seed(5))
    same = augment.crop_boxes(300, torch.full((300,), 256.0), torch.full((300,), 256.0), (0.2, 1.0),
                              generator=torch.Generator().manual_seed(5))
    assert torch.equal(one, same)


def test_resized_crops_equal_torchvision_resized_crop_on_mixed_sizes():
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in [(40, 90), (120, 60), (64, 64)]]
    boxes = torch.tensor([[3.0, 5.0, 60.0, 35.0], [0.0, 10.0, 60.0, 110.0], [10.0, 10.0, 20.0, 30.0]])
    out = augment.resized_crops(images, boxes, 32)  # (3, 3, 32, 32) on the 0-255 scale
    for image, (x1, y1, x2, y2), view in zip(images, boxes.long().tolist(), out, strict=True):
        ref = TF.resized_crop(image.float(), y1, x1, y2 - y1, x2 - x1, [32, 32], antialias=True)
        torch.testing.assert_close(view, ref)


def test_color_jitter_equals_torchvision_adjustments_with_the_drawn_factors():
    n, s, p = 12, 0.4, 0.6
    x = torch.rand(n, 3, 10, 14, generator=torch.Generator().manual_seed(2))
    out = augment.color_jitter(x, s, p, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)  # the draws, in their order: apply, brightness, contrast, saturation, hue
    apply = torch.rand(n, generator=g) < p
    b, c, sat = (torch.rand(n, generator=g) * 2 * s + 1 - s for _ in range(3))
    hue = (torch.rand(n, generator=g) * s / 2 - s / 4) * 2 * math.pi
    yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    assert 0 < apply.sum() < n
    for i in range(n):
        if not apply[i]:
            assert torch.equal(out[i], x[i])
            continue
        y = TF.adjust_saturation(TF.adjust_contrast(TF.adjust_brightness(x[i], b[i].item()), c[i].item()), sat[i].item())
        cos, sin = math.cos(hue[i]), math.sin(hue[i])
        rot = torch.tensor([[1.0, 0, 0], [0, cos, -sin], [0, sin, cos]])
        y = torch.einsum("ij,jhw->ihw", torch.linalg.inv(yiq) @ rot @ yiq, y).clamp(0, 1)
        torch.testing.assert_close(out[i], y, atol=1e-5, rtol=1e-5)


def test_jitter_factor_ranges_and_rate_are_torchvision_colorjitter():
    n, s = 20000, 0.4
    g = torch.Generator().manual_seed(0)
    x = torch.full((n, 3, 1, 1), 0.5)
    x[:, 1] = 0.25  # a coloured pixel: brightness then changes its value by the factor
    out = augment.color_jitter(x, s, 0.8, generator=g)
    changed = (out != x).flatten(1).any(1)
    assert abs(changed.float().mean().item() - 0.8) < 0.015  # RandomApply p=0.8
    jitter = ColorJitter(s, s, s, s / 4)  # the ranges the reference test above draws from are torchvision's
    for lo_hi in (jitter.brightness, jitter.contrast, jitter.saturation):
        assert tuple(lo_hi) == pytest.approx((1 - s, 1 + s))
    assert tuple(jitter.hue) == pytest.approx((-s / 4, s / 4))


def test_blur_equals_torchvision_gaussian_blur_with_the_drawn_sigma():
    n, k = 6, 7
    x = torch.rand(n, 3, 16, 20, generator=torch.Generator().manual_seed(4))
    out = augment.gaussian_blur(x, k, (0.1, 2.0), 0.5, generator=torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    apply = torch.rand(n, generator=g) < 0.5
    sigma = torch.rand(n, generator=g) * 1.9 + 0.1
    for i in range(n):
        ref = TF.gaussian_blur(x[i], [k, k], [sigma[i].item()] * 2) if apply[i] else x[i]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_flip_and_grayscale_rates():
    x = torch.rand(8000, 3, 1, 2, generator=torch.Generator().manual_seed(0))
    flipped = augment.random_flip(x, 0.5, generator=torch.Generator().manual_seed(1))
    is_flipped = (flipped == x.flip(-1)).flatten(1).all(1)
    assert abs(is_flipped.float().mean().item() - 0.5) < 0.03
    gray = augment.random_grayscale(x, 0.2, generator=torch.Generator().manual_seed(1))
    is_gray = (gray[:, 0] == gray[:, 1]).flatten(1).all(1) & (gray[:, 1] == gray[:, 2]).flatten(1).all(1)
    assert abs(is_gray.float().mean().item() - 0.2) < 0.02
    torch.testing.assert_close(gray[is_gray], TF.rgb_to_grayscale(x[is_gray], num_output_channels=3))


def test_batch_of_mixed_sizes_uses_each_images_own_crop():
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(30, 50), (44, 20), (36, 36)]]
    augmentation = TwoViewAugmentation(image_size=16, jitter_p=0, grayscale_p=0, blur_p=0, flip_p=0,
                                       mean=(0, 0, 0), std=(1, 1, 1))
    v1, v2 = augmentation.batch(images, generator=torch.Generator().manual_seed(7))
    assert v1.shape == v2.shape == (3, 3, 16, 16) and not torch.equal(v1, v2)
    g = torch.Generator().manual_seed(7)
    sizes = [im.size[::-1] for im in images]  # (H, W)
    boxes = augment.crop_boxes(3, torch.tensor([h for h, _ in sizes]), torch.tensor([w for _, w in sizes]),
                               (0.2, 1.0), generator=g)
    for image, (x1, y1, x2, y2), view in zip(images, boxes.long().tolist(), v1, strict=True):
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()
        ref = TF.resized_crop(pixels, y1, x1, y2 - y1, x2 - x1, [16, 16], antialias=True) / 255
        torch.testing.assert_close(view, ref)
