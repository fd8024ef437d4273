"""The monitors of a queue (MoCo): :class:`QueueConsistencyMonitor` (how well queued keys agree with today's key
encoder, by age, and the key encoder's drift) and :class:`FalseNegativeMonitor` (the queue's same-class share and
what false-negative cancellation takes). See :mod:`hf_contrast.trainer.monitors` for the common base."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from .. import distributed
from ..models.false_negatives import support_scores, top_k_false_negatives
from .diagnostics import key_consistency, parameter_drift
from .monitors import TrainingMonitor, _check_positive_int, _device_of, _preserved_rng


class QueueConsistencyMonitor(TrainingMonitor):
    """MoCo's queue consistency, measured: re-encode inputs whose keys sit in the queue with the
    current key encoder and compare.

    Every ``every_n_steps`` optimizer steps it logs, for each age ``a`` in ``ages`` (key-encoder
    updates since the key was made, newest first), ``queue_consistency_age{a}``: the mean cosine
    between the keys enqueued ``a`` steps ago and the same images re-encoded now; their mean
    ``queue_consistency``; and ``key_drift``, ``||theta_k - theta_q|| / ||theta_q||``.

    Which images, and which BatchNorm statistics. A key made in training mode is normalised with the
    statistics of the batch it was computed in (MoCo's key encoder runs in train mode). Re-encoding
    a few sampled images, in either mode, would compare keys normalised by different statistics and
    read as inconsistency even with unchanged weights. So the monitor keeps, through the trainer's
    ``on_enqueue`` hook, the whole key mini-batch (images and keys, on the CPU) of exactly the steps
    whose age will be measured, and re-encodes each one as one batch through the model's own key
    path, in the model's current (training) mode. BatchNorm running statistics and the RNG are
    restored afterwards. The result is exact: 1.0 for an unchanged key encoder, with a BatchNorm or a
    LayerNorm backbone, when BatchNorm sees the whole key batch (``key_bn_splits=1``, or
    ``shuffle_bn=False``, or one process with a LayerNorm-only model). With ``key_bn_splits > 1`` (or
    shuffle-BN across processes) every re-encoding draws a fresh random split, so an unchanged
    encoder scores a little below 1: that floor is the noise the sub-batch statistics add to every key.

    Memory: at most ``len(ages) * ceil(max(ages) / every_n_steps + 1)`` stored key batches (inputs on the
    CPU); ``max_rows`` keeps only the first rows of each batch (exact for LayerNorm models,
    approximate for BatchNorm ones, whose statistics then come from fewer images).
    Cost: one key-encoder forward of a stored batch per age, per measurement. Measured (resnet18 at
    32 px, batch 128, 4 ages, one CPU thread): one measurement costs about 0.8 training steps, so
    ``every_n_steps=100`` adds about 0.8% to training time (8% at the ablation's ``every_n_steps=10``).

    Args:
        every_n_steps: optimizer steps between measurements (the last step is always measured).
        ages: key ages to measure, in optimizer steps, each >= 1. Default: ``num_ages`` ages spread
            evenly from 1 (the newest keys) to the queue's span, ``ceil(queue_size / keys per step)``
            (the oldest keys still in the queue).
        num_ages: how many default ages.
        max_rows: keep at most this many rows of each stored key batch (per view with
            ``symmetric_loss``); ``None`` keeps the whole batch.
    """

    main_process_only = False  # the key path may shuffle across processes: every process measures

    def __init__(self, every_n_steps: int = 100, ages: Sequence[int] | None = None, num_ages: int = 4,
                 max_rows: int | None = None):
        super().__init__(every_n_steps)
        _check_positive_int(num_ages, "num_ages")
        if max_rows is not None:
            _check_positive_int(max_rows, "max_rows")
        if ages is not None:
            if not ages:
                raise ValueError("ages=[] is invalid: ages must hold at least one age (>= 1)")
            for a in ages:
                _check_positive_int(a, "ages")
            ages = sorted(set(ages))
        self.ages, self.num_ages, self.max_rows = ages, num_ages, max_rows
        self.records: dict[int, dict] = {}  # enqueue step -> {"images", "keys", "groups"}

    def attach(self, trainer):
        """Register with ``trainer`` (a MoCo one: see :func:`require_queue`). Returns ``self``."""
        require_queue(trainer.accelerator.unwrap_model(trainer.model), type(self).__name__)
        return super().attach(trainer)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        require_queue(model, type(self).__name__)
        if self.ages is None:
            self.ages = default_ages(model.config, args, self.num_ages)
        self.records.clear()

    def _wanted(self, step: int, state) -> bool:
        """Whether the keys of optimizer step ``step`` (0-based) will be measured at some age."""
        return any((step + a) % self.every_n_steps == 0 or step + a == state.max_steps for a in self.ages)

    def on_enqueue(self, model, key_pixel_values: torch.Tensor, keys: torch.Tensor, state) -> None:
        """Store this step's key batch if one of its future ages will be measured (called by the trainer)."""
        step = state.global_step  # the 0-based index of the optimizer step in progress
        if self.ages is None or step in self.records or not self._wanted(step, state):
            return  # also: only the first micro-batch of an accumulation window
        start = time.perf_counter()
        groups = model.queued_views  # symmetric: keys of view 2, then of view 1
        rows = self.max_rows
        images = torch.cat([c[:rows] for c in key_pixel_values.detach().chunk(groups)])  # (B', C, H, W)
        stored = torch.cat([c[:rows] for c in keys.detach().float().chunk(groups)])  # (B', D)
        self.records[step] = {"images": images.to("cpu", copy=True), "keys": stored.to("cpu", copy=True),
                              "groups": groups}
        self.seconds += time.perf_counter() - start

    def measure(self, model, state) -> dict[str, float]:
        now = state.global_step  # steps taken; the newest keys (step now - 1) have seen 1 EMA update
        device = _device_of(model)
        names, values = [], []
        for age in self.ages:
            record = self.records.get(now - age)
            if record is not None:
                fresh = reencode_keys(model, record["images"].to(device), record["groups"])  # (B', D)
                names.append(f"queue_consistency_age{age}")
                values.append(key_consistency(record["keys"], fresh))
        for step in [s for s in self.records if now - s >= max(self.ages)]:
            del self.records[step]  # as old as the oldest age measured: never needed again
        drift = parameter_drift(model.key_parameters(), model.query_parameters())
        stats = torch.tensor([*values, drift], device=device)
        stats = distributed.gather_no_grad(stats.unsqueeze(0)).mean(0).tolist()  # average over processes
        logs = {name: round(v, 5) for name, v in zip(names, stats, strict=False)}
        if values:
            logs["queue_consistency"] = round(sum(stats[:-1]) / len(values), 5)
        logs["key_drift"] = float(f"{stats[-1]:.4g}")
        return logs


def require_queue(model, monitor: str) -> None:
    """Raise a ``ValueError`` naming the monitor unless ``model`` keeps a queue of keys made by a momentum encoder
    whose :meth:`encode_keys` gives them as queued (L2-normalised): MoCo's. MoCo v3's optional queue holds keys
    normalised in the loss, not by ``encode_keys``, so it is not measured."""
    if not model.has_queue:
        raise ValueError(
            f"{monitor} measures a queue of keys from earlier steps, but this {model.describe()} model has no queue: its "
            "negatives are the current batch's, so there is no stale key to measure. Use KNNMonitor and "
            "RepresentationMonitor instead.")
    if not model.encode_keys_normalized:
        raise ValueError(f"{monitor} re-encodes queued keys with encode_keys, whose output this {model.describe()} "
                         "model does not queue as is (MoCo v3's optional queue). Use KNNMonitor and "
                         "RepresentationMonitor with it.")


def default_ages(config, args, num_ages: int = 4) -> list[int]:
    """``num_ages`` key ages spread evenly from 1 to the queue's span in optimizer steps,
    ``ceil(queue_size / keys enqueued per optimizer step)``: the newest to the oldest keys in the queue."""
    keys_per_step = (args.per_device_train_batch_size * distributed.world_size()
                     * args.gradient_accumulation_steps * (2 if getattr(config, "symmetric_loss", False) else 1))
    span = max(1, math.ceil(config.queue_size / keys_per_step))
    if num_ages == 1:
        return [span]
    return sorted({round(1 + i * (span - 1) / (num_ages - 1)) for i in range(num_ages)})


@torch.no_grad()
def reencode_keys(model, images: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Keys ``(B, D)`` of a stored key batch ``(B, C, H, W)`` from the current key encoder, computed as
    the model computes keys in training (same mode, same BatchNorm batching, each of the ``groups``
    chunks as its own batch), leaving the key side's BatchNorm running statistics and the RNG as
    they were."""
    buffers = [b for m in model.key_modules() for b in m.buffers()]
    saved = [b.clone() for b in buffers]
    try:
        with _preserved_rng(images.device):
            # encode_keys: the training key path (MoCo: shuffle-BN, key_bn_splits), L2-normalised
            return torch.cat([model.encode_keys(chunk) for chunk in images.chunk(groups)])
    finally:
        for b, s in zip(buffers, saved, strict=True):
            b.copy_(s)


class FalseNegativeMonitor(TrainingMonitor):
    """MoCo: the measured false negatives of the queue, from labels, and what cancellation takes.

    Held-out labelled queries (images that are not in the queue) meet the filled queue, whose keys'
    classes come from their instance ids. Logged:

    * ``queue_same_class``: mean share of the (id-known) queued keys of the query's class: about
      1/C on a balanced corpus, whatever the model (the false-negative rate of the pool);
    * ``fnc_same_class_taken``: same-class keys per query among the candidates false-negative
      cancellation takes (the config's ``false_negative_top_k`` and threshold; with cancellation off,
      what it would take), scored as in training with the query's two embeddings as support;
    * ``fnc_taken``: candidates taken per query; ``fnc_precision``: the same-class share of them.

    Args:
        labels: the class of every training item, indexed by instance id (the dataset index), e.g.
            ``digits["train"]["label"]``.
        dataset: labelled held-out items ``{"pixel_values", "labels"}`` (:func:`~hf_contrast.data.eval_dataset`).
        every_n_steps: optimizer steps between measurements.
        num_samples: queries (the first items of ``dataset``).
    """

    def __init__(self, labels, dataset, every_n_steps: int = 100, num_samples: int = 256):
        super().__init__(every_n_steps)
        _check_positive_int(num_samples, "num_samples")
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        self.dataset, self.num_samples = dataset, num_samples
        self._queries: tuple[torch.Tensor, torch.Tensor] | None = None

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._queries is None:
            items = [self.dataset[i] for i in range(min(self.num_samples, len(self.dataset)))]
            x = torch.stack([torch.as_tensor(it["pixel_values"]) for it in items])  # (S, C, H, W)
            self._queries = x, torch.as_tensor([int(it["labels"]) for it in items])
        return self._queries

    def measure(self, model, state) -> dict[str, float] | None:
        if not model.has_queue:
            return None
        ids = model.queue.negative_ids().cpu()  # (K,)
        known = ids >= 0
        if not bool(known.any()):
            return None
        keys = model.queue.negatives()[known.to(model.queue.keys.device)]  # (K', D)
        key_labels = self.labels[ids[known]].to(keys.device)  # (K',)
        x, y = self._draw()
        device, was_training = _device_of(model), model.training
        try:
            model.eval()
            with _preserved_rng(device), torch.no_grad():
                x = x.to(device)
                q = model.projector(model.encoder(x))  # (S, D)
                k = model.key_projector(model.key_encoder(x))  # (S, D)
        finally:
            model.train(was_training)
        cfg = model.config
        same = y.to(device)[:, None] == key_labels[None, :]  # (S, K')
        taken = top_k_false_negatives(support_scores(torch.stack([q, k], dim=1), keys), None,
                                      cfg.false_negative_top_k, cfg.false_negative_threshold)  # (S, K')
        n_taken = taken.sum(1).float().mean()
        n_same = (taken & same).sum(1).float().mean()
        return {"queue_same_class": round(float(same.float().mean()), 4),
                "fnc_same_class_taken": round(float(n_same), 3), "fnc_taken": round(float(n_taken), 3),
                "fnc_precision": round(float(n_same / n_taken.clamp(min=1e-9)), 4)}
