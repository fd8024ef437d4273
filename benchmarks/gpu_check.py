#!/usr/bin/env python
"""One prepared GPU check, under 10 minutes on one GPU (570 s budget, about half of it the end-to-end
runs): throughput, lightly, planner memory, gradient caching, correctness and the user's path on CUDA,
side by side in one run; a markdown report and JSON in ``--out``.

    python benchmarks/gpu_check.py                    # CUDA: resnet50 at 224 px, bf16, channels_last
    python benchmarks/gpu_check.py --only e2e         # only the user's path against the raw step
    python benchmarks/gpu_check.py --smoke            # CPU, tiny timm models, same code paths, < 2 minutes

Sections (each wrapped: a failure is reported and the rest still run; each has a time budget):

* ``correctness``: ``benchmarks/gpu_check_correctness.py`` (RNG replay with dropout/drop-path, fp16
  GradScaler with caching, a skipped fp16 step leaves the key encoder unmoved, SyncBatchNorm on one
  process).
* ``throughput``: images/s and ratio to a supervised step of MoCo v2 (queue 65536), SimCLR and MoCo v3
  (when ``hf_contrast`` has ``MoCoV3Model``), bf16 autocast, channels_last, at the largest batch that
  fits all of them (doubling search).
* ``compile``: the same with the backbones (query AND key encoders) compiled, failures reported.
* ``lightly``: our MoCo v2 step against the same step assembled from lightly's parts
  (``pip install --no-deps --target`` into a folder of its own; never a dependency).
* ``planner_memory``: ``training/plan.py``'s predicted bytes against ``max_memory_allocated`` for MoCo,
  plain and cached SimCLR on two backbones (fp32, as the planner assumes).
* ``grad_cache``: cached SimCLR at batch 1024 (chunks of 64) against plain 64 (memory) and plain 1024 (time).
* ``e2e``: ``benchmarks/gpu_e2e.py``: the user's path (``training/pretrain.py`` on streamed JPEG shards, device
  augmentation, bf16, channels_last) per method against the same model's raw step; compiled for MoCo v2
  only here (``gpu_e2e.py`` alone compiles every method). pretrain.py's logs go to ``OUT/e2e_logs``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

import hf_contrast
from hf_contrast import (
    MoCoConfig,
    MoCoModel,
    SimCLRConfig,
    SimCLRModel,
    grad_cache_step,
    peak_memory_bytes,
    probe_activation_memory,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "training"))
import gpu_check_correctness  # noqa: E402
import plan as planner  # noqa: E402

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


# ---------------------------------------------------------------- correctness


def section_correctness(run: Run, record: dict, deadline: float):
    checks = record.setdefault("checks", {})
    for name, check in gpu_check_correctness.CHECKS.items():
        if time.perf_counter() > deadline:
            checks[name] = dict(passed=False, error="not run: section budget spent")
            continue
        try:
            checks[name] = check(run.device)
        except Exception as e:  # noqa: BLE001
            checks[name] = dict(passed=False, error=f"{type(e).__name__}: {e}")
        run.log(f"  check {name}: {'PASSED' if checks[name].get('passed') else 'FAILED'}")


# ---------------------------------------------------------------- throughput (+ compile)


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


class Supervised(torch.nn.Module):
    """A timm backbone (headless, as the contrastive encoders) + a 1000-class linear head: the same
    ``encoder`` graph as MoCo's query encoder, so a compiled graph can be shared between them."""

    def __init__(self, backbone: str):
        super().__init__()
        self.encoder = timm.create_model(backbone, pretrained=False, num_classes=0)
        self.head = torch.nn.Linear(self.encoder.num_features, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))  # (B, 1000)


