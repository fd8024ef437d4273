"""The named augmentation recipes: MoCo v3 / BYOL's asymmetric views (per-view blur, solarize on
view 2, jitter (0.4, 0.4, 0.2, 0.1)) on the PIL path and the batched path, against torchvision and
PIL themselves; MoCo v2's defaults unchanged."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from test_augment import ks_statistic
from torchvision import transforms as T
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from hf_contrast import TwoViewAugmentation, augment
from hf_contrast.hub.model_card import describe_augmentation

IDENTITY = dict(mean=(0, 0, 0), std=(1, 1, 1))


def test_batched_solarize_equals_torchvision_solarize_per_image():
    n = 12
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 9, 11, generator=g)  # (n, 3, H, W) in [0, 1]
    x[:, 0, 0, :3] = torch.tensor([0.5, 0.5 - 1e-6, 1.0])  # the threshold is inclusive, as torchvision's
    params = augment.draw_params(n, 9, 11, g, solarize_p=0.5)
    flag = params[:, augment.SOLARIZE] > 0
    assert 0 < flag.sum() < n
    out = augment.random_solarize(x, params)
    for i in range(n):
        ref = TF.solarize(x[i], 0.5) if flag[i] else x[i]
        assert torch.equal(out[i], ref)
    assert torch.equal(out[flag][:, 0, 0, :3], torch.tensor([0.5, 0.5 - 1e-6, 0.0]).expand(int(flag.sum()), 3))


def test_batched_solarize_is_pil_solarize_at_128_on_uint8_images():
    """The official MoCo v3 Solarize is PIL's ``ImageOps.solarize`` (threshold 128 of 255)."""
    pixels = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).contiguous()  # every value
    pil = Image.fromarray(pixels.permute(1, 2, 0).numpy())
    official = torch.from_numpy(np.array(ImageOps.solarize(pil))).permute(2, 0, 1).float()  # (3, 16, 16)
    params = torch.zeros(1, augment.NUM_PARAMS)
    params[:, augment.SOLARIZE] = 1
    ours = augment.random_solarize(pixels.float().unsqueeze(0) / 255, params)[0] * 255
    torch.testing.assert_close(ours, official, atol=1e-4, rtol=0)
    assert torch.equal(TF.solarize(pixels, 128).float(), official)


def test_mocov3_draws_respect_the_per_view_probabilities():
    n = 20000
    aug = TwoViewAugmentation.mocov3(64)
    params = aug.view_params(n, 80, 80, torch.Generator().manual_seed(0))  # (n, 2, P)
    assert params.shape == (n, 2, augment.NUM_PARAMS)
    blurred = params[..., augment.SIGMA] > 0  # (n, 2)
    solarized = params[..., augment.SOLARIZE] > 0
    assert blurred[:, 0].all() and not solarized[:, 0].any()  # view 1: always blurred, never solarized
    assert abs(blurred[:, 1].float().mean().item() - 0.1) < 0.01  # binomial sd 0.002
    assert abs(solarized[:, 1].float().mean().item() - 0.2) < 0.012  # sd 0.003
    assert not torch.equal(params[:, 0], params[:, 1])  # each view draws its own
    for view in (0, 1):  # both views: MoCo v3's jitter, grayscale and crop scale
        p = params[:, view]
        applied = p[:, augment.JITTER] > 0
        assert abs(applied.float().mean().item() - 0.8) < 0.015
        jitter = T.ColorJitter(0.4, 0.4, 0.2, 0.1)
        ranges = (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue)
        columns = (augment.BRIGHTNESS, augment.CONTRAST, augment.SATURATION, augment.HUE)
        for column, (lo, hi) in zip(columns, ranges, strict=True):
            drawn = p[applied, column].numpy()
            uniform = np.random.default_rng(column).uniform(lo, hi, 5000)
            assert lo <= drawn.min() and drawn.max() <= hi and ks_statistic(drawn, uniform) < 0.03
        assert abs((p[:, augment.GRAY] > 0).float().mean().item() - 0.2) < 0.015
    torch.manual_seed(0)
    ref = torch.tensor([RandomResizedCrop.get_params(torch.zeros(1, 80, 80), (0.08, 1.0), (3 / 4, 4 / 3))
                        for _ in range(3000)], dtype=torch.float32)  # (n, 4) as top, left, h, w
    box = params[:3000, 0, :4]
    area = ((box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1]) / 80**2).numpy()
    assert ks_statistic(area, (ref[:, 2] * ref[:, 3] / 80**2).numpy()) < 0.05


