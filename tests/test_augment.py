"""The batched augmentation kernels against torchvision's definitions: crop parameters and
resampling, colour jitter, blur, grayscale and flip rates, and mixed image sizes."""


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


def draw(n, generator, height=8, width=8, **overrides):
    """One view's parameters (n, P) with MoCo v2's settings unless overridden."""
    settings = dict(crop_scale=(0.2, 1.0), jitter_strength=0.4, jitter_p=0.8, grayscale_p=0.2, blur_p=0.5, flip_p=0.5)
    return augment.draw_params(n, height, width, generator, **{**settings, **overrides})


def test_color_jitter_equals_torchvision_adjustments_with_the_drawn_factors():
    n, s, p = 12, 0.4, 0.6
    x = torch.rand(n, 3, 10, 14, generator=torch.Generator().manual_seed(2))
    params = draw(n, torch.Generator().manual_seed(3), jitter_strength=s, jitter_p=p)
    out = augment.color_jitter(x, params)
    apply = params[:, augment.JITTER] > 0
    b, c, sat, hue = (params[:, i] for i in (augment.BRIGHTNESS, augment.CONTRAST, augment.SATURATION, augment.HUE))
    assert 0 < apply.sum() < n
    for i in range(n):
        if not apply[i]:
            assert torch.equal(out[i], x[i])
            assert (b[i], c[i], sat[i], hue[i]) == (1, 1, 1, 0)  # identity parameters where jitter does not apply
            continue
        y = TF.adjust_saturation(TF.adjust_contrast(TF.adjust_brightness(x[i], b[i].item()), c[i].item()), sat[i].item())
        y = TF.adjust_hue(y, hue[i].item())  # torchvision's HSV shift itself, not a copy of ours
        torch.testing.assert_close(out[i], y, atol=1e-5, rtol=1e-5)


def hue_test_images(n, generator):
    """Random images with gray pixels (r = g = b, including black and white) and the six pure colours."""
    x = torch.rand(n, 3, 12, 13, generator=generator)  # (n, 3, H, W)
    x[:, :, :3] = x[:, :1, :3]  # gray rows
    x[:, :, 3, :2] = torch.tensor([0.0, 1.0])  # black, white
    pure = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 1]]).T  # (3, 6)
    x[:, :, 4, :6] = pure
    x[:, :, 5, :6] = pure * 0.5
    return x


def test_adjust_hue_equals_torchvision_per_image():
    n = 16
    g = torch.Generator().manual_seed(11)
    x = hue_test_images(n, g)
    factors = torch.cat([torch.tensor([-0.5, 0.5, 0.0, 0.1, -0.1, 0.25]), torch.rand(n - 6, generator=g) - 0.5])
    out = augment.adjust_hue(x, factors)
    assert out.shape == x.shape and out.dtype == x.dtype
    for i in range(n):
        torch.testing.assert_close(out[i], TF.adjust_hue(x[i], factors[i].item()), atol=1e-5, rtol=0)
    gray = (x[:, 0] == x[:, 1]) & (x[:, 1] == x[:, 2])  # (n, H, W): gray pixels stay gray and unchanged
    torch.testing.assert_close(out.permute(0, 2, 3, 1)[gray], x.permute(0, 2, 3, 1)[gray], atol=1e-6, rtol=0)


def test_adjust_hue_of_pure_red_and_the_identity():
    red = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    shifted = augment.adjust_hue(red, torch.tensor([0.1])).flatten()
    torch.testing.assert_close(shifted, TF.adjust_hue(red[0], 0.1).flatten(), atol=1e-6, rtol=0)
    torch.testing.assert_close(shifted, torch.tensor([1.0, 0.6, 0.0]), atol=1e-6, rtol=0)  # torchvision's value
    x = hue_test_images(4, torch.Generator().manual_seed(5))
    torch.testing.assert_close(augment.adjust_hue(x, torch.zeros(4)), x, atol=1e-6, rtol=0)