def build_methods(s: Settings, device: torch.device) -> tuple[list[Method], dict]:
    notes = {}
    common = dict(backbone=s.backbone, image_size=s.image_size)
    methods = []
    torch.manual_seed(0)
    sup = Supervised(s.backbone)
    methods.append(Method("supervised", sup, sup.parameters(), lambda x1, x2, y: F.cross_entropy(sup(x1), y), device))

    moco = MoCoModel(MoCoConfig(queue_size=s.queue_size, **common))
    moco.enqueue(F.normalize(torch.randn(s.queue_size, moco.config.projection_dim), dim=1))  # a full queue
    m_moco = Method(f"MoCo v2 (queue {s.queue_size})", moco, moco.query_parameters(), None, device)

    def moco_step(x1, x2, y):
        out = moco(x1, x2)
        m_moco._keys = out.queue_keys
        return out.loss

    m_moco.step_fn = moco_step
    methods.append(m_moco)

    simclr = SimCLRModel(SimCLRConfig(**common))
    methods.append(Method("SimCLR", simclr, simclr.parameters(), lambda x1, x2, y: simclr(x1, x2).loss, device))

    if hasattr(hf_contrast, "MoCoV3Model"):
        try:
            v3 = hf_contrast.MoCoV3Model(hf_contrast.MoCoV3Config(**common))
            params = v3.query_parameters() if hasattr(v3, "query_parameters") else [
                p for p in v3.parameters() if p.requires_grad]
            methods.append(Method("MoCo v3", v3, params, lambda x1, x2, y: v3(x1, x2).loss, device))
        except Exception as e:  # noqa: BLE001
            notes["moco_v3"] = f"MoCoV3Model exists but could not be built: {type(e).__name__}: {e}"
    else:
        notes["moco_v3"] = "skipped: hf_contrast has no MoCoV3Model yet"
    return methods, notes


def search_batch(run: Run, methods: list[Method], deadline: float) -> tuple[int, dict]:
    """Largest batch of ``run.s.batches`` at which one step of every method fits (ascending doubling)."""
    s, best, tried = run.s, None, {}
    for b in s.batches:
        if time.perf_counter() > deadline:
            tried[b] = "not tried: search budget spent"
            break
        try:
            for m in methods:
                m(b, s.image_size)
            sync(run.device)
            best, tried[b] = b, "fits"
            run.log(f"  batch {b}: fits")
        except Exception as e:
            if not is_oom(e):
                raise
            tried[b] = "out of memory"
        if tried[b] == "out of memory":  # outside the except block: its traceback no longer holds the step's tensors
            run.log(f"  batch {b}: out of memory")
            for m in methods:
                m.opt.zero_grad(set_to_none=True)
                m.inputs.clear()
            free_memory()
            break
    if best is None:
        raise RuntimeError(f"no batch of {s.batches} fits: {tried}")
    return best, tried


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


def section_throughput(run: Run, record: dict, deadline: float):
    s = run.s
    methods, notes = build_methods(s, run.device)
    record["notes"] = notes
    record["setup"] = f"{s.backbone} at {s.image_size} px, bf16 autocast, channels_last, SGD momentum, {run.device}"
    budget = deadline - time.perf_counter()
    b, tried = search_batch(run, methods, time.perf_counter() + 0.5 * budget)
    record.update(batch=b, batch_search=tried)
    record["results"] = time_methods(run, methods, b, deadline - 2)
    run.methods, run.batch = methods, b  # the compile section reuses them


def section_compile(run: Run, record: dict, deadline: float):
    methods, b = getattr(run, "methods", None), getattr(run, "batch", None)
    if not methods:
        return "the throughput section built no models"
    s = run.s
    record["setup"] = (f"backbones compiled in place (nn.Module.compile, backend {s.compile_backend!r}): the "
                       f"supervised model, every encoder incl. MoCo's key encoder; heads, loss, EMA eager; batch {b}")
    try:
        _compile_and_time(run, record, deadline, methods, b)
    finally:
        run.methods = None  # free the models for the memory sections, also after a timeout


