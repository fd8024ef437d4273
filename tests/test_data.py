import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_contrast import TwoViewAugmentation, find_image_column, two_view_dataset
from hf_contrast.data import eval_dataset, to_rgb


def test_default_dataset_is_real_digits(digits):
    assert len(digits["train"]) == 4000 and len(digits["test"]) == 1000
    assert np.bincount(digits["test"]["label"]).tolist() == [100] * 10  # stratified
    image = digits["train"][0]["image"]
    assert image.size == (28, 28) and image.mode == "L"
    assert 0.05 < np.asarray(image).mean() / 255 < 0.3  # a white stroke on black, not noise


def test_two_views_are_different_random_crops(digits):
    aug = TwoViewAugmentation.small_images(32)
    ds = two_view_dataset(digits["train"], aug)
    item = ds[0]
    assert set(item) == {"pixel_values", "pixel_values_2", "instance_id"} and int(item["instance_id"]) == 0
    assert item["pixel_values"].shape == (3, 32, 32)
    assert not torch.equal(item["pixel_values"], item["pixel_values_2"])
    assert torch.equal(ds[0]["pixel_values"], ds[0]["pixel_values"])  # reproducible within an epoch
    ds.set_epoch(1)
    assert not torch.equal(ds[0]["pixel_values"], item["pixel_values"])  # fresh views every epoch
    state = torch.get_rng_state()
    ds.__getitems__([3, 1, 2])
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    other_seed = two_view_dataset(digits["train"], aug, seed=1)
    other_seed.set_epoch(1)
    assert not torch.equal(other_seed[0]["pixel_values"], ds[0]["pixel_values"])


def test_grayscale_and_rgba_become_rgb():
    gray = Image.fromarray(np.full((8, 8), 100, dtype=np.uint8), mode="L")
    assert to_rgb(gray).mode == "RGB" and to_rgb(gray).getpixel((0, 0)) == (100, 100, 100)
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red over white
    assert to_rgb(rgba).getpixel((0, 0)) == (255, 255, 255)
    assert TwoViewAugmentation.small_images(16)(rgba)[0].shape == (3, 16, 16)


def test_image_column_found_or_listed():
    ds = datasets.Dataset.from_dict({"img": [Image.new("RGB", (4, 4))], "y": [0]})
    assert find_image_column(ds) == "img"
    typed = ds.rename_column("img", "photo_bytes").cast_column("photo_bytes", datasets.Image())
    assert find_image_column(typed) == "photo_bytes"
    with pytest.raises(ValueError, match=r"\['text', 'y'\]"):
        find_image_column(datasets.Dataset.from_dict({"text": ["a"], "y": [0]}))
    with pytest.raises(ValueError, match="image_column='nope'"):
        find_image_column(ds, "nope")


def test_eval_dataset_is_deterministic(digits):
    ev = eval_dataset(digits["test"], TwoViewAugmentation.small_images(32))
    assert torch.equal(ev[3]["pixel_values"], ev[3]["pixel_values"]) and ev[3]["labels"] == digits["test"][3]["label"]


def test_bad_augmentation_values():
    with pytest.raises(ValueError, match="crop_scale"):
        TwoViewAugmentation(crop_scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="flip_p"):
        TwoViewAugmentation(flip_p=1.5)
