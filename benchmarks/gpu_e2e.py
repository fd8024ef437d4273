#!/usr/bin/env python
"""The user's path end to end: images/s of ``training/pretrain.py`` on streamed JPEG shards, next to the
raw step of the same model, per method; ``e2e / raw`` says how much of the model's speed users get.

    python benchmarks/gpu_e2e.py                       # CUDA: resnet50 at 224 px, batch 256, bf16, <= 570 s
    python benchmarks/gpu_e2e.py --compile moco        # compile only MoCo v2 (a compiled pair: 2-4 min)

Runs go eager first (every method), then compiled; what does not fit ``--budget_s`` is reported skipped.
    python benchmarks/gpu_e2e.py --smoke               # CPU, tiny models, fp32: under a minute

1. A synthetic corpus of photo-like JPEGs (250-500 px, random sizes and aspect ratios, smooth gradients,
   soft shapes and sensor noise) is written as webdataset shards with :func:`hf_contrast.write_shards`
   (``gpu_e2e_corpus.py``).
2. ``training/pretrain.py --dataset_name webdataset --data_files ... --streaming`` runs as a subprocess, as
   a user runs it, for each method: device augmentation, bf16, channels_last (each flag passed only
   where pretrain.py has it), then compiled (``--torch_compile``) for the methods of ``--compile``.
3. Images/s come from the run's logs after the first logging window (start-up, compilation), over all
   later windows (epoch boundaries included). ``source`` in the report says how:
   ``log``: the Trainer's ``images_per_second`` keys in ``log_history`` (with ``data_wait_fraction``);
   ``log_arrival``: the steps between the logging steps over the times their log lines reached this
   process (pretrain.py does not log throughput yet); ``runtime``: ``train_runtime``, warm-up included.
4. The raw step (``gpu_e2e_raw.py``): the model pretrain.py builds from the same flags, synthetic inputs already on the
   device, same batch and precision, channels_last, timed with ``benchmarks/gpu_check_common.py``'s ``Method``
   and ``time_methods``; eager, and with the encoders compiled for the methods of ``--compile``.

Prints a table and writes a JSON report (``--output``). ``benchmarks/gpu_check.py`` runs it as its
``e2e`` section.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from gpu_e2e_corpus import photo_like_jpeg, write_corpus  # noqa: E402, F401 - photo_like_jpeg re-exported (tests)
from gpu_e2e_raw import METHODS, PRETRAIN, import_pretrain, time_raw  # noqa: E402


@dataclass
class E2ESettings:
    """Sizes of one end-to-end run: the H200 default (the issue's user path), or the CPU smoke run."""

    smoke: bool = False
    device: str = "cuda"
    backbones: dict = field(default_factory=lambda: dict(moco="resnet50", simclr="resnet50", mocov3="resnet50"))
    image_size: int = 224
    batch: int = 256
    images: int = 4096
    shards: int = 32
    workers: int = 12
    max_steps: int = 60
    logging_steps: int = 10
    queue_size: int = 65536  # moco; mocov3 keeps pretrain.py's default (no queue)
    methods: tuple[str, ...] = ("moco", "simclr", "mocov3")
    compile: tuple[str, ...] = ("moco", "simclr", "mocov3")
    compile_backend: str = "inductor"
    bf16: bool = True
    raw_repeats: int = 5
    extra_flags: tuple[str, ...] = ()  # smoke: a tiny head
    run_timeout_s: float = 240.0  # one pretrain.py run

    @classmethod
    def smoke_run(cls) -> E2ESettings:
        return cls(smoke=True, device="cpu", backbones=dict(moco="test_resnet", simclr="test_resnet", mocov3="test_vit"),
                   image_size=32, batch=8, images=64, shards=4, workers=0, max_steps=6, logging_steps=2,
                   queue_size=32, bf16=False, raw_repeats=2, run_timeout_s=90.0,
                   compile=("moco",), compile_backend="eager",  # the compiled path, traced, no inductor on CPU
                   extra_flags=("--projection_hidden_dim", "32", "--projection_dim", "16",
                                "--predictor_hidden_dim", "32"))


# ---------------------------------------------------------------- pretrain.py runs


def pretrain_options() -> dict[str, list | None]:
    """The flags ``pretrain.py --help`` lists (its argument parser, built in this process): name -> choices."""
    from transformers import HfArgumentParser

    p = import_pretrain()
    parser = HfArgumentParser((p.ModelArguments, p.DataArguments, p.ContrastiveTrainingArguments))
    return {opt[2:]: (list(a.choices) if a.choices else None)
            for a in parser._actions for opt in a.option_strings if opt.startswith("--")}


def _true(options: dict, name: str) -> list[str]:
    """``--name <true>`` in the spelling the flag accepts (a bool, an optional bool or auto/true/false)."""
    choices = options[name]
    value = next((c for c in choices if str(c).lower() == "true"), "true") if choices else "true"
    return [f"--{name}", str(value)]


def pretrain_command(s: E2ESettings, method: str, corpus: Path, out: Path, compiled: bool,
                     options: dict) -> tuple[list[str], dict]:
    """The pretrain.py command line of one run, and which of the asked-for features it has."""
    cmd = [sys.executable, str(PRETRAIN), "--method", method, "--backbone", s.backbones[method],
           "--image_size", str(s.image_size), "--dataset_name", "webdataset", "--data_files", str(corpus / "*.tar"),
           "--streaming", "--max_steps", str(s.max_steps), "--per_device_train_batch_size", str(s.batch),
           "--dataloader_num_workers", str(s.workers), "--logging_steps", str(s.logging_steps),
           "--output_dir", str(out), "--save_strategy", "steps", "--save_steps", str(s.max_steps),  # trainer_state.json
           "--report_to", "none", "--seed", "0", *s.extra_flags]
    if method == "moco":
        cmd += ["--queue_size", str(s.queue_size)]
    if s.device == "cpu":
        cmd += ["--use_cpu", "true"]
    features = {}
    for name, wanted in (("device_augmentation", True), ("channels_last", True), ("bf16", s.bf16),
                         ("torch_compile", compiled)):
        if not wanted:
            features[name] = False
        elif name in options:
            cmd += _true(options, name)
            features[name] = True
        else:
            features[name] = "not a pretrain.py flag"
    if compiled and "torch_compile_backend" in options:
        cmd += ["--torch_compile_backend", s.compile_backend]
    return cmd, features


def run_pretrain(cmd: list[str], log_path: Path, timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run one pretrain.py; its stdout lines with the times they reached this process (stdout and
    stderr also go to ``log_path``). The run has a process group of its own (its DataLoader workers
    included), killed whole on timeout or when this process is interrupted."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",  # log lines arrive when they are written: their times count
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    lines = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(ROOT),
                                start_new_session=True)
        watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        watchdog.start()
        try:
            for line in proc.stdout:
                lines.append((time.perf_counter(), line))
                log.write(line)
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            watchdog.cancel()
    if rc == -signal.SIGKILL:
        raise TimeoutError(f"pretrain.py ran past its {timeout:.0f} s (log: {log_path})")
    return rc, lines


def logged_dicts(lines: list[tuple[float, str]]) -> list[tuple[float, dict]]:
    """The Trainer's printed log dicts (``{'loss': '2.31', ...}``, floats as strings) with their arrival times."""
    out = []
    for t, line in lines:
        text = line.strip()
        if text.startswith("{") and text.endswith("}"):
            try:
                d = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                continue
            if isinstance(d, dict):
                out.append((t, d))
    return out


def _float(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def throughput(history: list[dict], printed: list[tuple[float, dict]], s: E2ESettings) -> dict:
    """Steady-state images/s of one run, after its first logging window; see the module docstring for
    ``source``. Every source this run has is in the result (``images_per_s_by_source``)."""
    windows = [h for h in history if "loss" in h and "step" in h]  # (B x steps) per window, in order
    logs = [(t, d) for t, d in printed if "loss" in d]
    if not windows:  # no trainer_state.json: the printed dicts, at steps L, 2L, ...
        windows = [dict({k: _float(v) for k, v in d.items()}, step=(i + 1) * s.logging_steps)
                   for i, (_, d) in enumerate(logs)]
    r: dict = {"windows": len(windows), "images_per_s_by_source": {}}
    by = r["images_per_s_by_source"]
    # after the first window: (steps in the window, its entry)
    later = [(h["step"] - prev["step"], h) for prev, h in zip(windows[:-1], windows[1:], strict=True)]
    if later and all(_float(h.get("images_per_second")) for _, h in later):
        images = sum(n for n, _ in later) * s.batch
        secs = [n * s.batch / _float(h["images_per_second"]) for n, h in later]  # each window's seconds
        by["log"] = images / sum(secs)
        if all(_float(h.get("images_per_second_per_process")) for _, h in later):
            r["images_per_s_per_process"] = images / sum(n * s.batch / _float(h["images_per_second_per_process"])
                                                         for n, h in later)
        if all(_float(h.get("data_wait_fraction")) is not None for _, h in later):  # weighted by window time
            r["data_wait_fraction"] = sum(
                _float(h["data_wait_fraction"]) * t for (_, h), t in zip(later, secs, strict=True)) / sum(secs)
    if logs:
        r["log_arrival_s"] = [round(t - logs[0][0], 3) for t, _ in logs]  # after the first logging step
    if len(logs) >= 2 and len(logs) == len(windows):
        dt = logs[-1][0] - logs[0][0]
        if dt > 0:
            by["log_arrival"] = (windows[-1]["step"] - windows[0]["step"]) * s.batch / dt
    runtime = next((_float(d["train_runtime"]) for _, d in printed if "train_runtime" in d), None)
    if runtime:
        steps = next((_float(d.get("step")) for _, d in printed if "train_runtime" in d), None) or s.max_steps
        by["runtime"] = steps * s.batch / runtime
    source = next((k for k in ("log", "log_arrival", "runtime") if k in by), None)
    if source is None:
        raise RuntimeError(f"no throughput in the run's logs: {len(windows)} logging windows, no train_runtime")
    r.update(images_per_s=round(by[source], 1), source=source)
    r["images_per_s_by_source"] = {k: round(v, 1) for k, v in by.items()}
    for k in ("images_per_s_per_process", "data_wait_fraction"):
        if k in r:
            r[k] = round(r[k], 4 if k == "data_wait_fraction" else 1)
    return r


def last_error(text: str) -> str:
    """The last ``SomethingError: message`` line of a log (else its last line)."""
    lines = [line.strip() for line in text.strip().splitlines()] or [""]
    return next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*", line)),
                lines[-1])[:500]


def e2e_run(s: E2ESettings, method: str, compiled: bool, corpus: Path, work: Path, logs: Path, options: dict,
            timeout: float) -> dict:
    """One pretrain.py run (output in ``work``, deleted after, its log in ``logs``) and the images/s
    read from its logs (``command``: its arguments)."""
    tag = f"{method}_{'compiled' if compiled else 'eager'}"
    out, log = work / tag, logs / f"{tag}.log"
    cmd, features = pretrain_command(s, method, corpus, out, compiled, options)
    shutil.rmtree(out, ignore_errors=True)  # an earlier run's trainer_state.json must not be read as this one's
    t = time.perf_counter()
    rc, lines = run_pretrain(cmd, log, timeout)
    record = dict(features=features, command=cmd[1:], seconds=round(time.perf_counter() - t, 1), log=str(log))
    state = out / f"checkpoint-{s.max_steps}" / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.is_file() else []
    record["log_history_from"] = "trainer_state.json" if history else "printed log lines"
    shutil.rmtree(out, ignore_errors=True)  # checkpoints and exports: hundreds of MB per run at full size
    try:
        record.update(throughput(history, logged_dicts(lines), s))
    except RuntimeError:
        if rc == 0:
            raise
    if rc != 0:  # after training (the export, say) the figures stand, and the failure is reported with them
        error = f"pretrain.py exited with {rc}: {last_error(log.read_text())}"
        if "images_per_s" not in record:
            raise RuntimeError(error)
        record["error"] = error
    return record


# ---------------------------------------------------------------- the run


def versions() -> dict:
    import datasets
    import timm
    import transformers

    import hf_contrast

    return dict(python=platform.python_version(), torch=torch.__version__, timm=timm.__version__,
                transformers=transformers.__version__, datasets=datasets.__version__,
                hf_contrast=hf_contrast.__version__, cuda=torch.version.cuda)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.processor() or 'cpu'}, " \
        f"{os.cpu_count()} cores)"


