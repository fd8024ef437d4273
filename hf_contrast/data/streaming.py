"""Two views of a streamed corpus: a ``datasets.IterableDataset`` read shard by shard, split by rank
and by DataLoader worker exactly once, with exact, cheap resume.

The plan of an epoch is a pure function of ``(seed, epoch)`` and the shard sizes, the same on every
process:

* the shards are permuted (seed, epoch) and dealt to ``world_size x num_workers`` readers
  ("slots"): slot ``rank * num_workers + worker`` reads shards ``perm[slot::slots]``, so the ranks
  see disjoint samples whose union is the corpus;
* each slot reads its shards in order through a seeded block shuffle buffer (``shuffle_buffer``
  consecutive samples, permuted by ``(seed, epoch, slot, block)``);
* every slot yields the same number of batches, ``min(samples of a slot) // batch_size``, so every
  rank takes the same number of steps (the few samples past it are dropped, different ones every
  epoch), and workers alternate in the DataLoader's round-robin order.

So the position of a rank in the stream is two integers, ``(epoch, batches taken this epoch)``. On
resume each slot jumps to the start of its current shuffle block (one ``skip`` inside one shard:
tar reads, no image decoded) and decodes only the samples it yields; the workers are rotated so the
DataLoader's round-robin continues where it stopped. Views are seeded by ``(seed, epoch, slot,
batch)``, so a resumed run sees exactly the batches of the uninterrupted one.

Workers decode each image and resize it to a fixed ``source_size`` square (shorter side, then a
centre crop; JPEGs are decoded at reduced size with PIL's draft mode), then either make the two
views with the batched kernels of :mod:`hf_contrast.data.augment`, or, with ``device_augmentation``,
stop there and ship ``uint8`` images with the views' parameters (drawn from the batch's seed) for
:class:`~hf_contrast.DeviceAugmentation` to augment on the model's device.

Unreadable data: :meth:`StreamingTwoViewDataset.configure` first walks the tar headers of local shards
(:func:`hf_contrast.data.preflight.check_shards`: no image read) and names a truncated shard, or one whose
sample count differs from ``sizes.json``. A shard that fails while streaming raises
:class:`~hf_contrast.data.preflight.ShardError` naming it and the sample position. An image that does not
decode raises naming its key, shard and position; with ``skip_bad_samples=N`` up to N distinct ones
are replaced by the next decodable sample of the same batch (cyclically), so every batch keeps its
size, every rank its step count, and, the batch being a pure function of ``(seed, epoch, slot,
batch)``, a resumed run its batches; they are counted in :attr:`StreamingTwoViewDataset.skipped_samples`.

Workers persist across epochs (:class:`StreamLoader` keeps one DataLoader iterator, whose dataset
iterator runs epoch after epoch), so the next epoch's shards are opened while the current one ends.
The reading and decoding of shards (in the workers) is :class:`~hf_contrast.data.shard_reader.ShardReader`'s.
"""

from __future__ import annotations

import math
import os

import datasets
import numpy as np
import torch

from .columns import find_image_column
from .map_dataset import views_seed
from .preflight import check_shards
from .shard_reader import ShardReader, decode_resized, shard_files  # noqa: F401 - decode_resized re-exported
from .stream_loader import StreamLoader
from .views import TwoViewAugmentation


class StreamingError(ValueError):
    """The stream cannot be split or resumed as asked."""


