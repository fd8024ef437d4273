"""The only module that touches ``torch.distributed``.

Every helper works unchanged on one process (no process group): gathers return their input and
shuffles are plain permutations. Gathers assume every process holds the same number of rows
(the trainer drops the last incomplete batch).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous for a collective, keeping channels_last (no copy when it already is)."""
    if x.ndim == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return x
    return x.contiguous()


@torch.no_grad()
def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``x`` ``(B, ...)`` of all processes in rank order -> ``(B * W, ...)``, detached."""
    if not is_distributed():
        return x.detach()
    x = _dense(x.detach())
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums the gradients of every process and keeps this rank's slice.

    Each process's loss depends on all gathered rows, so row r of the gathered tensor receives
    gradient from every process's loss; summing them and letting DDP average parameter gradients
    gives exactly the gradient of the mean loss over all processes' anchors.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rows = x.shape[0]
        return torch.cat(parts)  # (B * W, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = rank() * ctx.rows
        return grad[start : start + ctx.rows]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Differentiable all-gather: ``(B, ...)`` -> ``(B * W, ...)`` in rank order."""
    if not is_distributed():
        return x
    return _GatherWithGrad.apply(x)


@torch.no_grad()
def batch_shuffle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shuffle the global batch across processes (MoCo's shuffle-BN).

    Returns this process's share ``(B, ...)`` of the randomly permuted global batch and the
    indices that undo it. On one process BatchNorm statistics do not depend on the order of the
    batch, so there is nothing to shuffle: ``x`` comes back unchanged with ``None``.
    """
    if not is_distributed():
        return x, None
    x_all = gather_no_grad(x)  # (B * W, ...)
    perm = torch.randperm(x_all.shape[0], device=x.device)
    dist.broadcast(perm, src=0)  # every process uses rank 0's permutation
    unshuffle = torch.argsort(perm)
    mine = perm.view(world_size(), -1)[rank()]
    return x_all[mine], unshuffle


@torch.no_grad()
def batch_unshuffle(x: torch.Tensor, unshuffle: torch.Tensor | None) -> torch.Tensor:
    """Undo :func:`batch_shuffle` on its output ``(B, ...)``: this process's rows in original order."""
    if unshuffle is None:
        return x
    x_all = gather_no_grad(x)  # (B * W, ...) in shuffled order
    mine = unshuffle.view(world_size(), -1)[rank()]
    return x_all[mine]


def barrier() -> None:
    """Wait for every process (a no-op on one process)."""
    if is_distributed():
        dist.barrier()


def non_finite_flags(value: torch.Tensor) -> torch.Tensor:
    """``(W,)`` float32 on ``value``'s device, agreed by all processes: slot r is 1.0 when process r's
    ``value`` holds a NaN or inf. One all-reduce of a ``(W,)`` vector and no host read: the training step can
    use ``flags.sum() == 0`` as the ``accept`` of :meth:`hf_contrast.MoCoModel.enqueue` (the same on every
    process, so the queues stay identical) and accumulate ``flags`` to read once at a logging step."""
    bad = (~torch.isfinite(value.detach())).any().to(torch.float32)  # () 1.0 if this process has NaN/inf
    if not is_distributed():
        return bad.reshape(1)  # (1,)
    flags = torch.zeros(world_size(), device=value.device)  # (W,)
    flags[rank()] = bad
    dist.all_reduce(flags)  # (W,) slot r = 1 where process r is non-finite
    return flags


def non_finite_ranks(value: torch.Tensor) -> list[int]:
    """The processes whose ``value`` holds a NaN or inf, agreed by all processes.

    One all-reduce of a ``(world_size,)`` float vector (each process sets its own slot), then one
    device-to-host copy to read it: a few microseconds on one node, and the host sync is the one the
    finiteness check needs anyway. Every process gets the same list, so all of them can stop at the
    same step instead of the healthy ones hanging in the next collective.
    """
    return [r for r, f in enumerate(non_finite_flags(value).tolist()) if f > 0]


def gather_objects(obj) -> list:
    """``obj`` of every process, in rank order (pickled through the process group; logging steps only)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def shutdown() -> None:
    """End a script under ``torchrun``: collect garbage, wait for every process, destroy the process group.

    Call it where the trainer is no longer referenced (after the function that trained returns). A Trainer and
    its DDP wrapper sit in reference cycles; left to the interpreter's exit, they were torn down with the
    interpreter half gone, and gloo aborted the process ("terminate called without an active exception", 3 of
    26 runs of ``tests/distributed/nan_run.py`` on a loaded 2-core machine, 0 of 26 with the collection first).
    The barrier: rank 0 often works on alone (evaluation, export) while the others have finished, so every
    process destroys the group at the same point."""
    if is_distributed():
        gc.collect()  # the trainer's cycles die now, while the process group and the interpreter are whole
        dist.barrier()
        dist.destroy_process_group()
