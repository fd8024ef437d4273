"""Map-style data: :class:`TwoViewDataset` (two fresh, reproducible views per image per epoch, lazily), the
deterministic evaluation transform and the per-batch seeding (the image-column lookup is
:mod:`hf_contrast.data.columns`'s, re-exported here)."""

from __future__ import annotations

import functools

import datasets
import numpy as np
import torch
from PIL import Image

from .columns import IMAGE_COLUMN_CANDIDATES, find_image_column  # noqa: F401 - re-exported
from .preflight import UnreadableImageError
from .views import TwoViewAugmentation, square_resized


def views_seed(seed: int, epoch: int, indices: list[int]) -> int:
    """A 63-bit seed for the views of a batch, from ``numpy.random.SeedSequence`` over
    ``(seed, epoch, *indices)``: the same on every machine and Python process (unlike ``hash()``,
    which ``PYTHONHASHSEED`` randomises for str and differs between builds), and well mixed, so
    neighbouring epochs or batches get unrelated random streams."""
    words = np.random.SeedSequence([int(seed), int(epoch), *map(int, indices)]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


class TwoViewDataset(torch.utils.data.Dataset):
    """Two augmented views of each image of a ``datasets.Dataset``, made lazily when items are read.

    The views of a batch depend only on ``(seed, epoch, the batch's indices)`` (see
    :func:`views_seed`): a private ``torch.Generator`` is seeded from them, and the global RNG is
    never touched. So each epoch brings fresh views, while a run resumed from a checkpoint augments
    every batch exactly as the uninterrupted run did, in any epoch, however many batches the resumed
    run skipped or prefetched.

    The epoch lives in a shared-memory tensor, so :meth:`set_epoch` in the main process reaches
    DataLoader workers too, persistent ones included. :class:`~hf_contrast.ContrastiveTrainer`
    calls it before every epoch itself: Accelerate forwards ``set_epoch`` to the dataset only when
    the sampler has none, which is never the case under DDP or on resume.

    Items are ``{"pixel_values": (3, S, S), "pixel_values_2": (3, S, S)}`` float tensors and
    ``"instance_id"``, the item's index in the dataset (a long tensor): MoCo stores it beside each
    queued key so that a query never meets its own image as a negative.

    With device augmentation (:meth:`configure_device_augmentation`, which
    :class:`~hf_contrast.ContrastiveTrainer` calls for ``device_augmentation=True``) items are
    ``{"images": (3, R, R) uint8, "view_params": (2, P) float32, "instance_id"}`` instead: the image
    decoded, its shorter side resized to ``R`` and centre-cropped, and the parameters of its two
    views drawn from the same seed; :class:`~hf_contrast.DeviceAugmentation` makes the views on the
    model's device.

    An image that cannot be decoded raises :class:`~hf_contrast.data.preflight.UnreadableImageError` naming
    its index, its file and the fix. With ``skip_bad_samples=N`` up to N distinct unreadable images
    are replaced instead, each by the next readable index (``i + 1``, ``i + 2``, ... cyclically): the
    batch keeps its size, and since the replacement depends only on which files are unreadable, a
    resumed run gets the same batches. :attr:`skipped_samples` counts them across DataLoader workers
    (a shared-memory mask of one byte per image); the (N+1)-th raises. Run
    :func:`hf_contrast.data.preflight.check_images` before training to find truncated files up front.

    Args:
        dataset: an image ``datasets.Dataset``.
        augmentation: the views' augmentation.
        image_column: found automatically when None.
        seed: seeds the views.
        skip_bad_samples: distinct unreadable images replaced and counted before one raises.
    """

    def __init__(self, dataset: datasets.Dataset, augmentation: TwoViewAugmentation, image_column: str | None = None,
                 seed: int = 0, skip_bad_samples: int = 0):
        if len(dataset) == 0:
            raise ValueError("The dataset is empty: there is nothing to pretrain on")
        if isinstance(skip_bad_samples, bool) or not isinstance(skip_bad_samples, int) or skip_bad_samples < 0:
            raise ValueError(f"skip_bad_samples={skip_bad_samples!r} is invalid: it must be an integer >= 0")
        self.dataset = dataset
        self.augmentation = augmentation
        self.image_column = find_image_column(dataset, image_column)
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()  # seen by forked/spawned workers
        self.device_augmentation = False
        self.source_size: int | None = None
        self.skip_bad_samples = skip_bad_samples
        # the unreadable images met, one byte per image, shared with (forked or spawned) workers
        self._bad = torch.zeros(len(dataset), dtype=torch.bool).share_memory_() if skip_bad_samples else None
        self._raw_dataset = None  # the image column undecoded (paths for messages), made on first use

    column_names = ["pixel_values", "pixel_values_2", "instance_id"]

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @property
    def skipped_samples(self) -> int:
        """Distinct unreadable images replaced so far, by this process and its DataLoader workers."""
        return 0 if self._bad is None else int(self._bad.sum())

    def skipped_sample_ids(self) -> list[int]:
        """The indices of the unreadable images replaced so far."""
        return [] if self._bad is None else self._bad.nonzero().flatten().tolist()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_raw_dataset"] = None  # rebuilt in the worker when needed, never pickled twice
        return state

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def configure_device_augmentation(self, source_size: int | None = None) -> TwoViewDataset:
        """Switch to device augmentation: items become ``{"images", "view_params", "instance_id"}``.

        Args:
            source_size: side ``R`` of the fixed-size ``uint8`` images; default ``image_size * 8 / 7``
                (256 for 224 px crops), as the streamed path.
        """
        size = self.augmentation.image_size
        self.device_augmentation = True
        self.source_size = int(source_size or max(size, round(size * 8 / 7)))
        return self

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A DataLoader fetches a whole batch through this: B images augmented at once."""
        indices = [int(i) for i in indices]
        generator = torch.Generator().manual_seed(views_seed(self.seed, self.epoch, indices))  # requested indices
        images, indices = self._images(indices)  # indices: where each image really comes from
        if self.device_augmentation:
            r = self.source_size
            pixels = torch.from_numpy(np.stack([square_resized(im, r) for im in images])).permute(0, 3, 1, 2)
            params = self.augmentation.view_params(len(indices), r, r, generator)  # (B, 2, P)
            return [{"images": x.contiguous(), "view_params": p, "instance_id": torch.tensor(i)}
                    for x, p, i in zip(pixels, params, indices, strict=True)]
        v1, v2 = self.augmentation.batch(images, generator=generator)  # (B, 3, S, S) each
        return [{"pixel_values": a, "pixel_values_2": b, "instance_id": torch.tensor(i)}
                for a, b, i in zip(v1, v2, indices, strict=True)]

    def _images(self, indices: list[int]) -> tuple[list, list[int]]:
        """The decoded images of ``indices`` and the indices they really come from (replacements)."""
        try:  # one datasets call for the batch; a PIL image is decoded here, inside the try
            images = self.dataset[indices][self.image_column]
            for image in images:
                if isinstance(image, Image.Image):
                    image.load()
            return images, indices
        except Exception:  # a corrupt or truncated file: find, name, maybe replace it
            pairs = [self._readable(i) for i in indices]
            return [image for image, _ in pairs], [j for _, j in pairs]

    def _readable(self, index: int) -> tuple:
        """Image ``index``, or with ``skip_bad_samples`` the next readable one: ``(image, its index)``."""
        n = len(self.dataset)
        for step in range(min(n, self.skip_bad_samples + 1)):
            j = (index + step) % n
            if self._bad is not None and bool(self._bad[j]):  # known unreadable: not decoded again
                continue
            try:
                image = self.dataset[j][self.image_column]
                if isinstance(image, Image.Image):
                    image.load()
                return image, j
            except Exception as error:
                self._unreadable(j, error)
        raise UnreadableImageError(f"No readable image among the {self.skip_bad_samples + 1} after image {index}")

    def _unreadable(self, index: int, error: Exception) -> None:
        """Count image ``index`` as unreadable; raise when over the budget (or with no budget)."""
        if self._bad is not None:
            self._bad[index] = True
        found = self.skipped_samples
        if self._bad is not None and found <= self.skip_bad_samples:
            return
        path = self._path(index)
        raise UnreadableImageError(
            f"Image {index} of column {self.image_column!r} cannot be read" + (f" ({path})" if path else "")
            + f": {type(error).__name__}: {error}. "
            + (f"It is unreadable image number {found}, over skip_bad_samples={self.skip_bad_samples}. "
               if self.skip_bad_samples else "")
            + "Fix: delete or replace the file (hf_contrast.data.preflight.check_images(dataset) lists every truncated "
            "one before training), or let training replace such images by the next readable one and count them: "
            "two_view_dataset(..., skip_bad_samples=N) (pretrain.py: --skip_bad_samples N)."
        ) from error

    def _path(self, index: int) -> str | None:
        """The file of image ``index``, when the column is a ``datasets.Image`` read from a path."""
        if not isinstance(self.dataset.features.get(self.image_column), datasets.Image):
            return None
        try:
            if self._raw_dataset is None:
                self._raw_dataset = self.dataset.select_columns([self.image_column]).cast_column(
                    self.image_column, datasets.Image(decode=False))
            return self._raw_dataset[index][self.image_column].get("path")
        except Exception:  # the message goes out without the path
            return None


def eval_dataset(
    dataset: datasets.Dataset, augmentation: TwoViewAugmentation, image_column: str | None = None,
    label_column: str | None = "label",
) -> datasets.Dataset:
    """``dataset`` whose items are ``{"pixel_values", "labels"}`` (``{"pixel_values"}`` with
    ``label_column=None``: unlabelled images, e.g. for :func:`~hf_contrast.evaluation.recalibrate_batch_norm`),
    deterministically transformed.

    Images are decoded in the transform, so an unreadable one raises
    :class:`~hf_contrast.data.preflight.UnreadableImageError` naming its file (datasets' own decoding would not).
    """
    column = find_image_column(dataset, image_column)
    if label_column is not None and label_column not in dataset.column_names:
        raise ValueError(f"label_column={label_column!r} is not a column of the dataset; its columns are {dataset.column_names}")
    pipeline = augmentation.eval_transform()
    feature = dataset.features.get(column)
    decode = None
    if isinstance(feature, datasets.Image) and feature.decode:
        dataset = dataset.cast_column(column, datasets.Image(decode=False))
        decode = functools.partial(_decode_named, feature, column)

    def transform(batch):
        images = batch[column] if decode is None else [decode(value) for value in batch[column]]
        out = {"pixel_values": [pipeline(im) for im in images]}
        if label_column is not None:
            out["labels"] = batch[label_column]
        return out

    return dataset.with_transform(transform)


def _decode_named(feature: datasets.Image, column: str, value: dict) -> Image.Image:
    """``feature.decode_example(value)`` decoded in full, or an error naming the file."""
    try:
        image = feature.decode_example(value)
        image.load()
        return image
    except Exception as error:
        path = value.get("path") or "bytes embedded in the dataset"
        raise UnreadableImageError(
            f"An image of column {column!r} cannot be read ({path}): {type(error).__name__}: {error}. Fix: delete or "
            "replace the file; hf_contrast.data.preflight.check_images(dataset) lists every unreadable image before training."
        ) from error
