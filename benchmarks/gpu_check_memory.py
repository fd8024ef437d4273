"""``benchmarks/gpu_check.py``'s memory sections: ``planner_memory`` (:mod:`hf_contrast.planner`'s predicted
bytes of one step against ``max_memory_allocated``) and ``grad_cache`` (cached SimCLR against plain SimCLR at
the chunk's batch, for memory, and at the full batch, for time)."""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from gpu_check_common import (
    MIB,
    Run,
    autocast,
    free_memory,
    is_oom,
    sync,
)

from hf_contrast import (
    MoCoConfig,
    MoCoModel,
    SimCLRConfig,
    SimCLRModel,
    grad_cache_step,
    peak_memory_bytes,
    planner,
    probe_activation_memory,
)


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