def _compile_and_time(run: Run, record: dict, deadline: float, methods: list[Method], b: int) -> None:
    s = run.s
    results = record.setdefault("results", {})
    working = []
    for m in methods:
        left = deadline - time.perf_counter()
        if left < 5:
            results[m.name] = dict(status="skipped", reason="section budget spent")
            continue
        try:
            compile_encoders(m.model, s.compile_backend)
            t = time.perf_counter()
            m(b, s.image_size)
            m(b, s.image_size)  # a second call: a recompile (e.g. on the key encoder) shows here
            sync(run.device)
            results[m.name] = dict(status="ok", first_two_steps_s=round(time.perf_counter() - t, 1))
            working.append(m)
            run.log(f"  compiled {m.name}: first two steps {results[m.name]['first_two_steps_s']} s")
        except SectionTimeout:
            raise
        except Exception as e:  # noqa: BLE001
            results[m.name] = dict(status="failed", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            run.log(f"  compile {m.name}: FAILED {results[m.name]['reason']}")
            torch._dynamo.reset()
    if working and working[0].name == "supervised":
        for name, r in time_methods(run, working, b, deadline - 2).items():
            results[name].update(r)


def compile_encoders(model: torch.nn.Module, backend: str) -> None:
    """Compile a model's backbones in place (``nn.Module.compile``): query, key and momentum encoders,
    or the whole model when it has none; heads, loss, EMA and queue stay eager."""
    names = ("encoder", "key_encoder", "momentum_encoder")
    for enc in [getattr(model, n) for n in names if hasattr(model, n)] or [model]:
        enc.compile(backend=backend)


# ---------------------------------------------------------------- lightly


def import_lightly(run: Run, target: Path, wheels: str | None, timeout: float):
    """lightly's modules, importable already, from ``target``, or installed there (no dependencies)."""
    with contextlib.suppress(ImportError):
        import lightly  # noqa: F401

        return "already importable"
    if not (target / "lightly").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--retries", "0", "--timeout", "10", "--target", str(target), "lightly"]
        if wheels:
            cmd[-1:-1] = ["--no-index", "--find-links", wheels]
        run.log(f"  installing lightly into {target} (its own folder, no dependencies)")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"pip install lightly timed out after {timeout:.0f} s"
        if p.returncode:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"pip install lightly failed (rc {p.returncode}): {tail[0][:300]}"
    sys.path.insert(0, str(target))
    import lightly  # noqa: F401

    return f"installed in {target}"


class LightlyMoCo(torch.nn.Module):
    """MoCo v2 assembled from lightly's parts, as lightly's own MoCo example does."""

    def __init__(self, backbone: str, queue_size: int, temperature: float):
        super().__init__()
        import copy

        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        self.backbone = timm.create_model(backbone, pretrained=False, num_classes=0)
        self.projection_head = MoCoProjectionHead(self.backbone.num_features, 2048, 128)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.criterion = NTXentLoss(temperature=temperature, memory_bank_size=(queue_size, 128))

    def forward(self, x1, x2):
        q = self.projection_head(self.backbone(x1))  # (B, 128)
        with torch.no_grad():
            k = self.projection_head_momentum(self.backbone_momentum(x2))  # (B, 128)
        return self.criterion(q, k)  # negatives: the memory bank, which it updates with k

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)


def section_lightly(run: Run, record: dict, deadline: float):
    how = import_lightly(run, run.lightly_target, run.lightly_wheels, max(deadline - time.perf_counter() - 10, 5))
    if isinstance(how, tuple):
        return how[1]
    import lightly

    record["lightly"] = f"{getattr(lightly, '__version__', '?')} ({how})"
    s = run.s
    torch.manual_seed(0)
    ours = MoCoModel(MoCoConfig(backbone=s.backbone, image_size=s.image_size, queue_size=s.queue_size, key_bn_splits=1))
    ours.enqueue(F.normalize(torch.randn(s.queue_size, ours.config.projection_dim), dim=1))  # full, as lightly's bank
    m_ours = Method("ours (hf_contrast MoCoModel)", ours, ours.query_parameters(), None, run.device)

    def ours_step(x1, x2, y):
        out = ours(x1, x2)
        m_ours._keys = out.queue_keys
        return out.loss

    m_ours.step_fn = ours_step
    theirs = LightlyMoCo(s.backbone, s.queue_size, ours.config.temperature)
    params = [*theirs.backbone.parameters(), *theirs.projection_head.parameters()]
    m_theirs = Method("supervised", theirs, params, lambda x1, x2, y: theirs(x1, x2), run.device)  # the base
    b = min(s.lightly_batch, getattr(run, "batch", None) or s.lightly_batch)
    record["setup"] = (f"{s.backbone} at {s.image_size} px, batch {b}, queue {s.queue_size}, T=0.2, m=0.999, head "
                       "2048-ReLU-128, bf16 autocast, channels_last, SGD; ours with key_bn_splits=1 (lightly has no "
                       "split-BN); both steps: forward, backward, enqueue, SGD step, EMA. Each library's own numerics: "
                       "ours computes the (B, 1 + K) logits in fp32 with autocast off, lightly's loss in bf16")
    res = time_methods(run, [m_theirs, m_ours], b, deadline - 2)
    record["results"] = {"lightly": res["supervised"], "ours": res[m_ours.name]}
    record["ours_over_lightly"] = res[m_ours.name]["ratio_to_supervised"]


