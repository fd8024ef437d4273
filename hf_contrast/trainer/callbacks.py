"""The trainer's callbacks: the EMA once per optimizer step, the epoch handed to the dataset, a stream's epoch,
the loss of a run shorter than one logging window."""

from __future__ import annotations

import math

from transformers import Trainer, TrainerCallback

from ..models.momentum import momentum_at


class MomentumCallback(TrainerCallback):
    """Applies MoCo's EMA exactly once per optimizer step, with the momentum of the schedule.

    ``on_optimizer_step`` fires once per real optimizer step (after the last micro-batch of a
    gradient accumulation window), before ``global_step`` is incremented, so ``state.global_step``
    is the 0-based index of the step just taken. A step the fp16 grad scaler skipped is not an
    update of the query encoder, so the key encoder does not move either.

    A skip is seen two ways: accelerate's ``step_was_skipped`` (set when the scaler did not call the
    optimizer), and a drop of the scaler's scale across the step. The second is needed for fused
    optimizers (Trainer's default ``adamw_torch_fused``): the scaler always calls them and they skip
    the update themselves, so ``step_was_skipped`` stays False. Reading the scale is a host sync, paid
    only when a grad scaler is enabled (fp16).

    MoCo v3 (:class:`~hf_contrast.MoCoV3Model`): the official code updates inside ``forward``, at the
    start of iteration ``i``, with ``m_i``; here the update after optimizer step ``i`` uses ``m_{i+1}``
    (``model.momentum_schedule_offset = 1``), so every forward sees the same momentum encoder as
    there. The official no-op update of iteration 0 (momentum side still equal to the query side) is
    skipped, and the update after the last step uses ``m = 1`` (cosine): it changes nothing.
    """

    def __init__(self):
        self.last_momentum: float | None = None
        self._scale: float | None = None

    @staticmethod
    def _grad_scale(optimizer) -> float | None:
        scaler = getattr(optimizer, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self._scale = self._grad_scale(optimizer)

    def _step_was_skipped(self, optimizer) -> bool:
        scale, before = self._grad_scale(optimizer), self._scale
        self._scale = scale
        shrunk = scale is not None and before is not None and scale < before  # the scaler backs off only on inf
        return bool(getattr(optimizer, "step_was_skipped", False)) or shrunk

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._step_was_skipped(optimizer):
            return
        cfg = model.config
        step = state.global_step + getattr(model, "momentum_schedule_offset", 0)
        self.last_momentum = momentum_at(step, state.max_steps, cfg.momentum, cfg.momentum_schedule)
        model.momentum_update(self.last_momentum)


class EpochCallback(TrainerCallback):
    """Tells the training dataset which epoch starts, on every path.

    Accelerate's ``DataLoaderShard.set_epoch`` forwards the epoch to the dataset only when the
    sampler has no ``set_epoch`` of its own, which is never the case under DDP
    (``BatchSamplerShard``) or on resume (``SkipBatchSampler``): a resumed run would augment with the
    seeds of epoch 0. ``on_epoch_begin`` runs before the epoch's dataloader iterator is created, and
    ``state.epoch`` is then the (fractional, on resume) epoch reached so far.
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        dataset = self.trainer.train_dataset
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(math.floor((state.epoch or 0.0) + 1e-6))


class StreamEpochCallback(TrainerCallback):
    """``state.epoch`` of a streamed run: the stream's own position (epoch + batches taken / batches per epoch).

    transformers counts an epoch as ``max_steps`` when the dataset has no length, so a 20-step run over a
    stream of 4,000 images logged ``epoch: 1`` after 640 of them; the logs, the checkpoints' trainer state and
    the model card read ``state.epoch``, set here after every step.
    """

    def __init__(self, stream):
        self.stream = stream
        self._per_epoch: dict[int, int] = {}

    def on_step_end(self, args, state, control, **kwargs):
        position = self.stream.state_dict()
        epoch = position["epoch"]
        if epoch not in self._per_epoch:  # a shard plan per epoch: computed once
            self._per_epoch[epoch] = self.stream.batches_per_epoch(epoch)
        state.epoch = epoch + position["batches"] / self._per_epoch[epoch]


class LastStepLogCallback(TrainerCallback):
    """Logs the last step of a run that would otherwise log no loss: one shorter than a logging window (a
    ``max_steps=2`` smoke test under ``logging_steps=10``). transformers logs only at multiples of
    ``logging_steps``, so such a run trained and said nothing; longer runs are unchanged."""

    def on_step_end(self, args, state, control, **kwargs):
        if (args.logging_strategy == "steps" and state.global_step >= state.max_steps
                and state.global_step % max(state.logging_steps, 1) != 0
                and not any("loss" in h for h in state.log_history)):
            control.should_log = True
        return control
