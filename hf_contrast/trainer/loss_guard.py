"""The non-finite loss guard: every step's loss checked on the device, read on the host only at
logging steps, saves and the end of training (no host-device sync in a training step)."""

from __future__ import annotations

import math

import torch

from .. import distributed


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; raised on every process at the next logging step, save or end of
    training, before any checkpoint or export holds the weights of that step or later."""


class NonFiniteLossGuard:
    """Records, on the device, the first optimizer step whose loss was NaN or inf.

    :meth:`update` runs on every micro-batch and never reads a device value on the host: it returns
    ``accept``, a 0-d bool tensor that is True while every loss so far (on every process) was finite,
    which the trainer hands to the queue so that the keys of a bad step, and of every step after it,
    never enter it (``torch.where`` on the device). :meth:`check` reads the record (one small
    gather, the only host sync) and raises :class:`NonFiniteLossError` naming the step; the trainer
    calls it at each logging step, before each checkpoint and model save, and at the end of training,
    on every process at the same points, so every process stops with the same error.
    """

    def __init__(self):
        self.first_bad_step: torch.Tensor | None = None  # () long, -1 while every loss was finite
        self.local_loss: torch.Tensor | None = None  # () float, this process's loss at that step

    @torch.no_grad()
    def update(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Record ``loss`` of optimizer step ``step``; return ``accept`` (0-d bool, on the loss's device)."""
        loss = loss.detach().float().reshape(())
        if self.first_bad_step is None or self.first_bad_step.device != loss.device:
            self.first_bad_step = torch.full((), -1, dtype=torch.long, device=loss.device)
            self.local_loss = torch.zeros((), device=loss.device)
        # (W,) -> (): every process accepts or rejects the same gathered keys; one all-reduce, no host read
        finite = distributed.non_finite_flags(loss).sum() == 0
        first = ~finite & (self.first_bad_step < 0)  # () this step is the first bad one (on some process)
        self.first_bad_step.copy_(torch.where(first, step, self.first_bad_step))
        self.local_loss.copy_(torch.where(first, loss, self.local_loss))
        return self.first_bad_step < 0  # ()

    def check(self, temperature: float | None = None, world_size: int = 1) -> None:
        """Raise :class:`NonFiniteLossError` if any process saw a non-finite loss (a host sync: call it
        at logging steps and saves only, on every process at the same points)."""
        if self.first_bad_step is None:
            return
        record = torch.stack([self.first_bad_step.double(), self.local_loss.double()]).view(1, 2)  # (1, 2)
        rows = distributed.gather_no_grad(record).tolist()  # (W, 2): the step (equal on all), each one's loss
        step = int(rows[0][0])
        if step < 0:
            return
        bad = [r for r, (_, loss) in enumerate(rows) if not math.isfinite(loss)]
        mine = rows[distributed.rank()][1]
        value = "finite here" if math.isfinite(mine) else ("nan" if math.isnan(mine) else "inf")
        where = f" (not finite on process {', '.join(map(str, bad))} of {world_size})" if world_size > 1 else ""
        raise NonFiniteLossError(
            f"Step {step}: the contrastive loss is {value}{where}. Training stopped on every process; the keys of "
            "that step and later never entered the queue, and no checkpoint or export holds weights of that step "
            "or later (the check runs at logging steps and saves, so the weights in memory may have moved). Likely "
            "causes: a learning rate too high (the weights diverged), fp16 overflow in the backbone (use bf16), "
            + (f"temperature={temperature} too low for the precision, " if temperature is not None else "")
            + "or NaN/inf pixels in the input batch. Resume from the last checkpoint with a lower learning rate."
        )