# ---------------------------------------------------------------- memory


def measure_step(model, step, inputs, opt, device: torch.device, base: int) -> int:
    """Peak bytes over one training step (after a warm-up step), everything the step holds included."""
    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), *state, *inputs])
        peak = resident + peak_memory_bytes(step, device)
    opt.zero_grad(set_to_none=True)
    return peak


def section_planner_memory(run: Run, record: dict, deadline: float):
    s, dev = run.s, run.device
    warnings.filterwarnings("ignore", message="Gradient caching with")
    record["setup"] = (f"fp32 (as the planner assumes), SGD momentum, {s.image_size} px; MoCo and plain SimCLR at "
                       f"batch {s.memory_batch}, cached SimCLR at {s.memory_cached[0]} in chunks of "
                       f"{s.memory_cached[1]}; measured: "
                       + ("max_memory_allocated" if dev.type == "cuda" else "CPU allocator events + resident"))
    rows = record.setdefault("results", [])
    for backbone in s.memory_backbones:
        probe = probe_activation_memory(backbone, s.image_size, device=dev)
        for method, batch, chunk in (("moco", s.memory_batch, None), ("simclr", s.memory_batch, None),
                                     ("simclr_cached", *s.memory_cached)):
            if time.perf_counter() > deadline - 3:
                rows.append(dict(backbone=backbone, method=method, status="skipped: budget spent"))
                continue
            free_memory()
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            torch.manual_seed(0)
            common = dict(backbone=backbone, image_size=s.image_size)
            if method == "moco":
                model = MoCoModel(MoCoConfig(queue_size=s.queue_size, **common)).to(dev)
                model.enqueue(F.normalize(torch.randn(s.queue_size, 128, device=dev), dim=1))
                params = model.query_parameters()
            else:
                model = SimCLRModel(SimCLRConfig(**common)).to(dev)
                params = list(model.parameters())
            model.train()
            opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)
            x1, x2 = torch.randn(2, batch, 3, s.image_size, s.image_size, device=dev)

            def step(model=model, x1=x1, x2=x2, method=method, chunk=chunk):
                if method == "simclr_cached":
                    grad_cache_step(model, x1, x2, chunk)
                else:
                    out = model(x1, x2)
                    out.loss.backward()
                    if out.queue_keys is not None:
                        model.enqueue(out.queue_keys, check_finite=False)

            measured = measure_step(model, step, (x1, x2), opt, dev, base)
            pred = planner.predict_step(probe, method, batch, chunk=chunk, queue_size=s.queue_size)
            rows.append(dict(backbone=backbone, method=method, batch=batch, chunk=chunk,
                             predicted_mib=round(pred.total_bytes / MIB, 1), measured_mib=round(measured / MIB, 1),
                             measured_over_predicted=round(measured / pred.total_bytes, 3)))
            run.log(f"  {backbone} {method}: predicted {pred.total_bytes / MIB:.0f} MiB, measured {measured / MIB:.0f} MiB")
            del model, opt, x1, x2, step


# ---------------------------------------------------------------- gradient caching


