"""Data: the two-view augmentation (:mod:`.views`, batched kernels in :mod:`.augment`, views made on the
accelerator in :mod:`.device_augment`), map-style datasets (:mod:`.datasets`), streamed webdataset shards
(:mod:`.streaming`, :mod:`.shards`), the checks of unreadable images and shards (:mod:`.preflight`), the
image-column lookup (:mod:`.columns`), the embedded default dataset (:mod:`.default_dataset`) and local idx
files such as Fashion-MNIST's (:mod:`.idx_dataset`)."""

from __future__ import annotations

import datasets

from . import augment
from .columns import IMAGE_COLUMN_CANDIDATES, find_image_column
from .default_dataset import DIGITS_MEAN, DIGITS_STD, load_default_dataset
from .idx_dataset import FASHION_MNIST_DIR, load_idx_dataset
from .map_dataset import TwoViewDataset, eval_dataset, views_seed
from .streaming import StreamingTwoViewDataset
from .views import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RECIPE_NAMES,
    RECIPES,
    TwoViewAugmentation,
    square_resized,
    to_rgb,
)

__all__ = ["DIGITS_MEAN", "DIGITS_STD", "FASHION_MNIST_DIR", "IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_COLUMN_CANDIDATES", "RECIPES",
           "RECIPE_NAMES", "StreamingTwoViewDataset", "TwoViewAugmentation", "TwoViewDataset", "augment",
           "eval_dataset", "find_image_column", "load_default_dataset", "load_idx_dataset", "square_resized", "to_rgb",
           "two_view_dataset", "views_seed"]


def two_view_dataset(
    dataset: datasets.Dataset | datasets.IterableDataset, augmentation: TwoViewAugmentation,
    image_column: str | None = None, seed: int = 0, skip_bad_samples: int = 0, **stream_kwargs
):
    """``dataset`` as a :class:`TwoViewDataset`: items ``{"pixel_values", "pixel_values_2"}``,
    augmented lazily with views that are fresh every epoch and reproducible given ``seed``.

    A stream (``datasets.IterableDataset``) becomes a
    :class:`~hf_contrast.data.streaming.StreamingTwoViewDataset` (``stream_kwargs`` go to it).
    ``skip_bad_samples=N``: up to N unreadable images are replaced and counted instead of raising."""
    if isinstance(dataset, datasets.IterableDataset):
        return StreamingTwoViewDataset(dataset, augmentation, image_column, seed, skip_bad_samples=skip_bad_samples,
                                       **stream_kwargs)
    if stream_kwargs:
        raise ValueError(f"{sorted(stream_kwargs)} apply to a streamed dataset only (datasets.IterableDataset)")
    return TwoViewDataset(dataset, augmentation, image_column, seed, skip_bad_samples)