def test_mocov2_draws_are_two_plain_draws_and_jitter_strength_is_jitter():
    """The defaults draw exactly what two ``draw_params`` calls with ``jitter_strength`` draw (the
    solarize draw is skipped where its probability is 0, so the stream of the columns before it stays)."""
    aug = TwoViewAugmentation()
    params = aug.view_params(50, 40, 40, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    plain = [augment.draw_params(50, 40, 40, g, jitter_strength=0.4) for _ in range(2)]
    assert torch.equal(params, torch.stack(plain, 1)) and not params[..., augment.SOLARIZE].any()
    as_tuple = augment.draw_params(50, 40, 40, torch.Generator().manual_seed(3), jitter=(0.4, 0.4, 0.4, 0.1))
    assert torch.equal(as_tuple, plain[0])
    drawn, by_hand = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    augment.draw_params(50, 40, 40, drawn)  # uses exactly the draws of before the solarize column: boxes, (n, 9)
    augment.crop_boxes(50, 40, 40, (0.2, 1.0), by_hand)
    torch.rand(50, 9, generator=by_hand)
    assert torch.equal(drawn.get_state(), by_hand.get_state())
    augment.draw_params(50, 40, 40, drawn, solarize_p=0.2)  # and with solarize one (n,) draw more
    augment.crop_boxes(50, 40, 40, (0.2, 1.0), by_hand)
    torch.rand(50, 10, generator=by_hand)
    assert torch.equal(drawn.get_state(), by_hand.get_state())


def op_names(pipeline) -> list[str]:
    """The ops of a torchvision Compose, ``RandomApply`` shown as ``RandomApply(Inner)``."""
    return [f"RandomApply({t.transforms[0].__class__.__name__})" if isinstance(t, T.RandomApply)
            else t.__class__.__name__ for t in pipeline.transforms]


def test_worker_pipelines_per_view_follow_the_official_code():
    aug = TwoViewAugmentation.mocov3(224)
    one, two = aug.pipelines
    common = ["RandomResizedCrop", "RandomApply(ColorJitter)", "RandomGrayscale"]
    tail = ["RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert op_names(one) == common + ["RandomApply(GaussianBlur)"] + tail
    assert op_names(two) == common + ["RandomApply(GaussianBlur)", "RandomSolarize"] + tail  # after blur, before flip
    assert one.transforms[0].scale == (0.08, 1.0) and one.transforms[2].p == 0.2 and one.transforms[4].p == 0.5
    jitter = one.transforms[1]
    cj = jitter.transforms[0]
    assert jitter.p == 0.8 and tuple(cj.saturation) == pytest.approx((0.8, 1.2)) and tuple(cj.hue) == (-0.1, 0.1)
    assert tuple(cj.brightness) == tuple(cj.contrast) == pytest.approx((0.6, 1.4))
    assert one.transforms[3].p == 1.0 and two.transforms[3].p == 0.1
    assert two.transforms[3].transforms[0].sigma == (0.1, 2.0)
    assert two.transforms[4].p == 0.2 and two.transforms[4].threshold == 128  # on PIL images: 128 of 255
    sure = copy.deepcopy(two.transforms[4])
    sure.p = 1.0
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8))
    assert np.array_equal(np.array(sure(image)), np.array(ImageOps.solarize(image)))  # the official Solarize
    v2 = [op_names(p) for p in TwoViewAugmentation().pipelines]
    assert v2[0] == v2[1] == common + ["RandomApply(GaussianBlur)"] + tail  # MoCo v2: symmetric, no solarize
    assert [op_names(p) for p in TwoViewAugmentation.small_images(32).pipelines] == [common + tail] * 2
    a, b = aug(image)
    assert a.shape == b.shape == (3, 224, 224)


