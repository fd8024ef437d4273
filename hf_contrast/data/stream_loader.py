"""StreamLoader: a stream's batches for training, one pass per epoch, its workers kept across epochs."""

from __future__ import annotations

import torch


class StreamLoader:
    """One pass = one epoch of this rank's batches, in order; tracks the rank's position.

    A plain ``torch.utils.data.DataLoader`` (``batch_size=None``: the dataset batches) that
    Accelerate never prepares, so it neither dispatches batches from rank 0 nor shards the stream a
    second time. Its iterator lives across epochs: the dataset's iterator runs epoch after epoch
    and each pass takes one epoch's batches from it, so the workers persist and, while the
    training loop finishes an epoch, they already open and decode the next epoch's shards (no
    stall at the boundary). A new iterator (new workers) is made only when the position changed
    under it (a checkpoint was loaded), on the first pass, or after a pass was abandoned before its
    end (training stopped: the workers are shut down then).
    """

    def __init__(self, dataset, pin_memory=False, prefetch_factor=None,
                 multiprocessing_context=None):
        self.dataset = dataset
        self.kwargs = dict(pin_memory=pin_memory, multiprocessing_context=multiprocessing_context)
        if dataset.num_workers:
            self.kwargs["prefetch_factor"] = prefetch_factor
        self._iterator = None
        self._next: tuple[int, int] | None = None  # the position of the live iterator's next batch
        self.iterators_created = 0  # DataLoader iterators (worker starts) made so far

    def __iter__(self):
        ds = self.dataset
        epoch, taken = ds._position
        per_epoch = ds.batches_per_epoch(epoch)
        if taken >= per_epoch:  # stopped right at the end of an epoch
            epoch, taken = epoch + 1, 0
            per_epoch = ds.batches_per_epoch(epoch)
        ds._position = (epoch, taken)
        if self._iterator is None or self._next != (epoch, taken):
            self.close()
            ds._start = (epoch, taken)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=ds.num_workers or 0, **self.kwargs)
            self._iterator = iter(loader)
            self.iterators_created += 1
        while taken < per_epoch:
            batch = next(self._iterator)
            got = (int(batch.pop("stream_epoch")), int(batch.pop("stream_index")))
            if got != (epoch, taken):
                self.close()
                raise RuntimeError(f"Stream batches out of order: got batch {got[1]} of epoch {got[0]}, expected "
                                   f"batch {taken} of epoch {epoch}")
            taken += 1
            ds._position = self._next = (epoch, taken)
            if taken == per_epoch:
                self._next = (epoch + 1, 0)
            try:
                yield batch
            except GeneratorExit:  # the pass was abandoned (training stopped): free the workers
                self.close()
                raise
        ds._position = (epoch + 1, 0)

    def close(self) -> None:
        """Stop the workers (a new pass starts new ones)."""
        iterator, self._iterator, self._next = self._iterator, None, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
