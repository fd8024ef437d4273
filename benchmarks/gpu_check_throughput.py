"""``benchmarks/gpu_check.py``'s ``throughput`` and ``compile`` sections: images/s of a supervised step, MoCo v2,
SimCLR and MoCo v3 at the largest batch that fits all of them (doubling search), then the same with the
backbones compiled."""

from __future__ import annotations

import time

import timm
import torch
import torch.nn.functional as F
from gpu_check_common import (
    Method,
    Run,
    SectionTimeout,
    Settings,
    compile_encoders,
    free_memory,
    is_oom,
    sync,
    time_methods,
)

import hf_contrast
from hf_contrast import (
    MoCoConfig,
    MoCoModel,
    SimCLRConfig,
    SimCLRModel,
)


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
