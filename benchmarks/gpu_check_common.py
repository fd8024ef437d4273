"""The harness of ``benchmarks/gpu_check.py``, shared with ``benchmarks/gpu_e2e.py``: the run's sizes
(:class:`Settings`), sections with a time budget each whose failure is recorded and does not stop the others
(:class:`Run`), and one model's timed training step (:class:`Method`, :func:`time_methods`,
:func:`compile_encoders`)."""

from __future__ import annotations

import contextlib
import gc
import signal
import statistics
import time
import traceback
from dataclasses import dataclass, field

import torch

GIB, MIB = 2**30, 2**20


@dataclass
class Settings:
    """Sizes of one run: the full GPU check, or the CPU smoke run of the same code."""

    smoke: bool
    device: str
    backbone: str = "resnet50"
    image_size: int = 224
    queue_size: int = 65536
    batches: tuple[int, ...] = (64, 128, 256, 512, 1024)  # throughput search, ascending
    repeats: int = 5
    lightly_batch: int = 256
    memory_backbones: tuple[str, ...] = ("resnet50", "vit_small_patch16_224")
    memory_batch: int = 64  # MoCo and plain SimCLR
    memory_cached: tuple[int, int] = (256, 32)  # cached SimCLR: batch, chunk
    gc_small: int = 64
    gc_large: int = 1024
    compile_backend: str = "inductor"
    budgets: dict = field(default_factory=lambda: dict(
        correctness=30, throughput=45, compile=100, lightly=20, planner_memory=35, grad_cache=35, e2e=330))

    @classmethod
    def smoke_run(cls) -> Settings:
        return cls(
            smoke=True, device="cpu", backbone="test_resnet", image_size=32, queue_size=256, batches=(8, 16),
            repeats=1, lightly_batch=8, memory_backbones=("test_resnet", "test_vit"), memory_batch=8,
            memory_cached=(8, 2), gc_small=4, gc_large=8, compile_backend="eager",
            # about 35 s on 2 idle cores; the budgets leave room for cores shared with other jobs
            budgets=dict(correctness=40, throughput=30, compile=45, lightly=30, planner_memory=30, grad_cache=25,
                         e2e=120),  # e2e: about 45 s on 2 idle cores
        )


class SectionTimeout(Exception):
    """A section ran past its time budget."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (SIGALRM)."""

    def alarm(signum, frame):
        raise SectionTimeout(f"ran past its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Run:
    """Progress, sections and the report."""

    def __init__(self, s: Settings, total_budget: float):
        self.s, self.start, self.total = s, time.perf_counter(), total_budget
        self.device = torch.device(s.device)
        self.sections: dict[str, dict] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def section(self, name: str, fn) -> None:
        budget = min(self.s.budgets[name], self.total - self.elapsed())
        if budget < min(3.0, self.s.budgets[name]):
            self.sections[name] = dict(status="skipped", reason=f"no time left in the {self.total:.0f} s budget")
            self.log(f"{name}: skipped (no time left)")
            return
        self.log(f"{name}: start (budget {budget:.0f} s)")
        t = time.perf_counter()
        record = dict(status="ok", budget_s=round(budget, 1))
        self.sections[name] = record
        try:
            with time_limit(budget):
                out = fn(self, record, time.perf_counter() + budget)
            if isinstance(out, str):  # a reason to skip
                record.update(status="skipped", reason=out)
        except SectionTimeout as e:
            record.update(status="timed_out", reason=str(e))
        except Exception as e:  # noqa: BLE001 - one section's failure must not stop the others
            record.update(status="failed", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
        finally:
            record["seconds"] = round(time.perf_counter() - t, 1)
            free_memory()
        self.log(f"{name}: {record['status']} in {record['seconds']} s" + (f" ({record['reason']})"
                                                                          if "reason" in record else ""))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Method:
    """One model's training step at a given batch: bf16 autocast (``dtype``; None: fp32), channels_last,
    SGD momentum."""

    def __init__(self, name: str, model: torch.nn.Module, params, step, device: torch.device,
                 dtype: torch.dtype | None = torch.bfloat16):
        self.name, self.model, self.step_fn, self.device, self.dtype = name, model, step, device, dtype
        self.model.to(device=device, memory_format=torch.channels_last).train()
        self.opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
        self.inputs: dict[int, tuple] = {}
        self._keys = None  # MoCo: this step's keys, enqueued after the backward

    def batch(self, b: int, image_size: int):
        if b not in self.inputs:
            self.inputs.clear()
            x = torch.randn(2, b, 3, image_size, image_size, device=self.device)
            x1, x2 = (v.contiguous(memory_format=torch.channels_last) for v in x)  # (B, 3, H, W) each
            self.inputs[b] = (x1, x2, torch.randint(0, 1000, (b,), device=self.device))
        return self.inputs[b]

    def __call__(self, b: int, image_size: int) -> None:
        x1, x2, y = self.batch(b, image_size)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            loss = self.step_fn(x1, x2, y)
        loss.backward()
        self.after_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.after_step()

    def after_backward(self) -> None:
        if self._keys is not None:
            self.model.enqueue(self._keys, check_finite=False)  # as the trainer: no host sync
            self._keys = None

    def after_step(self) -> None:
        if getattr(self.model, "has_momentum_encoder", hasattr(self.model, "momentum_update")):
            self.model.momentum_update(0.999)

    def timed(self, b: int, image_size: int) -> float:
        sync(self.device)
        t = time.perf_counter()
        self(b, image_size)
        sync(self.device)
        return time.perf_counter() - t


def time_methods(run: Run, methods: list[Method], b: int, deadline: float, base: str | None = "supervised") -> dict:
    """Median step time of each method, interleaved rounds (round 0 warms up); ``ratio_to_supervised``
    against the method named ``base`` (None: no ratio)."""
    times = {m.name: [] for m in methods}
    for r in range(run.s.repeats + 1):
        if r > 1 and time.perf_counter() > deadline:
            break
        for m in methods:
            t = m.timed(b, run.s.image_size)
            if r:
                times[m.name].append(t)
    ref = statistics.median(times[base]) if base else None
    return {
        name: dict(median_s=round(statistics.median(t), 4), images_per_s=round(b / statistics.median(t), 1),
                   **({} if ref is None else dict(ratio_to_supervised=round(statistics.median(t) / ref, 3))),
                   rounds=len(t))
        for name, t in times.items()
    }


def compile_encoders(model: torch.nn.Module, backend: str) -> None:
    """Compile a model's backbones in place (``nn.Module.compile``): query, key and momentum encoders,
    or the whole model when it has none; heads, loss, EMA and queue stay eager."""
    names = ("encoder", "key_encoder", "momentum_encoder")
    for enc in [getattr(model, n) for n in names if hasattr(model, n)] or [model]:
        enc.compile(backend=backend)
