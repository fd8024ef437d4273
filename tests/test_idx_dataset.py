"""Local idx files (Fashion-MNIST's format) as a DatasetDict with the Hub dataset's columns, and
pretrain.py's --idx_dir / --validation_size."""

import gzip
import os
import struct

import datasets
import numpy as np
import pytest

from hf_contrast import load_idx_dataset
from hf_contrast.data.idx_dataset import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, read_idx

FASHION_MNIST_PRESENT = os.path.isfile(os.path.join(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz"))


def write_idx(path, array: np.ndarray, compress=True):
    """LeCun's idx layout written by hand: 0, 0, dtype 0x08 (uint8), ndim, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(data)


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"train": (rng.integers(0, 256, (300, 28, 28)), np.arange(300) % 10),
              "t10k": (rng.integers(0, 256, (50, 28, 28)), np.arange(50) % 10)}
    for prefix, (images, labels) in arrays.items():
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", labels, compress=False)  # plain files work too
    return tmp_path, arrays


def test_idx_files_read_as_the_hub_dataset(idx_dir):
    path, arrays = idx_dir
    ds = load_idx_dataset(str(path))
    assert set(ds) == {"train", "test"} and ds["train"].column_names == ["image", "label"]
    assert isinstance(ds["train"].features["image"], datasets.Image)
    assert ds["train"].features["label"].names == list(FASHION_MNIST_CLASSES)
    assert (len(ds["train"]), len(ds["test"])) == (300, 50)
    for split, prefix in (("train", "train"), ("test", "t10k")):
        row = ds[split][7]
        assert row["image"].mode == "L" and row["image"].size == (28, 28)
        np.testing.assert_array_equal(np.asarray(row["image"]), arrays[prefix][0][7])
        assert row["label"] == arrays[prefix][1][7]


def test_bad_idx_files_are_named(idx_dir, tmp_path_factory):
    path, _ = idx_dir
    with gzip.open(path / "train-images-idx3-ubyte.gz") as f:
        raw = f.read()
    truncated = tmp_path_factory.mktemp("bad") / "truncated-idx3-ubyte"
    truncated.write_bytes(raw[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(str(truncated))
    truncated.write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(str(truncated))
    os.remove(path / "t10k-labels-idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte.*apt-get install dataset-fashion-mnist"):
        load_idx_dataset(str(path))


def test_pretrain_holds_out_a_validation_split(pretrain, idx_dir):
    path, _ = idx_dir
    data = pretrain.DataArguments(idx_dir=str(path), validation_size=100)
    train, held_out, name = pretrain.load_splits(data)
    assert (len(train), len(held_out)) == (200, 100) and "100 held out" in name
    assert sorted(held_out["label"]) == sorted(list(range(10)) * 10)  # class-balanced
    assert pretrain.normalization(data) == (pretrain.FASHION_MNIST_MEAN, pretrain.FASHION_MNIST_STD)
    hub = pretrain.DataArguments(dataset_name="zalando-datasets/fashion_mnist")
    assert pretrain.normalization(hub) == pretrain.normalization(data)  # the Hub name runs the same code
    _, test, _ = pretrain.load_splits(pretrain.DataArguments(idx_dir=str(path)))
    assert len(test) == 50  # without --validation_size: the test split
    for bad, message in ((dict(validation_size=300), "validation_size=300 is invalid"),
                         (dict(validation_size=-1), "validation_size=-1 is invalid"),
                         (dict(dataset_name="cifar10"), "--dataset_name cifar10 and --idx_dir")):
        with pytest.raises(ValueError, match=message):
            pretrain.load_splits(pretrain.DataArguments(idx_dir=str(path), **bad))


@pytest.mark.skipif(not FASHION_MNIST_PRESENT and not os.environ.get("HF_CONTRAST_REQUIRE_FASHION_MNIST"),
                    reason=f"Fashion-MNIST not installed in {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist)")
def test_debian_fashion_mnist():
    ds = load_idx_dataset()
    assert (len(ds["train"]), len(ds["test"])) == (60000, 10000)
    assert ds["train"][0]["label"] == 9 and ds["test"][0]["label"] == 9  # both first images are ankle boots
    counts = np.bincount(np.asarray(ds["train"]["label"]), minlength=10)
    assert (counts == 6000).all()
