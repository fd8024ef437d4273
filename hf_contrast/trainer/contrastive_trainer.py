"""ContrastiveTrainer: transformers' Trainer plus the queue, the EMA and honest contrastive metrics."""

from __future__ import annotations

import functools
import os
import time
import warnings

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

from .. import distributed
from ..data.streaming import StreamingTwoViewDataset
from ..models.base import ContrastivePreTrainedModel
from .arguments import ContrastiveTrainingArguments
from .callbacks import EpochCallback, LastStepLogCallback, MomentumCallback, StreamEpochCallback
from .checkpointing import (
    RESUME_LAST,
    CheckpointError,
    check_checkpoint,
    last_complete_checkpoint,
    load_rank_buffers,
    load_stream_state,
    mark_complete,
    resume_target,
    save_rank_buffers,
    save_stream_state,
)
from .checks import CollapseDetector, log_setup, validate_setup, warn_about_negatives
from .data_hooks import DataHooks
from .evaluation_hooks import EvaluationHooks
from .grad_cache import grad_cache_step
from .loss_guard import NonFiniteLossGuard
from .metrics import ContrastiveMetrics
from .preemption import TrainingPreempted, take_over_sigterm
from .throughput import ThroughputMeter, batch_size_of

logger = logging.get_logger("hf_contrast.trainer")  # one name for the package: setup lines, warnings, errors


__all__ = ["ContrastiveTrainer"]