def section_grad_cache(run: Run, record: dict, deadline: float):
    s, dev = run.s, run.device
    warnings.filterwarnings("ignore", message="Gradient caching with")
    record["setup"] = (f"SimCLR {s.backbone} at {s.image_size} px, bf16 autocast, channels_last, SGD momentum; "
                       f"cached: batch {s.gc_large} in chunks of {s.gc_small}")
    results = record.setdefault("results", {})
    for name, batch, chunk in ((f"plain B={s.gc_small}", s.gc_small, None), (f"plain B={s.gc_large}", s.gc_large, None),
                               (f"cached B={s.gc_large} c={s.gc_small}", s.gc_large, s.gc_small)):
        if time.perf_counter() > deadline - 3:
            results[name] = dict(status="skipped: budget spent")
            continue
        free_memory()
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        torch.manual_seed(0)
        model = SimCLRModel(SimCLRConfig(backbone=s.backbone, image_size=s.image_size)).to(
            dev, memory_format=torch.channels_last).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        x = torch.randn(2, batch, 3, s.image_size, s.image_size, device=dev)
        x1, x2 = (v.contiguous(memory_format=torch.channels_last) for v in x)
        del x

        def step(model=model, x1=x1, x2=x2, chunk=chunk):
            if chunk:
                grad_cache_step(model, x1, x2, chunk, autocast=lambda: autocast(dev))
            else:
                with autocast(dev):
                    loss = model(x1, x2).loss
                loss.backward()

        try:
            peak = measure_step(model, step, (x1, x2), opt, dev, base)
            times = []
            for _ in range(3 if not s.smoke else 1):
                sync(dev)
                t = time.perf_counter()
                step()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(dev)
                times.append(time.perf_counter() - t)
            results[name] = dict(status="ok", negatives=2 * batch - 2, peak_mib=round(peak / MIB, 1),
                                 median_s=round(statistics.median(times), 4))
            run.log(f"  {name}: {peak / MIB:.0f} MiB, {statistics.median(times):.3f} s")
        except Exception as e:
            if not is_oom(e):
                raise
            results[name] = dict(status="out of memory")
            run.log(f"  {name}: out of memory")
        del model, opt, x1, x2, step
    small, large, cached = (results.get(k, {}) for k in results)
    if cached.get("status") == "ok" and small.get("status") == "ok":
        record["cached_memory_over_plain_small"] = round(cached["peak_mib"] / small["peak_mib"], 3)
        if large.get("status") == "ok":
            record["cached_time_over_plain_large"] = round(cached["median_s"] / large["median_s"], 3)
        else:  # plain large did not fit: per image against the small batch
            record["cached_time_per_image_over_plain_small"] = round(
                (cached["median_s"] / s.gc_large) / (small["median_s"] / s.gc_small), 3)


# ---------------------------------------------------------------- end to end


