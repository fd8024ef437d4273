"""Pre-flight checks: unreadable images and broken shards found before the first training step.

Images (:func:`check_images`): every image is checked at its two ends, without decoding it. PIL's
``Image.open`` parses the header (format, size: a file that is not an image, or is cut inside its
header, fails here), then the last bytes are read: a JPEG must end with its EOI marker, a PNG with
its ``IEND`` chunk, a GIF with its trailer, a WebP / BMP must be as long as its header says. A file
cut short (an interrupted copy or download: the usual corruption, and the issue's "Truncated File
Read") fails this, at the cost of opening the file and reading a few KiB: measured here, 0.09-0.14 s
per 1,000 JPEGs of 500x375 (90 KiB, in the page cache; 1-4 threads on 2 cores), where decoding them
took 2.8 s; so about 2 minutes for a million images, not the ~45 minutes of a full decode. Only a file that fails
the cheap test is decoded in full, so an image with data after its end marker (e.g. a "motion
photo") is not reported: every file reported really fails to decode. Other formats are decoded in
full. Damage inside the compressed data of a complete file is not seen by this check; the training
path catches it: :class:`~hf_contrast.TwoViewDataset` and
:class:`~hf_contrast.data.streaming.StreamingTwoViewDataset` name the file, and with
``skip_bad_samples=N`` replace and count up to N of them. ``decode_sample=K`` also decodes K images
spread over the dataset in full.

Shards (:func:`check_shards`): every tar's member headers are walked (seeks, no data read, nothing
decoded; 0.03 s for 1,000 samples in 4 shards here); a truncated tar, an unreadable one, or one
whose sample count differs from ``sizes.json`` is named.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import datasets
import numpy as np
from PIL import Image

from .columns import find_image_column

_TAIL = 32  # bytes read at the end of a file
_JPEG_PADDING = b"\x00\r\n\t "  # bytes some writers leave after the EOI marker
_LISTED = 10  # bad files named in an error message


class UnreadableImageError(ValueError):
    """An image cannot be decoded (the message names its index or path and the fix)."""


class ShardError(ValueError):
    """A webdataset shard cannot be read, or does not hold the samples ``sizes.json`` lists."""


@dataclass
class BadSample:
    """One unreadable image: its index in the dataset, its file (None when embedded) and why."""

    index: int
    path: str | None
    reason: str

    def __str__(self) -> str:
        return f"image {self.index}" + (f" ({self.path})" if self.path else "") + f": {self.reason}"


@dataclass
class ImageCheckReport:
    """What :func:`check_images` found: ``checked`` images (``decoded`` of them in full), the ``bad``
    ones, and the wall time in ``seconds``."""

    checked: int
    decoded: int
    seconds: float
    bad: list[BadSample] = field(default_factory=list)

    def __str__(self) -> str:
        return (f"{self.checked} images checked ({self.decoded} decoded in full) in {self.seconds:.1f} s: "
                f"{len(self.bad)} unreadable")


def _end_is_complete(data_head: bytes, tail: bytes, size: int, image_format: str | None) -> bool | None:
    """Whether an encoded image ends where its format says it does; None: the format has no cheap test."""
    if image_format == "JPEG":
        return tail.rstrip(_JPEG_PADDING).endswith(b"\xff\xd9")
    if image_format == "PNG":
        return tail.endswith(b"IEND\xaeB`\x82")
    if image_format == "GIF":
        return tail.rstrip(b"\x00").endswith(b";")
    if image_format == "WEBP":
        return size >= 8 + int.from_bytes(data_head[4:8], "little")
    if image_format == "BMP":
        return size >= int.from_bytes(data_head[2:6], "little")
    return None


def _decode_fully(source) -> None:
    with Image.open(source) as image:
        image.load()


def check_image_value(value: dict, decode: bool = False) -> tuple[str | None, bool]:
    """Check one undecoded ``datasets.Image`` value (``{"bytes", "path"}``).

    Args:
        value: the image's bytes, or its path.
        decode: decode it in full whatever the cheap test says.

    Returns:
        ``(reason, decoded)``: None when readable, else why not; whether it was decoded in full.
    """
    data, path = value.get("bytes"), value.get("path")
    try:
        if data is None:
            if not path:
                return "neither bytes nor a path", False
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(16)
                f.seek(0)
                with Image.open(f) as image:
                    image_format = image.format
                f.seek(max(0, size - _TAIL))
                tail = f.read()
            source = path
        else:
            size, head, tail = len(data), bytes(data[:16]), bytes(data[-_TAIL:])
            with Image.open(io.BytesIO(data)) as image:
                image_format = image.format
            source = io.BytesIO(data)
        if decode or not _end_is_complete(head, tail, size, image_format):
            _decode_fully(source)  # only a suspect (or sampled) file pays a decode
            return None, True
        return None, False
    except Exception as error:  # any failure to read is the finding
        return f"{type(error).__name__}: {error}", True


def _image_source(dataset, image_column: str | None):
    """``(datasets.Dataset, column, budget)`` of a dataset or a :class:`~hf_contrast.TwoViewDataset`."""
    budget = 0
    if not isinstance(dataset, datasets.Dataset) and hasattr(dataset, "dataset"):  # a TwoViewDataset
        image_column = image_column or dataset.image_column
        budget = getattr(dataset, "skip_bad_samples", 0)
        dataset = dataset.dataset
    return dataset, find_image_column(dataset, image_column), budget


def check_images(dataset, image_column: str | None = None, max_bad: int | None = None, decode_sample: int = 0,
                 num_threads: int = 8, chunk_size: int = 1024) -> ImageCheckReport:
    """Find the unreadable images of a map-style dataset before training (see the module's notes).

    Args:
        dataset: a ``datasets.Dataset`` (an image folder loaded with ``load_dataset("imagefolder", ...)``,
            a Hub dataset), or a :class:`~hf_contrast.TwoViewDataset` (its column and its
            ``skip_bad_samples`` are used).
        image_column: found automatically when None.
        max_bad: unreadable images tolerated (the training path will skip them); default the
            TwoViewDataset's ``skip_bad_samples``, else 0.
        decode_sample: also decode this many images, spread evenly over the dataset, in full.
        num_threads: files checked in parallel (reads wait on the disk, not on the GIL).
        chunk_size: rows fetched from the dataset at once.

    Returns:
        The report; its ``bad`` list holds every unreadable image found.

    Raises:
        UnreadableImageError: more than ``max_bad`` unreadable images; names them and the fix.
    """
    start = time.perf_counter()
    dataset, column, budget = _image_source(dataset, image_column)
    max_bad = budget if max_bad is None else max_bad
    if not isinstance(dataset.features.get(column), datasets.Image):  # arrays, tensors: nothing encoded
        return ImageCheckReport(0, 0, time.perf_counter() - start)
    raw = dataset.select_columns([column]).cast_column(column, datasets.Image(decode=False))
    n = len(raw)
    sampled = set(np.linspace(0, n - 1, min(decode_sample, n)).round().astype(int).tolist()) if decode_sample else set()
    bad, decoded = [], 0
    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        for first in range(0, n, chunk_size):
            values = raw[first:first + chunk_size][column]
            jobs = [(v, first + k in sampled) for k, v in enumerate(values)]
            for k, (reason, full) in enumerate(pool.map(lambda job: check_image_value(*job), jobs)):
                decoded += full
                if reason is not None:
                    bad.append(BadSample(first + k, values[k].get("path"), reason))
    report = ImageCheckReport(n, decoded, time.perf_counter() - start, bad)
    if len(bad) > max_bad:
        listed = "\n  ".join(str(b) for b in bad[:_LISTED]) + (f"\n  ... and {len(bad) - _LISTED} more"
                                                              if len(bad) > _LISTED else "")
        raise UnreadableImageError(
            f"{len(bad)} of {n} images of column {column!r} cannot be read (found before training):\n  {listed}\n"
            f"Fix: delete or replace these files, or let training skip them: skip_bad_samples={len(bad)} "
            f"(two_view_dataset(..., skip_bad_samples=N); pretrain.py --skip_bad_samples N), which replaces each "
            "by the next readable image and counts it."
        )
    return report


@dataclass
class ShardCheckReport:
    """What :func:`check_shards` found: ``samples`` per shard (in ``files``' order) and ``seconds``."""

    files: list[str]
    samples: list[int]
    seconds: float


def count_tar_samples(path: str) -> int:
    """Samples in a webdataset tar (consecutive members sharing a key), walking member headers only.

    Raises:
        ShardError: the tar is unreadable or cut short (a member's data runs past the file's end).
    """
    size = os.path.getsize(path)
    samples, last_key = 0, None
    try:
        with tarfile.open(path, "r:") as tar:  # seekable: next() seeks over each member's data
            for member in tar:
                if member.offset_data + member.size > size:
                    raise tarfile.ReadError(f"member {member.name!r} needs {member.offset_data + member.size} bytes, "
                                            f"the file has {size}")
                if not member.isfile():
                    continue
                base = os.path.basename(member.name)
                if base.startswith((".", "__")) or "." not in base:  # skipped by datasets' webdataset reader
                    continue
                key = os.path.join(os.path.dirname(member.name), base.split(".", 1)[0])
                if key != last_key:
                    samples, last_key = samples + 1, key
            if size < tar.offset + tarfile.BLOCKSIZE:  # tarfile stops quietly at a header cut short
                raise tarfile.ReadError(f"the file ends at byte {size}, inside the header at byte {tar.offset} "
                                        "(a complete tar ends with empty blocks there)")
    except tarfile.TarError as error:
        raise ShardError(f"Shard {path} is unreadable after {samples} samples ({error}): it is truncated or "
                         "damaged. " + _SHARD_FIX) from error
    return samples


_SHARD_FIX = ("Fix: write it again (hf_contrast.write_shards / training/write_shards.py), or remove it from "
              "data_files and from sizes.json.")


def check_shards(files: list[str], sizes: list[int] | None = None, num_threads: int = 8) -> ShardCheckReport:
    """Check webdataset shards before training: each readable to its end, with the samples ``sizes`` lists.

    Cost: one 512-byte header read and a seek per tar member (no image data read or decoded).

    Args:
        files: local tar paths.
        sizes: samples per shard in the same order (``sizes.json``, see
            :func:`hf_contrast.data.shards.read_shard_sizes`); not compared when None.
        num_threads: shards checked in parallel.

    Raises:
        ShardError: naming every bad shard, what is wrong and the fix.
    """
    start = time.perf_counter()
    if sizes is not None and len(sizes) != len(files):
        raise ValueError(f"sizes has {len(sizes)} entries for {len(files)} shards")

    def count(path):
        try:
            return count_tar_samples(path), None
        except (ShardError, OSError) as error:
            return None, str(error)

    with ThreadPoolExecutor(max(1, num_threads)) as pool:
        results = list(pool.map(count, files))
    problems = [error for _, error in results if error is not None]
    counts = [n for n, _ in results]
    if sizes is not None:
        problems += [f"Shard {path} holds {n} samples, sizes.json lists {expected}: it is truncated or sizes.json is "
                     "stale. " + _SHARD_FIX for path, n, expected in zip(files, counts, sizes, strict=True)
                     if n is not None and n != expected]
    if problems:
        raise ShardError(f"{len(problems)} of {len(files)} shards are bad (found before training):\n  "
                         + "\n  ".join(problems[:_LISTED]))
    return ShardCheckReport(list(files), counts, time.perf_counter() - start)