class StreamingTwoViewDataset(ShardReader, torch.utils.data.IterableDataset):
    """Two augmented views of the images of a streamed ``datasets.IterableDataset``, batched in workers.

    Yields whole batches: ``{"pixel_values", "pixel_values_2"}`` float ``(B, 3, S, S)``, or with
    device augmentation ``{"images": (B, 3, R, R) uint8, "view_params": (B, 2, P) float32}`` (the
    views' parameters, drawn in the worker from the batch's seed). Use it through
    :class:`~hf_contrast.ContrastiveTrainer` (which calls :meth:`configure` and :meth:`loader`), or
    call both yourself.

    Args:
        dataset: the stream, e.g. ``load_dataset("webdataset", data_files=..., streaming=True,
            split="train")``; not split by node already (this class owns the split).
        augmentation: the views' augmentation.
        image_column: found automatically when None.
        seed: seeds the shard order, the shuffle buffer and the views.
        shuffle_buffer: samples per shuffle block.
        shard_sizes: samples per shard, in the dataset's shard order (``sizes.json``, see
            :func:`hf_contrast.data.shards.read_shard_sizes`); counted with one pass over the raw
            bytes when None.
        source_size: side of the fixed-size images the workers make; default ``image_size * 8 / 7``
            (256 for 224 px crops).
        return_keys: add ``"__key__"`` (the samples' keys) to every batch.
        skip_bad_samples: distinct undecodable images replaced (by the next decodable sample of their
            batch) and counted in :attr:`skipped_samples` before one raises; per process (rank).
        check_shards: walk the tar headers of local shards at :meth:`configure` (see
            :func:`hf_contrast.data.preflight.check_shards`).
    """

    def __init__(self, dataset: datasets.IterableDataset, augmentation: TwoViewAugmentation,
                 image_column: str | None = None, seed: int = 0, shuffle_buffer: int = 1000,
                 shard_sizes: list[int] | None = None, source_size: int | None = None, return_keys: bool = False,
                 skip_bad_samples: int = 0, check_shards: bool = True):
        if not isinstance(dataset, datasets.IterableDataset):
            raise TypeError(f"dataset must be a datasets.IterableDataset (streaming=True), got {type(dataset).__name__}")
        if getattr(dataset, "_distributed", None) is not None:
            raise StreamingError("The stream is already split by split_dataset_by_node: pass the whole stream, "
                                 "StreamingTwoViewDataset splits it by rank and by worker itself (exactly once)")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer={shuffle_buffer!r} is invalid: it must be >= 1 (1: no shuffling)")
        if isinstance(skip_bad_samples, bool) or not isinstance(skip_bad_samples, int) or skip_bad_samples < 0:
            raise ValueError(f"skip_bad_samples={skip_bad_samples!r} is invalid: it must be an integer >= 0")
        self.image_column = find_image_column(dataset, image_column)
        columns = [self.image_column] + (["__key__"] if return_keys else [])
        self._raw = dataset.select_columns(columns).cast_column(self.image_column, datasets.Image(decode=False))
        self.num_shards = dataset.num_shards
        self.shard_files = shard_files(dataset)  # for messages and the pre-flight; None when unknown
        self.augmentation = augmentation
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self.source_size = source_size or max(augmentation.image_size, round(augmentation.image_size * 8 / 7))
        self.return_keys = return_keys
        if shard_sizes is not None and len(shard_sizes) != self.num_shards:
            raise ValueError(f"shard_sizes has {len(shard_sizes)} entries for a stream of {self.num_shards} shards")
        self.shard_sizes = list(shard_sizes) if shard_sizes is not None else self._count_shards()
        self._offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)  # shard starts
        self.skip_bad_samples = skip_bad_samples
        self.check_shards = check_shards
        self._shards_checked = False
        # the undecodable samples met, one byte per sample of the corpus, shared with the workers
        self._bad = torch.zeros(int(self._offsets[-1]), dtype=torch.bool).share_memory_() if skip_bad_samples else None
        self.batch_size = self.rank = self.world_size = self.num_workers = None
        self.device_augmentation = False
        self.decoded = 0  # images decoded by this copy of the dataset (the main process's with 0 workers)
        self._position = (0, 0)  # (epoch, batches taken this epoch) on this rank: the resume state
        self._start = (0, 0)  # what the next iteration starts from (copied into the workers)

    def check(self) -> None:
        """Walk the tar headers of the (local) shards and compare with ``shard_sizes``; once. Done by
        :meth:`configure` when ``check_shards``; a no-op for remote or non-tar shards.

        Raises:
            ShardError: naming every bad shard and the fix.
        """
        files = self.shard_files
        if files and all(f.endswith(".tar") and os.path.isfile(f) for f in files):
            check_shards(files, self.shard_sizes)
        self._shards_checked = True

    @property
    def skipped_samples(self) -> int:
        """Distinct undecodable samples replaced so far on this rank (all its workers; restored on resume)."""
        return 0 if self._bad is None else int(self._bad.sum())

    def skipped_sample_ids(self) -> list[int]:
        """Positions in the corpus (shards concatenated in order) of the samples replaced so far."""
        return [] if self._bad is None else self._bad.nonzero().flatten().tolist()

    def configure(self, batch_size: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                  device_augmentation: bool = False) -> StreamingTwoViewDataset:
        """Set the batch and the readers; check that every reader gets shards and a batch per epoch.

        Raises:
            StreamingError: fewer shards than ``world_size x max(num_workers, 1)`` readers, or a
                reader with less than one batch of samples.
        """
        slots = world_size * max(num_workers, 1)
        if self.num_shards < slots:
            raise StreamingError(
                f"The stream has {self.num_shards} shards but {world_size} processes x {max(num_workers, 1)} "
                f"DataLoader workers = {slots} readers need one shard each at least: write more, smaller shards "
                f"(hf_contrast.write_shards(..., images_per_shard=N) / training/write_shards.py --images_per_shard N) "
                f"or lower dataloader_num_workers to {max(self.num_shards // world_size, 0)} or less."
            )
        self.batch_size, self.rank, self.world_size, self.num_workers = batch_size, rank, world_size, num_workers
        self.device_augmentation = bool(device_augmentation)
        self.plan(0)  # raises when a reader has less than a batch
        if self.check_shards and not self._shards_checked:
            self.check()
        return self

    @property
    def slots_per_rank(self) -> int:
        return max(self.num_workers, 1)

    def plan(self, epoch: int) -> tuple[list[list[int]], int]:
        """The shards of every slot in ``epoch`` and the batches each slot yields (the same for all)."""
        if self.batch_size is None:
            raise StreamingError("Call configure(batch_size, rank, world_size, num_workers) before iterating")
        slots = self.world_size * self.slots_per_rank
        order = np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch), 1])).permutation(self.num_shards)
        shards = [order[s::slots].tolist() for s in range(slots)]
        smallest = min(sum(self.shard_sizes[i] for i in slot) for slot in shards)
        if smallest < self.batch_size:
            raise StreamingError(f"In epoch {epoch} a reader gets only {smallest} samples, less than one batch of "
                                 f"{self.batch_size}: use fewer readers (processes x workers) or a smaller batch")
        return shards, smallest // self.batch_size

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Batches (steps without accumulation) each rank takes in ``epoch``."""
        return self.plan(epoch)[1] * self.slots_per_rank

    # --- the resume state, kept in the main process ---
    def state_dict(self) -> dict:
        """This rank's position: ``epoch`` and ``batches`` taken in it, plus the layout it needs."""
        epoch, batches = self._position
        return {"epoch": epoch, "batches": batches, "seed": self.seed, "world_size": self.world_size,
                "num_workers": self.num_workers, "batch_size": self.batch_size, "num_shards": self.num_shards,
                "shuffle_buffer": self.shuffle_buffer, "skipped": self.skipped_sample_ids()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of :meth:`state_dict`); the layout must be the same.

        Raises:
            StreamingError: naming each field that differs.
        """
        layout = ("seed", "world_size", "num_workers", "batch_size", "num_shards", "shuffle_buffer")
        differ = [f"{k}: checkpoint {state.get(k)!r}, now {getattr(self, k)!r}" for k in layout
                  if state.get(k) != getattr(self, k)]
        if differ:
            raise StreamingError("Cannot resume the stream exactly with a different layout (" + "; ".join(differ)
                                 + "): resume with the same settings")
        self._position = (int(state["epoch"]), int(state["batches"]))
        if self._bad is not None and state.get("skipped"):
            self._bad[torch.tensor(state["skipped"], dtype=torch.long)] = True

    def loader(self, pin_memory: bool = False, prefetch_factor: int | None = None,
               multiprocessing_context=None) -> StreamLoader:
        """The iterable of batches for training (one pass = one epoch), see :class:`StreamLoader`."""
        return StreamLoader(self, pin_memory, prefetch_factor, multiprocessing_context)

    def __iter__(self):
        """This worker's batches from ``_start`` on, epoch after epoch (the loader takes one epoch a pass)."""
        epoch, taken = self._start
        info = torch.utils.data.get_worker_info()
        workers = self.slots_per_rank
        if (info.num_workers if info else 1) != workers:
            raise StreamingError(f"Configured for {self.num_workers} workers but iterated by "
                                 f"{info.num_workers if info else 0}: iterate through loader()")
        # rotation: round-robin resumes where it stopped; an epoch's batches are a multiple of the
        # workers, so a worker keeps its role in the following epochs
        role = ((info.id if info else 0) + taken) % workers
        while True:
            yield from self._epoch_batches(epoch, role, taken)
            epoch, taken = epoch + 1, 0

    def _epoch_batches(self, epoch: int, role: int, taken: int):
        shards, per_slot = self.plan(epoch)
        workers = self.slots_per_rank
        slot = self.rank * workers + role
        first = -(-(taken - role) // workers) if taken > role else 0  # batches of this role already taken
        b = self.batch_size
        samples = self._slot_samples(epoch, slot, shards[slot], first * b, per_slot * b)
        for c in range(first, per_slot):
            batch_samples = [s for _, s in zip(range(b), samples, strict=False)]
            images, keys = self._decode(batch_samples)  # (B, 3, R, R) uint8
            generator = torch.Generator().manual_seed(views_seed(self.seed, epoch, [slot, c]))
            params = self.augmentation.view_params(len(images), self.source_size, self.source_size, generator)
            out = {"stream_epoch": torch.tensor(epoch), "stream_index": torch.tensor(c * workers + role)}
            if self.device_augmentation:
                out.update(images=images, view_params=params)  # (B, 3, R, R) uint8, (B, 2, P) float32
            else:
                v1, v2 = self.augmentation.views(images, params)
                out.update(pixel_values=v1, pixel_values_2=v2)
            if self.return_keys:
                out["__key__"] = keys  # a replaced sample carries its replacement's key
            yield out


def streaming_two_view_dataset(dataset: datasets.IterableDataset, augmentation: TwoViewAugmentation,
                               image_column: str | None = None, seed: int = 0, **kwargs) -> StreamingTwoViewDataset:
    """``dataset`` (a stream) as a :class:`StreamingTwoViewDataset`; ``kwargs`` as its constructor."""
    return StreamingTwoViewDataset(dataset, augmentation, image_column, seed, **kwargs)


def steps_for_epochs(dataset: StreamingTwoViewDataset, epochs: float) -> int:
    """``max_steps`` for about ``epochs`` passes over the stream (the dataset must be configured)."""
    return max(1, math.ceil(epochs * dataset.batches_per_epoch()))