def section_e2e(run: Run, record: dict, deadline: float):
    import gpu_e2e

    s = gpu_e2e.E2ESettings.smoke_run() if run.s.smoke else gpu_e2e.E2ESettings(compile=("moco",))
    work = Path(tempfile.mkdtemp(prefix="hf_contrast_gpu_check_e2e_"))  # the corpus and the runs' outputs
    logs = Path(getattr(run, "out", None) or work) / "e2e_logs"
    try:
        report = gpu_e2e.run_e2e(s, work, deadline - 2, run.log, report=record, logs=logs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record["table"] = gpu_e2e.table(report)
    runs = [x for r in report["results"].values() for x in r.values() if isinstance(x, dict)]
    if not any("e2e_over_raw" in x for x in runs):  # each run's failure is in its row; all failed: the section did
        raise RuntimeError("no end-to-end run measured: " + "; ".join(
            f"{m} {k}: {x.get('reason', x.get('status'))}"[:400] for m, r in report["results"].items()
            for k, x in r.items() if isinstance(x, dict)))


# ---------------------------------------------------------------- report

SECTIONS = {
    "correctness": section_correctness,
    "throughput": section_throughput,
    "compile": section_compile,
    "lightly": section_lightly,
    "planner_memory": section_planner_memory,
    "grad_cache": section_grad_cache,
    "e2e": section_e2e,
}


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *["| " + " | ".join(str(c) for c in r) + " |" for r in rows]]


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['mode']})", "", f"{report['device']}; torch {report['torch']}, timm "
             f"{report['timm']}, hf_contrast {report['hf_contrast']}; {report['seconds']} s in all.", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name}: {sec['status']} ({sec.get('seconds', 0)} s)", ""]
        if "reason" in sec:
            lines += [f"Reason: {sec['reason']}", ""]
        if "setup" in sec:
            lines += [sec["setup"], ""]
        if name == "correctness":
            lines += _table(["check", "passed", "figures"], [
                [c, "yes" if r.get("passed") else "**NO**", ", ".join(f"{k}={v}" for k, v in r.items() if k != "passed")]
                for c, r in sec.get("checks", {}).items()])
        elif name in ("throughput", "compile", "lightly") and "results" in sec:
            rows = [[m, r.get("images_per_s", "-"), r.get("ratio_to_supervised", "-"), r.get("median_s", "-"),
                     r.get("status", "ok") + (f": {r['reason']}" if r.get("reason") else "")
                     + (f", first two steps (compiling) {r['first_two_steps_s']} s" if "first_two_steps_s" in r else "")]
                    for m, r in sec["results"].items()]
            base = "lightly's step" if name == "lightly" else "supervised"
            lines += _table(["step", "images/s", f"ratio to {base}", "median s", "status"], rows)
            for k in ("batch", "batch_search", "notes", "lightly", "ours_over_lightly"):
                if k in sec:
                    lines += ["", f"{k}: {sec[k]}"]
        elif name == "planner_memory" and "results" in sec:
            lines += _table(["backbone", "method", "batch (chunk)", "predicted MiB", "measured MiB", "measured / predicted"],
                            [[r["backbone"], r["method"], f"{r.get('batch', '-')}" + (f" ({r['chunk']})" if r.get("chunk")
                              else ""), r.get("predicted_mib", "-"), r.get("measured_mib", "-"),
                              r.get("measured_over_predicted", r.get("status", "-"))] for r in sec["results"]])
        elif name == "grad_cache" and "results" in sec:
            lines += _table(["step", "negatives", "peak MiB", "median s", "status"],
                            [[k, r.get("negatives", "-"), r.get("peak_mib", "-"), r.get("median_s", "-"), r["status"]]
                             for k, r in sec["results"].items()])
            lines += [""] + [f"{k}: {v}" for k, v in sec.items() if k.startswith("cached_")]
        elif name == "e2e" and "table" in sec:
            corpus = sec.get("corpus", {})
            lines += [f"Corpus: {corpus.get('images')} JPEGs in {corpus.get('shards')} shards, mean "
                      f"{corpus.get('mean_jpeg_kib')} KiB.", "", sec["table"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny timm models, small sizes: the same code in < 1 min")
    p.add_argument("--out", default=None, help="folder for report.md and report.json (default results/gpu, "
                   "--smoke: results/gpu/smoke)")
    p.add_argument("--budget_s", type=float, default=None,
                   help="time for all sections together (default 570 s, e2e up to 330 of them; --smoke: 260 s, about 80 s "
                   "used on idle cores)")
    p.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    p.add_argument("--lightly_target", default=None, help="folder lightly is installed into (default: in the temp folder)")
    p.add_argument("--lightly_wheels", default=None, help="install lightly offline from wheels in this folder")
    a = p.parse_args(argv)
    s = Settings.smoke_run() if a.smoke else Settings(smoke=False, device="cuda")
    if not a.smoke and not torch.cuda.is_available():
        p.error("no CUDA device: the full check needs one; --smoke runs the same code on CPU")
    if a.smoke:
        torch.set_num_threads(1)  # tiny models on shared cores
    run = Run(s, a.budget_s or (260.0 if a.smoke else 570.0))
    out = Path(a.out or ("results/gpu/smoke" if a.smoke else "results/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    run.out = out
    run.lightly_target = Path(a.lightly_target or Path(tempfile.gettempdir()) / "hf_contrast_gpu_check_lightly")
    run.lightly_wheels = a.lightly_wheels
    device = torch.cuda.get_device_name(0) if run.device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    run.log(f"GPU check ({'smoke' if s.smoke else 'full'}) on {device}")
    for name, fn in SECTIONS.items():
        if a.only and name not in a.only:
            run.sections[name] = dict(status="skipped", reason="not in --only")
            continue
        run.section(name, fn)
    report = dict(mode="smoke" if s.smoke else "full", device=device, torch=torch.__version__, timm=timm.__version__,
                  hf_contrast=hf_contrast.__version__, settings=asdict(s), seconds=round(run.elapsed(), 1),
                  sections=run.sections)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(markdown(report))
    run.log(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    checks = run.sections.get("correctness", {}).get("checks", {})
    return 0 if all(c.get("passed") for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
