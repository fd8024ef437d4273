"""Training throughput as users need it: images per second and the share of time spent waiting
for the DataLoader, per logging window, measured on the host without any device sync."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from .. import distributed


def batch_size_of(batch: dict) -> int:
    """Images in a training batch (``pixel_values`` or device augmentation's ``images``); 0 if unknown."""
    for key in ("pixel_values", "images"):
        value = batch.get(key) if isinstance(batch, dict) else None
        if value is not None and hasattr(value, "shape"):
            return int(value.shape[0])  # a host int: the shape, not the data
    return 0


class ThroughputMeter(TrainerCallback):
    """Counts images and DataLoader waiting time between logging steps.

    The trainer reports each fetch of batches (:meth:`fetched`) and reads the window at each training
    log (:meth:`read_and_reset`, on every process), which gives:

    * ``images_per_second``: all processes together, the sum of their rates;
    * ``images_per_second_per_process``: the mean rate of a process (images it trained on in the
      window / the window's wall time);
    * ``data_wait_fraction``: the mean share of the window's wall time the training loop spent blocked
      in the DataLoader. Near 0: the model is the bottleneck; large: the input pipeline is (more
      workers, device augmentation, smaller source images).

    Every process logs the same values (one small all-gather per log). Wall time between two logging
    steps includes the device's work: the logging step itself reads the loss (a sync), so a window's
    time is the time its steps really took, on any device.
    """

    def __init__(self):
        self._start: float | None = None
        self._images = 0
        self._wait = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.reset()

    def reset(self) -> None:
        self._start, self._images, self._wait = time.perf_counter(), 0, 0.0

    def fetched(self, seconds_waited: float, images: int) -> None:
        """``images`` arrived after the loop waited ``seconds_waited`` for them."""
        if self._start is None:
            self.reset()
        self._wait += seconds_waited
        self._images += images

    def read_and_reset(self, device: torch.device | str = "cpu") -> dict[str, float]:
        """The window's figures, agreed by all processes (empty when nothing was fetched), and a new
        window. Call it on every process at the same points: it gathers ``(W, 2)`` numbers on ``device``."""
        elapsed = max(time.perf_counter() - self._start, 1e-9) if self._start is not None else 1.0
        local = torch.tensor([[self._images / elapsed, self._wait / elapsed]], dtype=torch.float64, device=device)
        rates = distributed.gather_no_grad(local).cpu()  # (W, 2): images/s and wait share of each process
        self.reset()
        if not rates[:, 0].gt(0).any():
            return {}
        return {"images_per_second": round(float(rates[:, 0].sum()), 2),
                "images_per_second_per_process": round(float(rates[:, 0].mean()), 2),
                "data_wait_fraction": round(min(float(rates[:, 1].mean()), 1.0), 4)}


def summarize_throughput(log_history: list[dict]) -> dict[str, float]:
    """Mean ``images_per_second`` and ``data_wait_fraction`` of a run's training logs, leaving out the
    first window (start-up: worker spawn, compilation, cuDNN autotuning) when there are later ones."""
    windows = [h for h in log_history if "images_per_second" in h]
    if len(windows) > 1:
        windows = windows[1:]
    if not windows:
        return {}
    return {key: round(sum(h[key] for h in windows) / len(windows), 4 if key == "data_wait_fraction" else 1)
            for key in ("images_per_second", "data_wait_fraction")}
