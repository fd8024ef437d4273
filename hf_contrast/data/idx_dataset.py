"""Image datasets in the MNIST ``idx`` format (MNIST, Fashion-MNIST, KMNIST), read from local files.

Fashion-MNIST (Zalando, MIT licence; 60,000 train / 10,000 test, 28x28 greyscale, 10 classes) ships in
Debian: ``apt-get install dataset-fashion-mnist`` puts its four files under
:data:`FASHION_MNIST_DIR`. :func:`load_idx_dataset` gives the same columns and class names as the
Hub's ``zalando-datasets/fashion_mnist`` (``image``: PIL greyscale, ``label``: ClassLabel), so the
local copy and the Hub name run the same code.
"""

from __future__ import annotations

import gzip
import os

import datasets
import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ("T - shirt / top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")  # the Hub dataset's ClassLabel names, in label order
FASHION_MNIST_MEAN = (0.286, 0.286, 0.286)  # of the 60,000 training images, in [0, 1]
FASHION_MNIST_STD = (0.353, 0.353, 0.353)
IDX_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
             "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
INSTALL_HINT = "apt-get install dataset-fashion-mnist"

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """The array in an idx file (``.gz`` or plain): magic ``0 0 dtype ndim``, ``ndim`` big-endian int32
    sizes, then the data (LeCun's format).

    Raises:
        ValueError: a header that is not idx, or a file shorter than its header says.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an idx file (its first bytes are {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = 4 + 4 * ndim + dtype.itemsize * int(np.prod(shape))
    if len(raw) < expected:
        raise ValueError(f"{path} is truncated: {len(raw)} bytes, its header {shape} needs {expected}")
    return np.frombuffer(raw, dtype, count=int(np.prod(shape)), offset=4 + 4 * ndim).reshape(shape)


def _find(directory: str, stem: str) -> str | None:
    for name in (stem + ".gz", stem):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    return None


def load_idx_dataset(directory: str = FASHION_MNIST_DIR, class_names: tuple[str, ...] | None = None
                     ) -> datasets.DatasetDict:
    """The four idx files in ``directory`` (``train-images-idx3-ubyte[.gz]``, ``t10k-...``) as a
    ``DatasetDict`` with ``train`` and ``test`` splits and columns ``image`` (PIL greyscale) and ``label``
    (ClassLabel), as the Hub's ``zalando-datasets/fashion_mnist``.

    Args:
        directory: the folder of the files; default: where Debian's ``dataset-fashion-mnist`` puts them.
        class_names: the ClassLabel names; default: Fashion-MNIST's when there are 10 classes, else "0", "1", ...

    Raises:
        FileNotFoundError: a file is missing (the message names the files and the apt command).
        ValueError: a file is not idx, or images and labels disagree in number.
    """
    missing = [stem for pair in IDX_FILES.values() for stem in pair if _find(directory, stem) is None]
    if missing:
        raise FileNotFoundError(
            f"{directory} lacks the idx files {', '.join(m + '[.gz]' for m in missing)}. Fashion-MNIST: "
            f"`{INSTALL_HINT}` puts them in {FASHION_MNIST_DIR}")
    arrays = {split: (read_idx(_find(directory, im)), read_idx(_find(directory, lb)))
              for split, (im, lb) in IDX_FILES.items()}
    num_classes = int(max(labels.max() for _, labels in arrays.values())) + 1
    names = class_names or (FASHION_MNIST_CLASSES if num_classes == 10 else tuple(str(i) for i in range(num_classes)))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(names))})
    splits = {}
    for split, (images, labels) in arrays.items():  # images (N, H, W) uint8, labels (N,)
        if images.ndim != 3 or len(images) != len(labels):
            raise ValueError(f"{directory}: {split} images {images.shape} and labels {labels.shape} disagree")
        # numpy arrays become PNG-encoded PIL images in the Image column (the Hub's storage)
        splits[split] = datasets.Dataset.from_dict(
            {"image": list(images), "label": labels.astype(np.int64)}, features=features)
    return datasets.DatasetDict(splits)
