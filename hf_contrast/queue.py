"""MoCo's queue of negatives as one small visible object: keys, their instance ids, the step each
entered, the write pointer and the fill count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)

UNKNOWN_INSTANCE = -1  # the id of a key whose image is unknown (never matches a query)


class NegativeQueue(nn.Module):
    """A FIFO ring buffer of L2-normalised keys, with the instance id and entry step of each key.

    Buffers (all in the state dict, so checkpoints and resume carry them; identical on every
    process, because every process pushes the same gathered keys):

    * ``keys`` ``(K, D)``: the keys; rows ``>= filled`` are unused (random unit vectors at start).
    * ``instance_ids`` ``(K,)`` long: the dataset index of each key's image, ``-1`` when unknown.
    * ``entry_steps`` ``(K,)`` long: the optimizer step at which each key entered, ``-1`` unknown.
    * ``ptr`` / ``filled``: 0-d long, the next slot to write (the oldest key) and how many slots
      hold real keys.

    The pointer and fill count are also kept as host-side Python ints (:attr:`pointer`,
    :attr:`num_filled`), which the training step reads: slicing the filled part and writing a
    batch need no ``int()`` of a device tensor, so no host-device sync. The 0-d buffers are written
    with ``fill_`` (an asynchronous kernel) for the checkpoint, and read back once after loading
    (:meth:`sync_from_buffers`, called by ``load_state_dict`` and ``MoCoModel.from_pretrained``).
    """

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))
        self.register_buffer("instance_ids", torch.full((size,), UNKNOWN_INSTANCE, dtype=torch.long))
        self.register_buffer("entry_steps", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self._ptr, self._filled = 0, 0
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.sync_from_buffers())

    @property
    def size(self) -> int:
        return self.keys.shape[0]

    @property
    def pointer(self) -> int:
        """The slot the next key is written to (host int)."""
        return self._ptr

    @property
    def num_filled(self) -> int:
        """How many slots hold real keys (host int, ``<= size``)."""
        return self._filled

    def sync_from_buffers(self) -> None:
        """Refresh the host-side pointer and fill count from the buffers (one sync; after loading)."""
        self._ptr, self._filled = int(self.ptr), min(max(int(self.filled), 0), self.size)

    def negatives(self) -> torch.Tensor:
        """The filled part of the keys ``(K_filled, D)``, detached (a view, no copy)."""
        return self.keys[: self._filled].detach()

    def negative_ids(self) -> torch.Tensor:
        """Instance ids ``(K_filled,)`` of :meth:`negatives`."""
        return self.instance_ids[: self._filled]

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, instance_ids: torch.Tensor | None = None, step: int = -1,
                check_finite: bool = True) -> None:
        """L2-normalise keys ``(B, D)`` and :meth:`push` them with their ids ``(B,)``; with
        ``check_finite``, NaN/inf keys are dropped first (a host-device sync: a data-dependent shape).
        What :meth:`hf_contrast.MoCoModel.enqueue` and :meth:`hf_contrast.MoCoV3Model.enqueue` call."""
        if keys.ndim != 2 or keys.shape[1] != self.keys.shape[1]:
            raise ValueError(f"keys must have shape (B, {self.keys.shape[1]}), got {tuple(keys.shape)}")
        if check_finite:
            finite = torch.isfinite(keys).all(dim=1)  # (B,)
            if not bool(finite.all()):
                logger.warning(f"Dropping {int((~finite).sum())} of {keys.shape[0]} keys that are NaN or inf")
                keys = keys[finite]
                instance_ids = None if instance_ids is None else instance_ids.reshape(-1)[finite]
        self.push(F.normalize(keys.float(), dim=1), instance_ids, step)

    @torch.no_grad()
    def push(self, keys: torch.Tensor, instance_ids: torch.Tensor | None = None, step: int = -1) -> None:
        """Write ``keys`` ``(B, D)`` (already normalised) with their ids ``(B,)`` at the pointer, FIFO.

        Any B: the write wraps around the end, and when B > K only the newest K keys are kept.
        Contiguous slice writes with host-side offsets: no host-device sync.
        """
        n, size = keys.shape[0], self.size
        ids = (torch.full((n,), UNKNOWN_INSTANCE, dtype=torch.long, device=keys.device) if instance_ids is None
               else instance_ids.detach().to(device=self.keys.device, dtype=torch.long).reshape(-1))
        if ids.shape[0] != n:
            raise ValueError(f"instance_ids must have one id per key: got {ids.shape[0]} ids for {n} keys")
        keys = keys.detach().to(self.keys.dtype)
        if n > size:  # only the newest K survive a write larger than the queue
            self._ptr = (self._ptr + n - size) % size
            keys, ids, n = keys[-size:], ids[-size:], size
        first = min(n, size - self._ptr)  # rows up to the end of the buffer, then wrap to slot 0
        for dst, lo, hi in ((self._ptr, 0, first), (0, first, n)):
            if hi > lo:
                self.keys[dst : dst + hi - lo] = keys[lo:hi]
                self.instance_ids[dst : dst + hi - lo] = ids[lo:hi]
                self.entry_steps[dst : dst + hi - lo] = step
        self._ptr = (self._ptr + n) % size
        self._filled = min(self._filled + n, size)
        self.ptr.fill_(self._ptr)
        self.filled.fill_(self._filled)


def upgrade_legacy_queue_state(state_dict: dict, prefix: str, queue: NegativeQueue) -> None:
    """Rename a pre-0.2 checkpoint's loose queue buffers (``queue``, ``queue_ptr``, ``queue_filled``)
    to :class:`NegativeQueue`'s, in place; their keys get unknown ids and entry steps."""
    old = prefix + "queue"
    if old not in state_dict or prefix + "queue.keys" in state_dict:
        return
    state_dict[prefix + "queue.keys"] = state_dict.pop(old)
    for name, new in (("queue_ptr", "ptr"), ("queue_filled", "filled")):
        if prefix + name in state_dict:
            state_dict[prefix + "queue." + new] = state_dict.pop(prefix + name)
    state_dict.setdefault(prefix + "queue.instance_ids", torch.full_like(queue.instance_ids, UNKNOWN_INSTANCE))
    state_dict.setdefault(prefix + "queue.entry_steps", torch.full_like(queue.entry_steps, -1))