class ContrastiveTrainer(DataHooks, EvaluationHooks, Trainer):
    """Trainer for any :class:`~hf_contrast.models.base.ContrastivePreTrainedModel` (:class:`MoCoModel`,
    :class:`MoCoV3Model`, :class:`SimCLRModel`, or a method of your own: it asks only the method interface).

    It accepts any dataset whose items hold ``pixel_values`` and ``pixel_values_2`` tensors.
    On top of ``Trainer`` it enqueues MoCo's keys after each micro-batch's loss, applies the key
    encoder's EMA once per optimizer step (:class:`MomentumCallback`) and logs, at every logging
    step: ``num_negatives`` (the true per-anchor count), ``contrastive_top1`` (how often the
    positive scores highest), ``pos_cosine``/``neg_cosine``, ``embedding_std`` (collapse check),
    for MoCo ``momentum`` and ``queue_fill``, for MoCo v3 ``momentum`` (and ``queue_fill`` with
    ``queue_size > 0``: its queue is enqueued as MoCo's, both views' keys once per micro-batch).
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, **kwargs):
        args = args if args is not None else ContrastiveTrainingArguments()
        if not isinstance(model, ContrastivePreTrainedModel):
            raise ValueError(f"ContrastiveTrainer needs a contrastive model (a ContrastivePreTrainedModel: MoCoModel, "
                             f"MoCoV3Model, SimCLRModel or your own method), got {type(model).__name__}")
        sharded = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or os.environ.get(
            "ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if args.fsdp or args.deepspeed or sharded:
            raise ValueError(
                "ContrastiveTrainer does not support FSDP or DeepSpeed (fsdp="
                f"{args.fsdp!r}, deepspeed={args.deepspeed!r}): MoCo's key encoder EMA needs the full query weights "
                "next to the key weights on every process, and the queue must stay identical across processes. "
                "Use DDP (plain torchrun / accelerate launch), which is what the default arguments give."
            )
        if isinstance(kwargs.get("train_dataset"), StreamingTwoViewDataset) and args.max_steps <= 0:
            raise ValueError(f"max_steps={args.max_steps}: a streamed train_dataset has no length, so training needs "
                             "max_steps > 0 (pretrain.py: --max_steps N; hf_contrast.data.streaming.steps_for_epochs "
                             "gives the steps of a number of epochs)")
        super().__init__(model=model, args=args, **kwargs)
        self.has_queue = model.has_queue  # keys enqueued after each loss
        self.add_callback(EpochCallback(self))
        self.add_callback(LastStepLogCallback())
        if isinstance(self.train_dataset, StreamingTwoViewDataset):  # epoch = the stream's position
            self.add_callback(StreamEpochCallback(self.train_dataset))
        self.momentum_callback = MomentumCallback() if model.has_momentum_encoder else None
        if self.momentum_callback is not None:
            self.add_callback(self.momentum_callback)
        self.contrastive_metrics = ContrastiveMetrics(model.config.temperature)
        self.loss_guard = NonFiniteLossGuard()
        self.throughput = ThroughputMeter()
        self.add_callback(self.throughput)
        self.preemption = take_over_sigterm(self) if getattr(self.args, "save_on_sigterm", True) else None
        self.collapse = CollapseDetector()
        self.channels_last = self._use_channels_last(model)
        if self.channels_last:  # parameters keep their identity: optimizer, EMA pairs and names are unchanged
            model.to(memory_format=torch.channels_last)
        validate_setup(self)  # the method's checks, the data, the step count: before any work
        warn_about_negatives(self)

    def negatives_per_anchor(self) -> int:
        """Negatives each anchor will see once training runs (MoCo: with a full queue); see
        :func:`hf_contrast.models.negatives.negatives_per_anchor`."""
        model = self.accelerator.unwrap_model(self.model)
        return model.negatives_per_anchor(self.args.per_device_train_batch_size, self.args.world_size)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``, resuming as the command line says it.

        Args:
            resume_from_checkpoint: ``True``, ``"true"`` or ``"last"``: the last COMPLETE checkpoint of
                ``output_dir`` (newer folders half-written when a process died, or with a file damaged since, are
                skipped with a warning that says why); a path: that
                checkpoint folder, which must be complete; ``None``, ``False`` or ``"false"``: start afresh.

        Raises:
            CheckpointError: before any step, when there is no checkpoint to resume from or the path is not one.

        An error during training names the last complete checkpoint (kept on disk) and how to resume from it.
        """
        if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str)
                                              and resume_from_checkpoint.strip().lower() in RESUME_LAST):
            skipped: list = []
            last_complete_checkpoint(self.args.output_dir, skipped)
            for folder, why in skipped:
                logger.warning(f"Skipping {folder}: {why}")
        resume_from_checkpoint = resume_target(resume_from_checkpoint, self.args.output_dir)
        log_setup(self)
        try:
            with warnings.catch_warnings():
                # torch >= 2.13 deprecates DDP's broadcast_buffers (transformers passes ddp_broadcast_buffers=False
                # through accelerate) for forward_sync_buffers, which would still broadcast rank 0's buffers at
                # wrap time and so overwrite the per-process BatchNorm statistics a resume just restored. The
                # warning itself says to keep broadcast_buffers=False for rank-local buffers: there is nothing to act on.
                warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
                output = super().train(resume_from_checkpoint, *args, **kwargs)
        except (Exception, KeyboardInterrupt) as error:
            if self.preemption is not None:
                self.preemption.restore()
            last = last_complete_checkpoint(self.args.output_dir) if self.args.should_save else None
            note = (f"hf_contrast: the last complete checkpoint, {last}, is kept: resume from it with "
                    f"resume_from_checkpoint='last' (training/pretrain.py: --resume_from_checkpoint last)." if last
                    else f"hf_contrast: no complete checkpoint was saved in {self.args.output_dir} before this error.")
            if self.args.should_save:
                if hasattr(error, "add_note"):  # Python >= 3.11: shown under the traceback
                    error.add_note(note)
                logger.error(note)
            raise
        self._check_loss_guard()  # steps after the last logging step
        if self.preemption is not None and self.preemption.stopped_at is not None:
            step = self.preemption.stopped_at
            folder = os.path.join(self._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{step}")
            raise TrainingPreempted(step, self.state.max_steps, folder)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Trainer's ``save_model``, refused (:class:`NonFiniteLossError`) after a non-finite loss."""
        self._check_loss_guard()
        return super().save_model(output_dir, _internal_call)

    def _check_loss_guard(self) -> None:
        self.loss_guard.check(self.accelerator.unwrap_model(self.model).config.temperature, self.args.world_size)

    def _use_channels_last(self, model) -> bool:
        """``args.channels_last``, or when None: a CUDA device and a convolutional (not patch) backbone."""
        want = getattr(self.args, "channels_last", None)
        if want is not None:
            return bool(want)
        convolutional = any(isinstance(m, torch.nn.Conv2d) for m in model.encoder.modules()) and not hasattr(
            getattr(model.encoder, "patch_embed", None), "proj")
        return self.args.device.type == "cuda" and convolutional

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """Trainer's fetch of the next micro-batches, timed for ``data_wait_fraction`` and counted for
        ``images_per_second``."""
        start = time.perf_counter()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.throughput.fetched(time.perf_counter() - start, sum(batch_size_of(b) for b in batches))
        return batches, num_items

    def floating_point_ops(self, inputs) -> int:
        """Trainer's FLOP estimate (6 x parameters x elements of the main input, its convention), with the
        parameter count computed once instead of on every micro-batch (1.2 ms for MoCo resnet50)."""
        main = getattr(self.model, "main_input_name", "pixel_values")
        if main not in inputs:
            return 0
        if getattr(self, "_num_parameters", None) is None:
            self._num_parameters = self.accelerator.unwrap_model(self.model).num_parameters(exclude_embeddings=True)
        return 6 * inputs[main].numel() * self._num_parameters

    #: What :meth:`push_to_hub` calls, ``push(trainer, commit_message=..., **kwargs)``. The Hub layer builds on
    #: the trainer, not the reverse: ``import hf_contrast`` sets it to :func:`hf_contrast.push_encoder_to_hub`.
    encoder_push = None

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs):
        """Push the query encoder (timm format) with its model card, not the full checkpoint, to
        ``args.hub_model_id``; main process only. ``kwargs`` as :func:`hf_contrast.push_encoder_to_hub`."""
        push = type(self).encoder_push
        if push is None:  # only where the package's __init__ did not run, which importing any module of it does
            raise RuntimeError("ContrastiveTrainer.encoder_push is not set: import hf_contrast first")
        return push(self, commit_message=commit_message or "End of training", **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints stay local (full training state, and transformers pickles its training args there):
        the Hub gets the encoder export, via :meth:`push_to_hub`."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Refuse checkpoints that lack any tensor of the model (queue, key encoder, ...) before
        transformers' lenient (``strict=False``) load; then restore this process's own BatchNorm
        statistics (ranks > 0)."""
        unwrapped = self.accelerator.unwrap_model(model or self.model)
        check_checkpoint(resume_from_checkpoint, unwrapped)
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if unwrapped.has_queue:
            unwrapped.queue.sync_from_buffers()  # the host-side pointer and fill count (one sync, at load)
        rank = self.args.process_index
        if isinstance(self.train_dataset, StreamingTwoViewDataset):
            state = load_stream_state(resume_from_checkpoint, rank)
            if state is None:
                raise CheckpointError(f"{resume_from_checkpoint} holds no stream position of process {rank}: the "
                                      "stream cannot resume exactly (it was written without a streamed dataset?)")
            self.train_dataset.load_state_dict(state)
        if not load_rank_buffers(resume_from_checkpoint, unwrapped, rank) and rank > 0:
            logger.warning(f"{resume_from_checkpoint} holds no buffers of process {rank} (written by fewer processes?): "
                           "it starts from rank 0's BatchNorm statistics")

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, plus each process's own buffers, then the completion marker once every
        process has written its part, and only then the rotation of old checkpoints (transformers rotates
        before our marker exists: with ``save_total_limit=1`` a kill in that window left no complete
        checkpoint)."""
        self._check_loss_guard()  # never a checkpoint of weights that a non-finite step touched
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # no rotation inside: the new checkpoint is not complete yet
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        save_rank_buffers(folder, self.accelerator.unwrap_model(self.model), self.args.process_index)
        if isinstance(self.train_dataset, StreamingTwoViewDataset):
            save_stream_state(folder, self.train_dataset.state_dict(), self.args.process_index)
        distributed.barrier()  # every process's files are on disk
        if self.args.should_save and os.path.isdir(folder):
            mark_complete(folder)  # last: weights, optimizer, RNG, trainer state and every rank's buffers
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step; for SimCLR with ``grad_cache_chunk_size`` set, the gradient-cached step.

        The cached step (:func:`~hf_contrast.trainer.grad_cache.grad_cache_step`) scales the loss by the
        micro-batch's accumulation steps as Trainer does, back-propagates it through
        ``accelerator.backward`` (mixed-precision grad scaler), runs the forwards under
        ``compute_loss_context_manager`` (autocast) and lets DDP all-reduce only after the last
        chunk (inside Trainer's own ``no_sync`` for the other micro-batches of an accumulation window).
        """
        chunk_size = getattr(self.accelerator.unwrap_model(model).config, "grad_cache_chunk_size", None)
        if chunk_size is None:  # grad_cache_chunk_size: an in-batch method's (SimCLR's) option
            return super().training_step(model, inputs, num_items_in_batch)
        if self.args.n_gpu > 1:
            raise ValueError(f"grad_cache_chunk_size={chunk_size} needs one device per process (torchrun or "
                             f"accelerate launch), not torch.nn.DataParallel over {self.args.n_gpu} GPUs")
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        accumulation = self.current_gradient_accumulation_steps

        outputs = grad_cache_step(
            model, inputs["pixel_values"], inputs["pixel_values_2"], chunk_size,
            loss_scale=1.0 / accumulation,  # as Trainer: compute_loss returns a per-micro-batch mean
            backward=self.accelerator.backward,  # applies the fp16 grad scaler
            no_sync=functools.partial(self.accelerator.no_sync, model=model),
            autocast=self.compute_loss_context_manager,
            on_loss=lambda out: self.loss_guard.update(out.loss, self.state.global_step),  # recorded on the device
        )
        self.contrastive_metrics.update(outputs)
        return outputs.loss / accumulation

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's contrastive loss of the two views; in training, then the loss guard's device-side
        record and the enqueue of the micro-batch's gathered keys (after the loss used the queue). No
        value is read on the host here: a non-finite loss is reported at the next logging step or save."""
        ids = inputs.get("instance_id") if self.has_queue else None  # TwoViewDataset items carry it
        views = inputs["pixel_values"], inputs["pixel_values_2"]
        if self.channels_last:  # a no-op for views already in channels_last
            views = tuple(v.contiguous(memory_format=torch.channels_last) for v in views)
        outputs = model(pixel_values=views[0], pixel_values_2=views[1], **({} if ids is None else {"instance_ids": ids}))
        if model.training:
            accept = self.loss_guard.update(outputs.loss, self.state.global_step)  # () bool: all losses finite so far
            unwrapped = self.accelerator.unwrap_model(model)
            if outputs.queue_keys is not None:
                ids = outputs.queue_instance_ids
                unwrapped.enqueue(  # keys of a non-finite step (and later) do not enter: accept is False
                    distributed.gather_no_grad(outputs.queue_keys),
                    None if ids is None else distributed.gather_no_grad(ids), step=self.state.global_step,
                    check_finite=False, accept=accept)
                self._notify_enqueue(unwrapped, inputs, outputs)
            self.contrastive_metrics.update(outputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _notify_enqueue(self, model, inputs, outputs) -> None:
        """Call ``on_enqueue(model=, key_pixel_values=, keys=, state=)`` on every callback that has it.

        ``keys`` are this process's keys ``(B', D)`` (before the cross-process gather) and
        ``key_pixel_values`` the images they were computed from, row for row (MoCo's second views,
        then the first views with ``symmetric_loss`` and for MoCo v3). Diagnostics such as queue consistency use it."""
        listeners = [cb for cb in self.callback_handler.callbacks if hasattr(cb, "on_enqueue")]
        if not listeners:
            return
        key_images = inputs["pixel_values_2"]
        if outputs.queue_keys.shape[0] != key_images.shape[0]:  # symmetric: keys of view 2, then of view 1
            key_images = torch.cat([inputs["pixel_values_2"], inputs["pixel_values"]])
        for cb in listeners:
            cb.on_enqueue(model=model, key_pixel_values=key_images, keys=outputs.queue_keys, state=self.state)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log; a training log first checks the loss guard (on every process: it raises
        :class:`NonFiniteLossError` there), then adds the contrastive metrics accumulated on the device
        since the last log, the throughput (``images_per_second``, ``images_per_second_per_process``,
        ``data_wait_fraction``) and, for MoCo, ``momentum`` and ``queue_fill``."""
        if "loss" in logs:
            self._check_loss_guard()
            logs.update(self.throughput.read_and_reset(self.args.device))
            if getattr(self.train_dataset, "skip_bad_samples", 0):  # unreadable images replaced so far, all ranks
                ids = distributed.gather_objects(self.train_dataset.skipped_sample_ids())
                logs["skipped_samples"] = len(set().union(*ids))
        if "loss" in logs and self.contrastive_metrics.count:  # a training log, not eval
            metrics = self.contrastive_metrics.compute_and_reset()
            logs.update(metrics)
            model = self.accelerator.unwrap_model(self.model)
            if self.momentum_callback is not None and self.momentum_callback.last_momentum is not None:
                logs["momentum"] = self.momentum_callback.last_momentum
            if self.has_queue:
                logs["queue_fill"] = int(model.queue_filled) / model.config.queue_size
            if self.args.collapse_warning:
                self.collapse.check(logs, model.config.projection_dim, model.loss_scale, self.state.global_step)
        super().log(logs, start_time)
