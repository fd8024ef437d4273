"""Reading a stream's shards for :class:`~hf_contrast.data.streaming.StreamingTwoViewDataset`, in its
workers: the raw samples of a slot's shards from a position (tar reads only), the seeded block
shuffle, decoding to fixed-size ``uint8`` squares, and the undecodable samples (replaced within
``skip_bad_samples``, else named with their key, shard and position); shard failures raise
:class:`~hf_contrast.data.preflight.ShardError` naming the shard and the fix."""

from __future__ import annotations

import io

import datasets
import numpy as np
import torch
from PIL import Image

from .preflight import ShardError, UnreadableImageError
from .views import square_resized

_READ_CHUNK = 64  # raw samples fetched per datasets call

_SHARD_FIX = ("Fix: write it again (hf_contrast.write_shards / training/write_shards.py) or remove it from "
              "data_files and sizes.json; hf_contrast.data.preflight.check_shards(files, sizes) checks every shard "
              "before training.")


def shard_files(dataset: datasets.IterableDataset) -> list[str] | None:
    """The files of the stream's shards, in shard order, when its reader lists them (webdataset:
    ``tar_paths``), else None."""
    iterable = getattr(dataset, "_ex_iterable", None)
    while iterable is not None:
        for name in ("tar_paths", "files"):
            files = (getattr(iterable, "kwargs", None) or {}).get(name)
            if isinstance(files, list) and len(files) == dataset.num_shards and all(isinstance(f, str) for f in files):
                return list(files)
        iterable = getattr(iterable, "ex_iterable", None)
    return None


def decode_resized(data: bytes, size: int) -> np.ndarray:
    """An encoded image -> ``(size, size, 3)`` uint8: its centre square resized to ``size`` (as the
    shorter side resized to ``size`` then a centre crop, but resampling only the square)."""
    image = Image.open(io.BytesIO(data))
    if image.format == "JPEG":
        image.draft("RGB", (size, size))  # decode at 1/2, 1/4 or 1/8 scale when that still covers size
    return square_resized(image, size)


class ShardReader:
    """The reading half of :class:`~hf_contrast.data.streaming.StreamingTwoViewDataset` (a mixin): it reads
    the attributes the dataset's constructor sets (``_raw``, ``num_shards``, ``shard_files``, ``shard_sizes``,
    ``_offsets``, ``image_column``, ``shuffle_buffer``, ``seed``, ``source_size``, ``skip_bad_samples``,
    ``_bad``, ``decoded``) and its ``skipped_samples``."""

    def _count_shards(self) -> list[int]:
        counts = []
        for i in range(self.num_shards):
            try:
                counts.append(sum(len(b[self.image_column]) for b in self._shard(i).iter(batch_size=_READ_CHUNK)))
            except Exception as error:  # a truncated or damaged tar
                raise ShardError(f"Shard {self.shard_name(i)} cannot be read while counting its samples "
                                 f"({type(error).__name__}: {error}). {_SHARD_FIX}") from error
        return counts

    def shard_name(self, index: int) -> str:
        """Shard ``index``'s file when known, else its index."""
        return self.shard_files[index] if self.shard_files else f"number {index} of {self.num_shards}"

    def _shard(self, index: int):
        return self._raw.shard(num_shards=self.num_shards, index=index)

    def _raw_samples(self, shards: list[int], start: int):
        """Raw samples ``(value, key, position in the corpus)`` of the concatenation of ``shards`` from
        index ``start`` (tar reads only)."""
        for index in shards:
            n = self.shard_sizes[index]
            if start >= n:
                start -= n
                continue
            part = self._shard(index)
            part = part.skip(start) if start else part
            offset, start = start, 0
            try:
                for chunk in part.iter(batch_size=_READ_CHUNK):
                    keys = chunk.get("__key__") or [None] * len(chunk[self.image_column])
                    for value, key in zip(chunk[self.image_column], keys, strict=True):
                        yield value, key, int(self._offsets[index]) + offset
                        offset += 1
            except Exception as error:  # e.g. tarfile.ReadError on a truncated tar
                offset = self._readable_count(index, offset)  # the chunk failed: find the sample
                raise ShardError(f"Shard {self.shard_name(index)} cannot be read at sample {offset} of {n} "
                                 f"({type(error).__name__}: {error}): it is truncated or damaged. {_SHARD_FIX}") from error
            if offset < n:
                raise ShardError(f"Shard {self.shard_name(index)} ended after {offset} samples, shard_sizes / "
                                 f"sizes.json lists {n}: it is truncated or sizes.json is stale. {_SHARD_FIX}")

    def _slot_samples(self, epoch: int, slot: int, shards: list[int], start: int, stop: int):
        """Samples ``start..stop-1`` of the slot's shuffled stream; reading begins at ``start``'s block."""
        size = self.shuffle_buffer
        block = start // size
        raw = self._raw_samples(shards, block * size)
        index = block * size
        while index < stop:
            items = [s for _, s in zip(range(size), raw, strict=False)]
            if not items:
                return
            perm = np.random.default_rng(np.random.SeedSequence([self.seed, epoch, slot, block, 2])).permutation(len(items))
            for i in perm:
                if start <= index < stop:
                    yield items[i]
                index += 1
            block += 1

    def _readable_count(self, index: int, start: int) -> int:
        """Samples of shard ``index`` readable one by one from ``start`` on (on the error path only)."""
        count = start
        try:
            for _ in self._shard(index).skip(start) if start else self._shard(index):
                count += 1
        except Exception:  # the failure being located
            pass
        return count

    def _decode(self, samples: list) -> tuple[torch.Tensor, list]:
        """``(B, 3, R, R)`` uint8 images of ``samples`` and their keys; an undecodable one replaced by
        the next decodable sample of the batch (cyclically) while within ``skip_bad_samples``."""
        arrays = []
        for value, key, position in samples:
            try:
                data = value.get("bytes")
                if data is None:
                    with open(value["path"], "rb") as f:
                        data = f.read()
                arrays.append(decode_resized(data, self.source_size))
            except Exception as error:
                self._unreadable(key, position, error)
                arrays.append(None)
        keys = [key for _, key, _ in samples]
        good = [i for i, a in enumerate(arrays) if a is not None]
        if not good:
            raise UnreadableImageError(f"No decodable image in a batch of {len(samples)} samples (keys {keys[:5]}...)")
        for i, a in enumerate(arrays):
            if a is None:  # the next decodable sample of the batch, cyclically
                j = next((g for g in good if g > i), good[0])
                arrays[i], keys[i] = arrays[j], keys[j]
        self.decoded += len(good)
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous(), keys  # (B, 3, R, R) uint8

    def _unreadable(self, key, position: int, error: Exception) -> None:
        """Count sample ``position`` as undecodable; raise when over the budget (or with no budget)."""
        if self._bad is not None:
            self._bad[position] = True
            if self.skipped_samples <= self.skip_bad_samples:
                return
        shard = int(np.searchsorted(self._offsets, position, side="right")) - 1
        raise UnreadableImageError(
            f"Sample {key!r} (sample {position - int(self._offsets[shard])} of shard {self.shard_name(shard)}) of "
            f"column {self.image_column!r} cannot be decoded: {type(error).__name__}: {error}. "
            + (f"It is undecodable sample number {self.skipped_samples}, over skip_bad_samples="
               f"{self.skip_bad_samples}. " if self._bad is not None else "")
            + "Fix: write the shard again from good images, or let training replace such samples and count them: "
            "two_view_dataset(..., skip_bad_samples=N) (pretrain.py: --skip_bad_samples N)."
        ) from error