def test_batched_views_solarize_only_view_2_where_drawn():
    """Only solarize on (whole-image crops, no jitter, grayscale, blur, flip): view 1 is the image,
    view 2 torchvision's solarize of it exactly where its flag is set."""
    n = 64
    aug = TwoViewAugmentation.mocov3(12, crop_scale=(1.0, 1.0), jitter_p=0.0, grayscale_p=0.0, blur_p=0.0,
                                     flip_p=0.0, **IDENTITY)
    images = torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    params = aug.view_params(n, 12, 12, torch.Generator().manual_seed(2))
    v1, v2 = aug.views(images, params)
    pixels = images.float() / 255
    flag = params[:, 1, augment.SOLARIZE] > 0
    assert 0 < flag.sum() < n
    torch.testing.assert_close(v1, pixels, atol=1e-5, rtol=0)
    expected = torch.stack([TF.solarize(p, 0.5) if f else p for p, f in zip(pixels, flag, strict=True)])
    torch.testing.assert_close(v2, expected, atol=1e-5, rtol=0)


def test_recipe_names_overrides_and_description():
    assert TwoViewAugmentation().recipe == "mocov2" and TwoViewAugmentation().overrides == {}
    assert TwoViewAugmentation(image_size=32, blur_p=0.0).recipe == "small_images"  # recognised by its settings
    assert TwoViewAugmentation(flip_p=0.0).recipe == "custom"
    small = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), flip_p=0.0)
    assert small.recipe == "small_images" and small.overrides == {"crop_scale": (0.5, 1.0), "flip_p": 0.0}
    v3 = TwoViewAugmentation.mocov3(32, blur_p=0.0)
    assert v3.recipe == "mocov3" and v3.overrides == {"blur_p": (0.0, 0.0)}
    assert v3.jitter_strengths == (0.4, 0.4, 0.2, 0.1) and v3.view_solarize_p == (0.0, 0.2)
    line = describe_augmentation(TwoViewAugmentation.mocov3(224))
    assert line.startswith("mocov3 recipe: random resized crop to 224 px, scale (0.08, 1.0)")
    assert "colour jitter (0.4, 0.4, 0.2, 0.1) p=0.8" in line
    assert "Gaussian blur p=1 (view 1) / 0.1 (view 2), solarize p=0 (view 1) / 0.2 (view 2)" in line
    assert "Gaussian blur p=0.5, no solarize" in TwoViewAugmentation().describe()
    assert TwoViewAugmentation(jitter_strength=0.5).jitter_strengths == (0.5, 0.5, 0.5, 0.125)


@pytest.mark.parametrize("kwargs,message", [
    (dict(blur_p=(0.5,)), r"blur_p=\(0.5,\) is invalid: it must be a probability in \[0, 1\] or a \(view 1, view 2\)"),
    (dict(blur_p=(1.0, 1.5)), "blur_p="),
    (dict(solarize_p=-0.1), "solarize_p=-0.1 is invalid"),
    (dict(jitter=(0.4, 0.4, 0.2, 0.6)), r"jitter=.* hue <= 0.5"),
    (dict(jitter=(0.4, 0.4, 0.2)), "jitter="),
    (dict(jitter_strength=3.0), r"jitter_strength=3.0 is invalid: it must be in \[0, 2\]"),
    (dict(recipe="byol"), r"recipe='byol' is invalid: it must be one of \['mocov2', 'small_images', 'mocov3', 'custom'\]"),
])
def test_bad_recipe_values_name_the_field_and_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TwoViewAugmentation(**kwargs)
