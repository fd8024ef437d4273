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
* ``planner_memory``: the planner's (``hf_contrast.planner``, ``training/plan.py``) predicted bytes against
  ``max_memory_allocated`` for MoCo, plain and cached SimCLR on two backbones (fp32, as the planner assumes).
* ``grad_cache``: cached SimCLR at batch 1024 (chunks of 64) against plain 64 (memory) and plain 1024 (time).
* ``e2e``: ``benchmarks/gpu_e2e.py``: the user's path (``training/pretrain.py`` on streamed JPEG shards, device
  augmentation, bf16, channels_last) per method against the same model's raw step; compiled for MoCo v2
  only here (``gpu_e2e.py`` alone compiles every method). pretrain.py's logs go to ``OUT/e2e_logs``.

The sections live beside this file: the harness (settings, time budgets, the timed step) in
``gpu_check_common.py``, then ``gpu_check_throughput.py`` (throughput, compile), ``gpu_check_lightly.py``,
``gpu_check_memory.py`` (planner memory, gradient caching) and ``gpu_check_correctness.py``; this file runs
them and writes the report.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import timm
import torch

import hf_contrast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check_correctness  # noqa: E402
from gpu_check_common import Run, Settings  # noqa: E402, F401 - Settings and Run: the harness, also for tests
from gpu_check_lightly import section_lightly  # noqa: E402
from gpu_check_memory import section_grad_cache, section_planner_memory  # noqa: E402
from gpu_check_throughput import section_compile, section_throughput  # noqa: E402

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


# ---------------------------------------------------------------- lightly


# ---------------------------------------------------------------- memory


# ---------------------------------------------------------------- gradient caching


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
