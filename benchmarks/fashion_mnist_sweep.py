#!/usr/bin/env python
"""Queue or batch? MoCo's queue sizes against SimCLR's batch sizes on Fashion-MNIST, at equal wall-clock time.

Each configuration first runs a short throughput probe (``training/pretrain.py --max_steps 25``, no
evaluation), then pretrains for the number of steps that fills ``--minutes`` at that measured speed
(the cosine schedule spans exactly the run), with the kNN monitor on the 5,000-image validation split
(the test set is not read). ``results/fashion_mnist/sweep/NAME.json`` holds each run's curve (validation
kNN against seconds of training alone, the kNN monitor's time left out: ``training_curve``), its final Precise-BN kNN, the narrow-corpus
warnings it printed and the planner's prediction for this machine (``training/plan.py``);
``queue_or_batch.png`` plots them. Resumable: a finished configuration is skipped.

    python benchmarks/fashion_mnist_sweep.py --minutes 10
    python benchmarks/fashion_mnist_sweep.py --only queue_65536 simclr_batch_512
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fashion_mnist import RECIPE, VALIDATION_SIZE  # noqa: E402

from hf_contrast.data.idx_dataset import FASHION_MNIST_DIR  # noqa: E402

QUEUES = (256, 1024, 4096, 16384, 65536)
BATCHES = (128, 256, 512)
BASE_LR = 0.06  # per 256 images (the script's default), scaled linearly with SimCLR's batch
# the recipe of the headline rows without its length and monitoring, which the budget sets
SWEEP_RECIPE = [f for i, f in enumerate(RECIPE) if f not in ("--num_train_epochs", "--knn_every_n_steps", "--save_steps")
                and RECIPE[i - 1] not in ("--num_train_epochs", "--knn_every_n_steps", "--save_steps")]


def configurations() -> dict[str, list[str]]:
    configs = {f"queue_{k}": ["--method", "moco", "--queue_size", str(k)] for k in QUEUES}
    for b in BATCHES:
        configs[f"simclr_batch_{b}"] = ["--method", "simclr", "--per_device_train_batch_size", str(b),
                                        "--learning_rate", f"{BASE_LR * b / 256:g}"]
    return configs


def batch_of(flags: list[str]) -> int:
    return int(flags[flags.index("--per_device_train_batch_size") + 1]) if "--per_device_train_batch_size" in flags else 256


def pretrain(folder: Path, flags: list[str], args, extra: list[str]) -> dict:
    argv = [sys.executable, str(ROOT / "training" / "pretrain.py"), "--idx_dir", args.idx_dir, "--validation_size",
            str(VALIDATION_SIZE), "--output_dir", str(folder), "--overwrite_output_dir", "--disable_tqdm", "true",
            "--save_strategy", "no", *SWEEP_RECIPE, *flags, *extra]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.log", "w") as log:
        subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
    return json.loads((folder / "results.json").read_text())


def training_seconds(history: list[dict], batch: int) -> float:
    """Seconds one step of training takes, without the kNN monitor: ``batch`` over the median images/s of the
    logging windows (a window that holds a kNN evaluation runs at a fifth of the rate; the median ignores it)."""
    rates = sorted(h["images_per_second"] for h in history if "images_per_second" in h)
    return batch / rates[len(rates) // 2]


def with_training_curve(record: dict, history: list[dict]) -> dict:
    """``record`` with ``seconds_per_step`` and ``training_curve``: validation kNN against seconds of training
    alone (``curve`` spreads the kNN monitor's own time over the steps, about 45 s per evaluation here)."""
    per_step = training_seconds(history, record["batch"])
    steps_at = [h["step"] for h in history if "knn_top1" in h]
    return dict(record, seconds_per_step=per_step,
                training_curve=[(step * per_step, knn) for step, (_, knn) in zip(steps_at, record["curve"], strict=True)])


def run(name: str, flags: list[str], args) -> dict:
    """Probe the speed, then pretrain for ``--minutes``; returns the sweep record."""
    folder = Path(args.output_dir) / "sweep" / name
    probe = pretrain(folder / "probe", flags, args, ["--max_steps", "25", "--logging_steps", "5",
                                                     "--precise_bn_batches", "0", "--label_column", "no_labels"])
    images_per_second = probe["images_per_second"]
    steps = max(10, int(args.minutes * 60 * images_per_second / batch_of(flags)))
    results = pretrain(folder, flags, args, ["--max_steps", str(steps), "--knn_every_n_steps", str(math.ceil(steps / 6))])
    history = json.loads((folder / "log_history.json").read_text())
    runtime = next(h["train_runtime"] for h in history if "train_runtime" in h)
    log = (folder / "train.log").read_text().splitlines()
    record = dict(name=name, flags=flags, budget_minutes=args.minutes, probe_images_per_second=images_per_second,
                steps=steps, batch=batch_of(flags), train_runtime=runtime,
                images_per_second=results.get("images_per_second"),
                num_negatives=next((h["num_negatives"] for h in reversed(history) if "num_negatives" in h), None),
                curve=[(h["step"] * runtime / steps, h["knn_top1"]) for h in history if "knn_top1" in h],
                final_knn=results.get("knn_pretrained"), raw_pixels_knn=results.get("knn_raw_pixels"),
                warnings=[line.split("WARNING ", 1)[1] for line in log if " WARNING hf_contrast" in line])
    return with_training_curve(record, history)


def plan_prediction() -> str:
    """What ``training/plan.py`` says for this machine (one 24 GB CPU, 55,000 images, 10 classes)."""
    argv = [sys.executable, str(ROOT / "training" / "plan.py"), "--backbone", "resnet18", "--image_size", "48",
            "--device_memory_gb", "24", "--num_devices", "1", "--target_negatives", "65536", "--moco_batch_size",
            "256", "--dataset_size", "55000", "--num_classes", "10"]
    return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in records:
        seconds, knn = zip(*r["training_curve"], strict=True) if r["training_curve"] else ((), ())
        style = "-" if r["name"].startswith("queue") else "--"
        ax.plot([s / 60 for s in seconds], knn, style, marker="o", label=f"{r['name']} ({r['num_negatives']:.0f} neg.)")
    raw = next((r["raw_pixels_knn"] for r in records if r.get("raw_pixels_knn")), None)
    if raw:
        ax.axhline(raw, color="grey", lw=0.8, label=f"raw pixels after normalisation {raw:.3f}")
    ax.set_xlabel("minutes of training (2 CPU cores)")
    ax.set_ylabel("validation kNN top-1 (k=200, t=0.1)")
    ax.set_title("Fashion-MNIST: MoCo queue vs SimCLR batch at equal time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--idx_dir", default=FASHION_MNIST_DIR, help="The four Fashion-MNIST idx files.")
    parser.add_argument("--minutes", type=float, default=10.0, help="Training time of every configuration.")
    parser.add_argument("--output_dir", default=str(ROOT / "outputs" / "fashion_mnist"), help="Runs (weights, logs).")
    parser.add_argument("--results_dir", default=str(ROOT / "results" / "fashion_mnist"), help="sweep/*.json, the plot.")
    parser.add_argument("--only", nargs="+", default=None, help="Run only these configurations.")
    args = parser.parse_args(argv)
    configs = configurations()
    unknown = sorted(set(args.only or ()) - set(configs))
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: not a configuration; they are {', '.join(configs)}")
    out = Path(args.results_dir) / "sweep"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "plan.txt").exists():
        (out / "plan.txt").write_text(plan_prediction())
    for name in args.only or configs:
        if (out / f"{name}.json").exists():
            print(f"[{name}] finished earlier")
            continue
        record = run(name, configs[name], args)
        (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"[{name}] {record['steps']} steps in {record['train_runtime'] / 60:.1f} min, validation kNN "
              f"{record['final_knn']:.4f}", flush=True)
    records = []
    for name in (n for n in configs if (out / f"{n}.json").exists()):
        record = json.loads((out / f"{name}.json").read_text())
        history = Path(args.output_dir) / "sweep" / name / "log_history.json"
        if "training_curve" not in record and history.exists():  # written before the field existed
            record = with_training_curve(record, json.loads(history.read_text()))
            (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        records.append(record)
    if records:
        plot(records, Path(args.results_dir) / "queue_or_batch.png")
    return records


if __name__ == "__main__":
    main()
