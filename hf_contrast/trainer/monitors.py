"""Training-time monitors: ``TrainerCallback`` s that measure every N optimizer steps and log through
the trainer, so their values land in ``trainer.state.log_history`` and every reporting integration.

* :class:`KNNMonitor`: kNN top-1 of the encoder on a labelled held-out split (key ``knn_top1``).
* :class:`QueueConsistencyMonitor` (MoCo; in :mod:`.queue_monitors`): how well the queued keys agree with today's key encoder,
  by age, and the key encoder's drift from the query encoder.
* :class:`RepresentationMonitor`: alignment, uniformity and spread of held-out embeddings.
* :class:`FalseNegativeMonitor` (MoCo, with labels; in :mod:`.queue_monitors`): the share of queued keys of the query's class,
  and how many of them false-negative cancellation takes.

Use::

    trainer = ContrastiveTrainer(model=model, args=args, train_dataset=train)
    KNNMonitor(eval_train, eval_test, every_n_steps=100).attach(trainer)
    QueueConsistencyMonitor(every_n_steps=100).attach(trainer)
    trainer.train()

No monitor perturbs training: each one runs under ``torch.no_grad``, restores the model's train/eval
mode, and restores the random number generator state, so a run gives the same weights with or
without monitors. Each keeps the wall time it spent in ``seconds``.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader
from transformers import TrainerCallback

from ..evaluation import extract_features, knn_top1
from ..models.backbone import embedding_std
from .diagnostics import alignment, uniformity


def _check_positive_int(value, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}={value!r} is invalid: {field} must be an integer >= 1")


def _preserved_rng(device: torch.device):
    """Restore the global (and this CUDA device's) RNG state on exit: monitors must not change the
    random stream the training's augmentations and shuffles draw from."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _device_of(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class TrainingMonitor(TrainerCallback):
    """Base of the monitors: measures every ``every_n_steps`` optimizer steps and at the last step,
    and logs through the trainer given to :meth:`attach`.

    Subclasses implement :meth:`measure`, returning the values to log (or ``None`` to log nothing).

    Attributes:
        history: every dict this monitor logged, with its ``step``.
        seconds: wall time spent measuring (and, for the queue monitor, storing samples).
    """

    main_process_only = True  # measure and log on process 0 only (no collectives in measure)

    def __init__(self, every_n_steps: int = 100):
        _check_positive_int(every_n_steps, "every_n_steps")
        self.every_n_steps = every_n_steps
        self.trainer = None
        self.history: list[dict[str, float]] = []
        self.seconds = 0.0

    def attach(self, trainer):
        """Register this monitor as a callback of ``trainer`` and log through it. Returns ``self``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            name = type(self).__name__
            raise ValueError(f"{name} has no trainer to log through: "
                             f"use {name}(...).attach(trainer) instead of trainer.add_callback({name}(...))")

    def is_due(self, state) -> bool:
        """Whether optimizer step ``state.global_step`` (1-based after ``on_step_end``) is measured."""
        step = state.global_step
        return step > 0 and (step % self.every_n_steps == 0 or step == state.max_steps)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.is_due(state) or (self.main_process_only and not state.is_world_process_zero):
            return
        start = time.perf_counter()
        values = self.measure(model, state)
        self.seconds += time.perf_counter() - start
        if values:
            self.history.append({**values, "step": state.global_step})
            should_log = control.should_log  # Trainer.log clears it: keep this step's training log
            self.trainer.log(dict(values))
            control.should_log = should_log

    def measure(self, model, state) -> dict[str, float] | None:
        raise NotImplementedError


class KNNMonitor(TrainingMonitor):
    """Weighted kNN top-1 (k=200, t=0.1: MoCo's CIFAR monitor) of the model's ``encoder`` on a held-out
    split, logged as ``knn_top1``.

    Features of both splits are extracted with the encoder in eval mode (its mode is restored after),
    on the main process only. The logged value equals
    ``knn_accuracy(model.encoder, train_dataset, test_dataset, k, temperature)`` at that step.

    Args:
        train_dataset: labelled memory bank; items hold ``pixel_values`` and ``labels``
            (e.g. :func:`hf_contrast.data.eval_dataset` of the training split).
        test_dataset: labelled held-out split, same format.
        every_n_steps: optimizer steps between evaluations (the last step is always evaluated).
        k: neighbours that vote.
        temperature: vote weights ``exp(cos / temperature)``.
        batch_size: images per forward.
        cache_inputs: transform both datasets once and keep the pixel tensors in memory
            (``N * C * H * W * 4`` bytes: 61 MB for the 5,000 digits at 32 px), so later
            evaluations cost only the forward passes.
    """

    def __init__(self, train_dataset, test_dataset, every_n_steps: int = 100, k: int = 200,
                 temperature: float = 0.1, batch_size: int = 256, cache_inputs: bool = False):
        super().__init__(every_n_steps)
        _check_positive_int(k, "k")
        _check_positive_int(batch_size, "batch_size")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is invalid: temperature must be > 0 (0.1 usual)")
        self.datasets = [train_dataset, test_dataset]
        self.k, self.temperature, self.batch_size = k, temperature, batch_size
        self.cache_inputs = cache_inputs

    def measure(self, model, state) -> dict[str, float]:
        with _preserved_rng(_device_of(model)), torch.no_grad():  # a DataLoader draws a seed from the RNG
            if self.cache_inputs and not isinstance(self.datasets[0], list):
                self.datasets = [_materialise(ds, self.batch_size) for ds in self.datasets]
            train = extract_features(model.encoder, self.datasets[0], self.batch_size)  # restores train mode
            test = extract_features(model.encoder, self.datasets[1], self.batch_size)
        return {"knn_top1": knn_top1(*train, *test, k=self.k, temperature=self.temperature)}


def _materialise(dataset, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Every item of ``dataset`` as a dict of tensors, transformed once."""
    items = []
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        labels = torch.as_tensor(batch["labels"])
        items += [{"pixel_values": x, "labels": y}
                  for x, y in zip(batch["pixel_values"], labels, strict=True)]
    return items


class RepresentationMonitor(TrainingMonitor):
    """Health of the embedding distribution on fixed held-out pairs of views (Wang & Isola 2020):
    ``alignment`` (``E||z1 - z2||^2`` over positive pairs; lower is better), ``uniformity``
    (``log E exp(-2||z_i - z_j||^2)`` over all pairs, averaged over the two views; lower is more
    uniform, 0 is total collapse) and ``heldout_embedding_std`` (mean per-dimension std of the
    normalised embeddings: about ``1/sqrt(D)`` when healthy, near 0 on collapse).

    ``z`` is the projection head's output, the space the loss compares, computed in eval mode on
    the main process. The views are drawn once, with a fixed seed, so the values are comparable
    across steps.

    Args:
        dataset: items hold ``pixel_values`` and ``pixel_values_2`` (e.g.
            :func:`hf_contrast.data.two_view_dataset` of a held-out split).
        every_n_steps: optimizer steps between measurements.
        num_samples: pairs of views used (the first ``num_samples`` items).
        seed: seed of the views' augmentation.
        batch_size: images per forward.
    """

    def __init__(self, dataset, every_n_steps: int = 100, num_samples: int = 512, seed: int = 0,
                 batch_size: int = 256):
        super().__init__(every_n_steps)
        _check_positive_int(num_samples, "num_samples")
        _check_positive_int(batch_size, "batch_size")
        if num_samples < 2:
            raise ValueError(f"num_samples={num_samples!r} is invalid: uniformity needs num_samples >= 2")
        self.dataset, self.num_samples, self.seed, self.batch_size = dataset, num_samples, seed, batch_size
        self.views: tuple[torch.Tensor, torch.Tensor] | None = None

    def _draw_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        v1, v2 = [], []
        torch.manual_seed(self.seed)  # inside _preserved_rng: the training's RNG is restored afterwards
        for batch in DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False):
            v1.append(batch["pixel_values"])
            v2.append(batch["pixel_values_2"])
            if sum(len(v) for v in v1) >= self.num_samples:
                break
        n = self.num_samples
        return torch.cat(v1)[:n], torch.cat(v2)[:n]  # (N, C, H, W) each

    def measure(self, model, state) -> dict[str, float]:
        device = _device_of(model)
        was_training = model.training
        with _preserved_rng(device), torch.no_grad():
            if self.views is None:
                self.views = self._draw_views()
            model.eval()
            try:
                z1, z2 = (torch.cat([model.projector(model.encoder(c.to(device))).float().cpu()  # (N, D)
                                     for c in v.split(self.batch_size)]) for v in self.views)
            finally:
                model.train(was_training)
        return {
            "alignment": round(alignment(z1, z2), 4),
            "uniformity": round((uniformity(z1) + uniformity(z2)) / 2, 4),
            "heldout_embedding_std": round(embedding_std(z1), 5),
        }
