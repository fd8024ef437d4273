"""Webdataset shards: an image corpus as tar files of JPEGs, the format a stream reads fastest.

``write_shards`` turns any image ``datasets.Dataset`` (or an image folder) into
``shard-000000.tar, shard-000001.tar, ...`` of ``images_per_shard`` samples each, plus
``sizes.json`` (samples per shard, as open_clip writes it). Each sample is ``KEY.jpg`` and, when the
dataset has labels, ``KEY.cls`` (the label as text). ``datasets.load_dataset("webdataset",
data_files=..., streaming=True)`` reads them back with one shard per tar: columns ``jpg`` (image)
and ``cls`` (int).
"""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile

import datasets

from .columns import find_image_column
from .views import to_rgb

SIZES_FILE = "sizes.json"
SHARD_PATTERN = "shard-{index:06d}.tar"


def _jpeg_bytes(value, quality: int) -> bytes:
    """JPEG bytes of an undecoded ``datasets.Image`` value (``{"bytes", "path"}``): JPEG files are
    copied as they are, anything else is decoded and encoded once."""
    from PIL import Image

    data = value.get("bytes")
    if data is None and value.get("path"):
        with open(value["path"], "rb") as f:
            data = f.read()
    if data is None:
        raise ValueError(f"Image value {value!r} has neither bytes nor a readable path")
    if data[:3] == b"\xff\xd8\xff":  # already a JPEG
        return data
    image = Image.open(io.BytesIO(data))
    image = image if image.mode == "L" else to_rgb(image)  # JPEG holds L or RGB
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    info.mtime = 0  # reproducible archives
    tar.addfile(info, io.BytesIO(payload))


def write_shards(dataset: datasets.Dataset | str, directory: str, images_per_shard: int = 1000,
                 image_column: str | None = None, label_column: str | None = "label", quality: int = 95) -> list[str]:
    """Write ``dataset`` as webdataset tar shards of JPEGs in ``directory``, plus ``sizes.json``.

    Args:
        dataset: an image ``datasets.Dataset``, or the path of an image folder (imagefolder layout:
            class sub-folders become labels).
        directory: created if needed; existing shards of the same names are overwritten.
        images_per_shard: samples per tar (the last shard holds the rest). A stream is split by
            shard, so the corpus needs at least ``world size x dataloader workers`` shards.
        image_column: found automatically when None.
        label_column: written as ``KEY.cls`` when the dataset has this column; None: no labels.
        quality: JPEG quality for images that are not JPEGs already (JPEG files are copied).

    Returns:
        The paths of the shards written, in order.
    """
    if isinstance(images_per_shard, bool) or not isinstance(images_per_shard, int) or images_per_shard < 1:
        raise ValueError(f"images_per_shard={images_per_shard!r} is invalid: it must be an integer >= 1")
    if isinstance(dataset, str):
        if not os.path.isdir(dataset):
            raise ValueError(f"dataset={dataset!r} is neither a datasets.Dataset nor an image folder")
        dataset = datasets.load_dataset("imagefolder", data_dir=dataset, split="train")
    if len(dataset) == 0:
        raise ValueError("The dataset is empty: there is nothing to write")
    column = find_image_column(dataset, image_column)
    labelled = label_column is not None and label_column in dataset.column_names
    raw = dataset.cast_column(column, datasets.Image(decode=False))  # bytes: JPEGs are copied, not re-encoded
    os.makedirs(directory, exist_ok=True)
    paths, sizes = [], {}
    for start in range(0, len(raw), images_per_shard):
        path = os.path.join(directory, SHARD_PATTERN.format(index=len(paths)))
        rows = raw[start:start + images_per_shard]
        with tarfile.open(path, "w") as tar:
            for offset, value in enumerate(rows[column]):
                key = f"{start + offset:09d}"
                _add(tar, f"{key}.jpg", _jpeg_bytes(value, quality))
                if labelled:
                    _add(tar, f"{key}.cls", str(int(rows[label_column][offset])).encode())
        sizes[os.path.basename(path)] = len(rows[column])
        paths.append(path)
    with open(os.path.join(directory, SIZES_FILE), "w") as f:
        json.dump(sizes, f, indent=1)
    return paths


def resolve_shards(data_files: str | list[str]) -> list[str]:
    """The tar files named by ``data_files`` (paths or glob patterns), sorted, without duplicates."""
    patterns = [data_files] if isinstance(data_files, str) else list(data_files)
    files = sorted({f for p in patterns for f in (glob.glob(p) if glob.has_magic(p) else [p])})
    if not files:
        raise ValueError(f"data_files={data_files!r} matches no file")
    return files


def read_shard_sizes(files: list[str]) -> list[int] | None:
    """Samples per shard for ``files`` from the ``sizes.json`` beside them, in the same order; None
    when a file is not listed in such a file."""
    sizes: list[int] = []
    cache: dict[str, dict] = {}
    for path in files:
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in cache:
            sizes_path = os.path.join(folder, SIZES_FILE)
            cache[folder] = {}
            if os.path.isfile(sizes_path):
                with open(sizes_path) as f:
                    cache[folder] = json.load(f)
        n = cache[folder].get(os.path.basename(path))
        if n is None:
            return None
        sizes.append(int(n))
    return sizes