def test_adjust_hue_is_channels_last_safe_and_sync_free():
    x = hue_test_images(3, torch.Generator().manual_seed(6))
    factors = torch.tensor([0.3, -0.2, 0.0])
    ref = augment.adjust_hue(x, factors)
    torch.testing.assert_close(augment.adjust_hue(x.to(memory_format=torch.channels_last), factors), ref)
    with torch.profiler.profile() as prof:
        augment.adjust_hue(x, factors)
    names = {e.name for e in prof.events()}
    assert "aten::_local_scalar_dense" not in names and "aten::nonzero" not in names


def test_color_jitter_with_only_hue_is_torchvision_adjust_hue_of_the_drawn_factor():
    n = 10
    x = hue_test_images(n, torch.Generator().manual_seed(8))
    params = draw(n, torch.Generator().manual_seed(9), jitter_strength=2.0, jitter_p=0.7)  # hue in [-0.5, 0.5]
    params[:, [augment.BRIGHTNESS, augment.CONTRAST, augment.SATURATION]] = 1.0  # only hue acts
    apply = params[:, augment.JITTER] > 0
    hue = params[:, augment.HUE]
    assert 0 < apply.sum() < n and hue.abs().max() > 0.3
    out = augment.color_jitter(x, params)
    for i in range(n):
        ref = TF.adjust_hue(x[i], hue[i].item()) if apply[i] else x[i]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=0)


def test_jitter_factor_ranges_and_rate_are_torchvision_colorjitter():
    n, s = 20000, 0.4
    params = draw(n, torch.Generator().manual_seed(0), jitter_strength=s, jitter_p=0.8)
    x = torch.full((n, 3, 1, 1), 0.5)
    x[:, 1] = 0.25  # a coloured pixel: brightness then changes its value by the factor
    out = augment.color_jitter(x, params)
    changed = (out != x).flatten(1).any(1)
    assert abs(changed.float().mean().item() - 0.8) < 0.015  # RandomApply p=0.8
    applied = params[:, augment.JITTER] > 0
    assert torch.equal(changed, applied)
    jitter = ColorJitter(s, s, s, s / 4)  # the factors are uniform over torchvision's ranges
    ranges = (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)
    for column, (lo, hi) in zip((augment.BRIGHTNESS, augment.CONTRAST, augment.SATURATION, augment.HUE), ranges,
                                strict=True):
        drawn = params[applied, column].numpy()
        uniform = np.random.default_rng(column).uniform(lo, hi, 5000)
        assert lo <= drawn.min() and drawn.max() <= hi and ks_statistic(drawn, uniform) < 0.03


def test_blur_equals_torchvision_gaussian_blur_with_the_drawn_sigma():
    n, k = 6, 7
    x = torch.rand(n, 3, 16, 20, generator=torch.Generator().manual_seed(4))
    params = draw(n, torch.Generator().manual_seed(9), blur_p=0.5)
    out = augment.gaussian_blur(x, params, k)
    sigma = params[:, augment.SIGMA]
    assert 0 < (sigma > 0).sum() < n
    for i in range(n):
        if sigma[i] == 0:  # not blurred: the delta kernel returns the image bit for bit
            assert torch.equal(out[i], x[i])
            continue
        torch.testing.assert_close(out[i], TF.gaussian_blur(x[i], [k, k], [sigma[i].item()] * 2), atol=1e-5, rtol=1e-5)


def test_blur_rate_and_sigma_range():
    sigma = draw(20000, torch.Generator().manual_seed(1), blur_p=0.5)[:, augment.SIGMA].numpy()
    assert abs((sigma > 0).mean() - 0.5) < 0.015
    blurred = sigma[sigma > 0]
    assert ks_statistic(blurred, np.random.default_rng(0).uniform(0.1, 2.0, 5000)) < 0.03  # GaussianBlur's sigma


