"""Which column of a dataset holds its images: :func:`find_image_column`, the lookup every loader and
check of :mod:`hf_contrast.data` shares (it imports nothing else of the package)."""

from __future__ import annotations

import datasets

IMAGE_COLUMN_CANDIDATES = ("image", "img", "images", "picture", "photo", "pixel_values")


def find_image_column(dataset: datasets.Dataset, image_column: str | None = None) -> str:
    """The name of the dataset's image column: ``image_column`` if given, else the first column of
    type ``datasets.Image``, else a column with a usual name.

    Raises:
        ValueError: no such column; the message lists the dataset's columns.
    """
    columns = list(dataset.column_names)
    if image_column is not None:
        if image_column not in columns:
            raise ValueError(f"image_column={image_column!r} is not a column of the dataset; its columns are {columns}")
        return image_column
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in IMAGE_COLUMN_CANDIDATES:
        if name in columns:
            return name
    raise ValueError(
        f"Found no image column among the dataset's columns {columns}: "
        "pass image_column=<name> (pretrain.py: --image_column NAME)."
    )