def run_e2e(s: E2ESettings, work: Path, deadline: float, log=print, report: dict | None = None,
            logs: Path | None = None) -> dict:
    """Corpus, then per method the eager e2e run and raw step, then the compiled ones, until ``deadline``
    (``time.perf_counter()``); fills ``report`` (returned) as it goes, so a cut-off run keeps its results.
    The corpus and the runs' outputs go to ``work``, pretrain.py's logs to ``logs`` (default: ``work``)."""
    report = {} if report is None else report
    logs = logs or work
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report.update(mode="smoke" if s.smoke else "full", date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), device=device_name(s.device), versions=versions(), settings=asdict(s))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus"
    report["corpus"] = write_corpus(corpus, s.images, s.shards, processes=1 if s.smoke else min(16, os.cpu_count() or 1))
    log(f"  corpus: {report['corpus']['images']} JPEGs in {report['corpus']['shards']} shards, mean "
        f"{report['corpus']['mean_jpeg_kib']} KiB, {report['corpus']['seconds']} s")
    options = pretrain_options()
    results = report.setdefault("results", {})
    plan = [(m, False) for m in s.methods] + [(m, True) for m in s.methods if m in s.compile]
    for method, compiled in plan:
        mode = "compiled" if compiled else "eager"
        row = results.setdefault(method, dict(name=METHODS[method], backbone=s.backbones[method])).setdefault(mode, {})
        left = deadline - time.perf_counter()
        if left < (20 if s.smoke else 60):
            row.update(status="skipped", reason=f"no time left ({left:.0f} s)")
            log(f"  {method} {mode}: skipped (no time left)")
            continue
        try:
            row["e2e"] = e2e_run(s, method, compiled, corpus, work, logs, options, min(s.run_timeout_s, left - 5))
            row["raw"] = time_raw(s, method, row["e2e"]["command"], compiled, deadline)
            row["e2e_over_raw"] = round(row["e2e"]["images_per_s"] / row["raw"]["images_per_s"], 3)
            row["status"] = "ok"
            if "error" in row["e2e"]:
                row.update(status="failed_after_training", reason=row["e2e"]["error"])
            log(f"  {method} {mode}: e2e {row['e2e']['images_per_s']} images/s ({row['e2e']['source']}), raw "
                f"{row['raw']['images_per_s']}, e2e / raw {row['e2e_over_raw']}")
        except Exception as e:  # noqa: BLE001 - one run's failure must not stop the others
            row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[-500:]}")
            log(f"  {method} {mode}: FAILED {row['reason'][:300]}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def table(report: dict) -> str:
    """The report's results as a markdown table."""
    rows = ["| method | run | e2e images/s | raw images/s | e2e / raw | data wait | source | status |",
            "|---|---|---|---|---|---|---|---|"]
    for r in report.get("results", {}).values():
        for mode in ("eager", "compiled"):
            if mode not in r:
                continue
            x = r[mode]
            e2e, raw = x.get("e2e", {}), x.get("raw", {})
            wait = e2e.get("data_wait_fraction")
            rows.append(f"| {r['name']} ({r['backbone']}) | {mode} | {e2e.get('images_per_s', '-')} | "
                        f"{raw.get('images_per_s', '-')} | {x.get('e2e_over_raw', '-')} | "
                        f"{'-' if wait is None else f'{wait:.1%}'} | {e2e.get('source', '-')} | "
                        f"{x.get('status', '-')}{': ' + x['reason'][:120] if 'reason' in x else ''} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, tiny corpus, fp32, MoCo v2 compiled "
                    "with the eager backend (dynamo traces, nothing is generated)")
    ap.add_argument("--output", default=None, help="the JSON report (default results/gpu/e2e.json; "
                    "--smoke: results/gpu/smoke/e2e.json)")
    ap.add_argument("--work_dir", default=None, help="corpus and run outputs (default: a new temporary folder, "
                    "deleted at the end); pretrain.py's logs go beside --output (e2e_logs/)")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    ap.add_argument("--compile", nargs="*", choices=list(METHODS), default=None,
                    help="methods also run compiled (default: all; --smoke: moco)")
    ap.add_argument("--max_steps", type=int, default=None)
    ap.add_argument("--budget_s", type=float, default=None,
                    help="time for the whole run (default 570; smoke 150, about 45 used on idle cores)")
    a = ap.parse_args(argv)
    s = E2ESettings.smoke_run() if a.smoke else E2ESettings()
    if not a.smoke and not torch.cuda.is_available():
        ap.error("no CUDA device: the full run needs one; --smoke runs the same code on CPU")
    s = dataclasses.replace(s, **{k: v for k, v in dict(
        methods=tuple(a.methods) if a.methods else None, max_steps=a.max_steps,
        compile=tuple(a.compile) if a.compile is not None else None).items() if v is not None})
    if a.smoke:
        torch.set_num_threads(1)  # tiny models on shared cores
    output = Path(a.output or ("results/gpu/smoke/e2e.json" if a.smoke else "results/gpu/e2e.json"))
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="hf_contrast_gpu_e2e_"))
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    say(f"end-to-end run ({'smoke' if s.smoke else 'full'}) on {device_name(s.device)}")
    try:
        report = run_e2e(s, work, t0 + (a.budget_s or (150.0 if a.smoke else 570.0)), say,
                         logs=output.parent / "e2e_logs")
    finally:
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    say(f"wrote {output}")
    return 0 if all(x.get("status") == "ok" for r in report["results"].values()
                    for m, x in r.items() if m in ("eager", "compiled")) else 1


if __name__ == "__main__":
    sys.exit(main())
