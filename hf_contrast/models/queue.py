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
      hold real keys. The queue fills from slot 0, so the valid slots are always ``[0, filled)``.

    The training step uses the whole ``(K, D)`` buffer with the validity mask :meth:`valid` (columns of
    unused slots get ``-inf`` logits), so every step has the same shapes (no recompiles under
    ``torch.compile`` while the queue fills) and reads nothing on the host. :meth:`push` writes at the
    device pointer with ``index_copy_`` and can be vetoed on the device (``accept``): no host-device sync.

    Host-side mirrors of the pointer and fill count (:attr:`pointer`, :attr:`num_filled`) are kept for
    logging and diagnostics; they assume every push is accepted (a rejected push stops training at the
    trainer's next check anyway) and are read back from the buffers after loading
    (:meth:`sync_from_buffers`, called by ``load_state_dict`` and ``from_pretrained``).
    """

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))
        self.register_buffer("instance_ids", torch.full((size,), UNKNOWN_INSTANCE, dtype=torch.long))
        self.register_buffer("entry_steps", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("slots", torch.arange(size), persistent=False)  # (K,) slot indices, made once
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

    def init_non_persistent_buffers(self) -> None:
        """Rebuild ``slots`` (not in checkpoints; ``from_pretrained`` leaves it uninitialised)."""
        with torch.no_grad():
            self.slots.copy_(torch.arange(self.size, device=self.slots.device))

    def sync_from_buffers(self) -> None:
        """Refresh the host-side pointer and fill count from the buffers (one sync; after loading)."""
        self.init_non_persistent_buffers()
        self._ptr, self._filled = int(self.ptr), min(max(int(self.filled), 0), self.size)

    def valid(self) -> torch.Tensor:
        """``(K,)`` bool on the device: which slots hold real keys (``slots < filled``; no host read)."""
        return self.slots < self.filled

    def negatives(self) -> torch.Tensor:
        """The filled part of the keys ``(K_filled, D)``, detached (a view; sliced with the host int: for
        diagnostics, not for the training step, which uses ``keys`` with :meth:`valid`)."""
        return self.keys[: self._filled].detach()

    def negative_ids(self) -> torch.Tensor:
        """Instance ids ``(K_filled,)`` of :meth:`negatives`."""
        return self.instance_ids[: self._filled]

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, instance_ids: torch.Tensor | None = None, step: int = -1,
                check_finite: bool = True, accept: torch.Tensor | None = None) -> None:
        """L2-normalise keys ``(B, D)`` and :meth:`push` them with their ids ``(B,)``; with
        ``check_finite``, NaN/inf keys are dropped first (a host-device sync: a data-dependent shape).
        ``accept``: a 0-d bool device tensor; when False nothing changes (see :meth:`push`).
        What :meth:`hf_contrast.MoCoModel.enqueue` and :meth:`hf_contrast.MoCoV3Model.enqueue` call."""
        if keys.ndim != 2 or keys.shape[1] != self.keys.shape[1]:
            raise ValueError(f"keys must have shape (B, {self.keys.shape[1]}), got {tuple(keys.shape)}")
        if check_finite:
            finite = torch.isfinite(keys).all(dim=1)  # (B,)
            if not bool(finite.all()):
                logger.warning(f"Dropping {int((~finite).sum())} of {keys.shape[0]} keys that are NaN or inf")
                keys = keys[finite]
                instance_ids = None if instance_ids is None else instance_ids.reshape(-1)[finite]
        self.push(F.normalize(keys.float(), dim=1), instance_ids, step, accept)

    @torch.no_grad()
    def push(self, keys: torch.Tensor, instance_ids: torch.Tensor | None = None, step: int = -1,
             accept: torch.Tensor | None = None) -> None:
        """Write ``keys`` ``(B, D)`` (already normalised) with their ids ``(B,)`` at the pointer, FIFO.

        Any B: the write wraps around the end, and when B > K only the newest K keys are kept.
        Slots come from the device pointer (``index_copy_``): no host-device sync, the same kernels
        every step. ``accept`` (0-d bool tensor, e.g. "the loss was finite"): when False the slots keep
        their keys, ids and entry steps and the pointer and fill count do not move (``torch.where`` on
        the device); ``None`` accepts.
        """
        n, size = keys.shape[0], self.size
        device = self.keys.device
        ids = (torch.full((n,), UNKNOWN_INSTANCE, dtype=torch.long, device=device) if instance_ids is None
               else instance_ids.detach().to(device=device, dtype=torch.long).reshape(-1))
        if ids.shape[0] != n:
            raise ValueError(f"instance_ids must have one id per key: got {ids.shape[0]} ids for {n} keys")
        m = min(n, size)  # only the newest K survive a write larger than the queue
        keys, ids = keys.detach().to(device=device, dtype=self.keys.dtype)[n - m :], ids[n - m :]  # (m, D), (m,)
        idx = (self.ptr + (n - m) + self.slots[:m]) % size  # (m,) slots, wrapping around, as n sequential writes
        if accept is None:
            self.keys.index_copy_(0, idx, keys)
            self.instance_ids.index_copy_(0, idx, ids)
            self.entry_steps.index_fill_(0, idx, step)
            self.ptr.add_(n).remainder_(size)
            self.filled.add_(n).clamp_(max=size)
        else:
            accept = accept.detach().to(device=device, dtype=torch.bool).reshape(())
            self.keys.index_copy_(0, idx, torch.where(accept, keys, self.keys.index_select(0, idx)))
            self.instance_ids.index_copy_(0, idx, torch.where(accept, ids, self.instance_ids.index_select(0, idx)))
            self.entry_steps.index_copy_(0, idx, torch.where(accept, step, self.entry_steps.index_select(0, idx)))
            advance = accept.long() * n  # () n or 0
            self.ptr.add_(advance).remainder_(size)
            self.filled.add_(advance).clamp_(max=size)
        self._ptr = (self._ptr + n) % size  # host mirrors: as if accepted
        self._filled = min(self._filled + n, size)


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
