"""SIGTERM (preemption): save a complete checkpoint at the end of the current optimizer step, then stop.

A scheduler that preempts a job (Kubernetes, SLURM's ``--signal``, a spot instance) sends SIGTERM and
kills the job a grace period later. Without a handler the run dies with its last scheduled checkpoint
only; transformers' ``enable_jit_checkpoint`` saves, but the script then goes on as if training had
finished (export, model card). Here the handler only sets a flag; at the end of the optimizer step the
callback asks the Trainer for a checkpoint (the same ``_save_checkpoint`` as a scheduled save: weights,
queue, key encoder, optimizer, scheduler, RNG, every process's buffers, the completion marker) and to stop;
``ContrastiveTrainer.train`` then raises :class:`TrainingPreempted`, and the command line exits 143
(128 + SIGTERM) with the command that resumes. Resuming from that checkpoint is the scheduled-save resume,
bitwise equal to an uninterrupted run on the CPU.

Several processes must stop at the same step (a checkpoint is written by all of them), but the signal
reaches them at different moments: the flag is agreed by one all-reduce (MAX) of a one-element tensor made
once, at logging steps only, where the step already reads metrics on the host; a SIGTERM therefore stops a
multi-process run within ``logging_steps`` optimizer steps, a single process at the end of the current one.
DataLoader workers (forked) inherit the handler and ignore the signal: the main process decides. A second
SIGTERM before the checkpoint is written kills the process as the default handler would.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.utils import logging

from .. import distributed

logger = logging.get_logger("hf_contrast.trainer")


class TrainingPreempted(RuntimeError):
    """Training stopped on SIGTERM after writing a complete checkpoint.

    Attributes:
        step: the optimizer step the run stopped after.
        checkpoint: the ``checkpoint-N`` folder written at that step (resume from it, or with ``last``).
    """

    def __init__(self, step: int, max_steps: int, checkpoint: str):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(
            f"SIGTERM: stopped after step {step} of {max_steps} with a complete checkpoint, {checkpoint} (weights, "
            "queue, key encoder, optimizer, RNG). Resume with resume_from_checkpoint='last' (training/pretrain.py: "
            "the same command with --resume_from_checkpoint last).")


class PreemptionCallback(TrainerCallback):
    """Installs the SIGTERM handler for the length of ``train`` and turns a received signal into a saved
    checkpoint and a stop at the end of an optimizer step (agreed by every process, see the module)."""

    def __init__(self):
        self.requested = False  # set by the handler (this process)
        self.stopped_at: int | None = None  # the step a checkpoint was asked for
        self._pid = os.getpid()
        self._previous = None
        self._installed = False
        self._flag: torch.Tensor | None = None  # (1,) on the training device, made once per train()

    def _handler(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: the main process saves and stops
            return
        if self.requested:  # a second SIGTERM: die now, as without the handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True

    def on_train_begin(self, args, state, control, **kwargs):
        self.requested, self.stopped_at, self._pid = False, None, os.getpid()
        if distributed.is_distributed():
            self._flag = torch.zeros(1, device=args.device)
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True

    def _agreed(self, state) -> bool:
        """Whether every process stops now: this process's flag (single process, every step) or, under
        several processes, any process's flag, read at logging steps only."""
        if not distributed.is_distributed():
            return self.requested
        if state.logging_steps and state.global_step % state.logging_steps:
            return False
        self._flag.fill_(1.0 if self.requested else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())  # a host read at a logging step, where the metrics are read anyway

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is None and state.global_step < state.max_steps and self._agreed(state):
            if state.is_world_process_zero:
                logger.warning(f"SIGTERM received: saving checkpoint-{state.global_step} and stopping")
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.restore()

    def restore(self) -> None:
        """Put back the SIGTERM handler that was there before ``train`` (also after an error)."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


def take_over_sigterm(trainer) -> PreemptionCallback:
    """Add a :class:`PreemptionCallback` to ``trainer`` in place of transformers' JIT checkpoint, whose handler
    ``Trainer.__init__`` installed (``enable_jit_checkpoint``): its callback is removed and the handler before it
    put back, so one path saves on SIGTERM."""
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback

    jit = trainer.pop_callback(JITCheckpointCallback)
    manager = getattr(jit, "jit_manager", None)
    if manager is not None and manager._original_sigterm_handler is not None:
        signal.signal(signal.SIGTERM, manager._original_sigterm_handler)
    callback = PreemptionCallback()
    trainer.add_callback(callback)
    return callback