def test_flip_and_grayscale_rates():
    """On the fixed-size path (flip in the sampling grid, grayscale by torch.where), whole-image crops."""
    n = 8000
    x = torch.randint(0, 256, (n, 3, 3, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    augmentation = TwoViewAugmentation(image_size=4, crop_scale=(1.0, 1.0), jitter_p=0, blur_p=0, grayscale_p=0.2,
                                       flip_p=0.5, mean=(0, 0, 0), std=(1, 1, 1))
    params = augmentation.view_params(n, 4, 4, torch.Generator().manual_seed(1))  # (n, 2, P)
    square = torch.cat([x, x[:, :, :1]], 2)  # (n, 3, 4, 4)
    view, _ = augmentation.views(square, params)
    pixels = square.float() / 255
    is_gray = (view[:, 0] == view[:, 1]).flatten(1).all(1) & (view[:, 1] == view[:, 2]).flatten(1).all(1)
    target = torch.where(is_gray.view(-1, 1, 1, 1), TF.rgb_to_grayscale(pixels, num_output_channels=3), pixels)
    is_flipped = ((view - target.flip(-1)).abs() < 1e-4).flatten(1).all(1)
    assert abs(is_flipped.float().mean().item() - 0.5) < 0.03
    assert abs(is_gray.float().mean().item() - 0.2) < 0.02
    as_drawn = torch.where(is_flipped.view(-1, 1, 1, 1), target.flip(-1), target)
    torch.testing.assert_close(view, as_drawn, atol=1e-4, rtol=0)  # every view: its image, flipped or not, gray or not
    assert (is_gray & is_flipped).any() and (is_gray & ~is_flipped).any()


def test_crop_scale_of_the_drawn_parameters_follows_torchvision():
    ours = draw(3000, torch.Generator().manual_seed(0), 256, 256)[:, :4]
    torch.manual_seed(0)
    ref = torch.tensor([RandomResizedCrop.get_params(torch.zeros(1, 256, 256), (0.2, 1.0), (3 / 4, 4 / 3))
                        for _ in range(3000)], dtype=torch.float32)  # (n, 4) as top, left, h, w
    area = lambda w, h: (w * h / 256**2).numpy()  # noqa: E731
    assert ks_statistic(area(ours[:, 2] - ours[:, 0], ours[:, 3] - ours[:, 1]), area(ref[:, 3], ref[:, 2])) < 0.05


@pytest.mark.parametrize("flip", [False, True])
def test_batched_crop_equals_torchvision_resized_crop_inside_the_box(flip):
    """One grid_sample for the batch against torchvision's per-image crop + bilinear resize
    (antialias off): equal at every output pixel whose sample lies inside the box (torchvision
    clamps at the box's edge, the batched crop reads the image's pixels beyond it)."""
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (5, 3, 36, 36), dtype=torch.uint8, generator=g)
    params = draw(5, g, 36, 36, flip_p=1.0 if flip else 0.0)
    out = augment.resized_crop(images, params, 32) * 255  # (5, 3, 32, 32)
    for image, p, view in zip(images, params, out, strict=True):
        x1, y1, x2, y2 = (int(v) for v in p[:4])
        ref = TF.resized_crop(image.float(), y1, x1, y2 - y1, x2 - x1, [32, 32], antialias=False)
        ref = ref.flip(-1) if flip else ref
        sx = (torch.arange(32) + 0.5) * (x2 - x1) / 32 - 0.5  # source coordinates inside the box
        sy = (torch.arange(32) + 0.5) * (y2 - y1) / 32 - 0.5
        inside_x = (sx >= 0) & (sx <= x2 - x1 - 1)
        inside_x = inside_x.flip(0) if flip else inside_x
        inside = ((sy >= 0) & (sy <= y2 - y1 - 1)).view(-1, 1) & inside_x.view(1, -1)  # (32, 32)
        assert inside.float().mean() > 0.8
        torch.testing.assert_close(view[:, inside], ref[:, inside], atol=2e-3, rtol=0)


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
