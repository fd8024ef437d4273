#!/usr/bin/env python
"""Fashion-MNIST through the user's path: pretrain, export, then judge the encoder on the test set.

Every pretraining run is ``training/pretrain.py`` (a subprocess, its log in the run folder) on the
local idx files (``apt-get install dataset-fashion-mnist``) with 5,000 training images held out as the
validation split: every choice of recipe is made on that split (``results/fashion_mnist/validation.json``),
and the 10,000 test images are scored once per final configuration. Each run's exported encoder is
loaded with plain ``transformers.AutoModel`` and its own image processor, and judged on frozen
features of all 60,000 training images: weighted kNN (k=200, t=0.1) and a linear probe (L-BFGS
logistic regression on standardised features) with 1%, 10% and 100% of the labels (class-balanced
subsets, the same for every row); then fine-tuned as ``AutoModelForImageClassification`` with the
stock ``Trainer`` on 1% and 10% of the labels, against the same architecture from random init.

Rows: raw pixels; random init (BatchNorm recalibrated); MoCo v2, SimCLR (seeds 0 1 2), MoCo v3; a
supervised resnet18 from scratch on all labels (the ceiling). Resumable: a run whose ``result.json``
exists is skipped, an interrupted pretraining resumes from its last checkpoint, and each result is
written as it finishes, so the benchmark can span sessions.

    python benchmarks/fashion_mnist.py                    # every row not yet finished
    python benchmarks/fashion_mnist.py --only moco_s0 raw_pixels
    python benchmarks/fashion_mnist.py --quick --output_dir /tmp/fm   # a 2,000-image subset, in about a minute
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

from finetune import ModelArguments as FinetuneModel  # noqa: E402
from finetune import finetune, timm_random_init_, with_processor  # noqa: E402
from linear_probe import extract, train_linear_probe  # noqa: E402
from seeds import balanced_subset, fraction_label, mean_std  # noqa: E402
from transformers import AutoModel, TrainingArguments  # noqa: E402

from hf_contrast import knn_top1, load_idx_dataset  # noqa: E402
from hf_contrast.data.idx_dataset import FASHION_MNIST_DIR  # noqa: E402
from hf_contrast.evaluation import recalibrate_batch_norm  # noqa: E402

FRACTIONS = (0.01, 0.1, 1.0)
FINETUNE_FRACTIONS = {0.01: 30, 0.1: 10}  # labels -> fine-tuning epochs (about 5,000 / 60,000 image-steps)
VALIDATION_SIZE = 5000
# The recipe chosen on the validation split (results/fashion_mnist/validation.json and README.md): MoCo v2's CIFAR
# augmentation at 48 px (5 epochs at 48 px beat 5 at 32 px, 0.818 against 0.801 val kNN) with crops 0.2-1
# and flips, T 0.2; each method trains for the epochs of the 55,000 images that fill about 30 minutes on
# 2 cores (EPOCHS). The kNN monitor runs every 3 epochs of 215 steps.
RECIPE = ["--image_size", "48", "--crop_min_scale", "0.2", "--horizontal_flip", "--temperature", "0.2",
          "--knn_every_n_steps", "645", "--save_steps", "500"]
METHODS = {"moco": ["--method", "moco", "--queue_size", "4096"],
           "simclr": ["--method", "simclr"],
           "mocov3": ["--method", "mocov3"]}
HEADLINE_SEEDS = {"moco": (0, 1, 2), "simclr": (0, 1, 2), "mocov3": (0,)}
# Equal time, not equal epochs: measured alone at batch 256, MoCo (queue 4,096) trains ~290 images/s and
# SimCLR ~200 (results/fashion_mnist/runs), so 9 and 6 epochs take 29-31 and 28 minutes; a MoCo v3 step
# costs about twice a MoCo v2 one (docs/mocov3.md: both encoders see both views), ~145 images/s, so it gets 5.
EPOCHS = {"moco": 9, "simclr": 6, "mocov3": 5}
# The ceiling gets the pretraining rows' ~30 minutes: a 10%-label fine-tune (6,000 images x 10 epochs) took
# 2.3-2.6 min, so 60,000 images x 12 epochs is about 30.
SUPERVISED_EPOCHS = 12
QUICK = dict(train=2000, test=1000, pretrain=["--max_train_samples", "2000", "--backbone", "test_resnet", "--projection_hidden_dim", "64",
                                              "--num_train_epochs", "3", "--per_device_train_batch_size", "64",
                                              "--queue_size", "512", "--knn_every_n_steps", "0",
                                              "--dataloader_num_workers", "0", "--save_strategy", "no"],
             finetune_epochs=2, supervised_epochs=1)


def pretrain_runs(quick: bool) -> dict[str, list[str]]:
    """``{name: pretrain.py flags}`` of every pretraining row, in the order they run."""
    if quick:
        return {"moco_s0": [*METHODS["moco"], *QUICK["pretrain"], "--seed", "0"]}
    order = [("moco", 0), ("simclr", 0), ("mocov3", 0), ("moco", 1), ("simclr", 1), ("moco", 2), ("simclr", 2)]
    return {f"{m}_s{s}": [*RECIPE, "--num_train_epochs", str(EPOCHS[m]), *METHODS[m], "--seed", str(s)]
            for m, s in order if s in HEADLINE_SEEDS[m]}


def run_pretrain(name: str, flags: list[str], args) -> dict:
    """``training/pretrain.py`` with ``flags`` in ``OUTPUT_DIR/runs/NAME`` (resumed from its last checkpoint
    when an earlier call was interrupted); returns its results.json with the wall time."""
    folder = Path(args.output_dir) / "runs" / name
    done = folder / "results.json"
    if not done.exists():
        resume = ["--resume_from_checkpoint", "last"] if any(folder.glob("checkpoint-*")) else []
        overwrite = ["--overwrite_output_dir"] if folder.exists() and not resume else []
        argv = [sys.executable, str(ROOT / "training" / "pretrain.py"), "--idx_dir", args.idx_dir,
                "--validation_size", str(args.validation_size), "--output_dir", str(folder), "--disable_tqdm", "true",
                *flags, *resume, *overwrite]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flags.txt").write_text(" ".join(flags) + "\n")
        print(f"[{name}] {' '.join(argv[1:])}", flush=True)
        segments = wall_segments(folder)
        segments.append(dict(start=time.time(), seconds=None))
        (folder / "wall_segments.json").write_text(json.dumps(segments) + "\n")
        start = time.perf_counter()
        with open(folder / "train.log", "a") as log:
            subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT)
        segments[-1]["seconds"] = time.perf_counter() - start
        (folder / "wall_segments.json").write_text(json.dumps(segments) + "\n")
        (folder / "wall_seconds.txt").write_text(f"{sum(s['seconds'] for s in segments):.1f}\n")
    results = json.loads(done.read_text())
    wall = folder / "wall_seconds.txt"
    results["pretrain_minutes"] = float(wall.read_text()) / 60 if wall.exists() else None
    history = folder / "log_history.json"
    results["log_history"] = json.loads(history.read_text()) if history.exists() else []
    return results


def wall_segments(folder: Path) -> list[dict]:
    """The pretraining calls of a run that spanned sessions: ``[{start, seconds}]``. A call that was killed
    (no ``seconds``) counts until its newest checkpoint: the steps after it are trained again by the next call."""
    path = folder / "wall_segments.json"
    segments = json.loads(path.read_text()) if path.exists() else []
    for segment in segments:
        if segment["seconds"] is None:
            saved = [c.stat().st_mtime for c in folder.glob("checkpoint-*") if c.stat().st_mtime >= segment["start"]]
            segment["seconds"] = max(saved, default=segment["start"]) - segment["start"]
    return segments


class Data:
    """All labelled images of the benchmark, loaded once: the train split (every label fraction draws from
    it) and the test split, with class-balanced subsets of the training labels."""

    def __init__(self, args, validation: bool = False):
        if validation:  # pretrain.py's own split: its 55,000 training images and the 5,000 held out
            from pretrain import DataArguments, load_splits

            self.train, self.test, _ = load_splits(DataArguments(idx_dir=args.idx_dir,
                                                                 validation_size=args.validation_size))
        else:
            splits = load_idx_dataset(args.idx_dir)
            self.train, self.test = splits["train"], splits["test"]
        if args.quick:
            self.train = self.train.select(range(min(QUICK["train"], len(self.train))))
            self.test = self.test.select(range(min(QUICK["test"], len(self.test))))
        self.label_names = self.train.features["label"].names
        self.train_y = torch.as_tensor(self.train["label"])  # (N,)
        self.test_y = torch.as_tensor(self.test["label"])  # (M,)
        self.subsets = {f: balanced_subset(self.train_y, f, seed=0) for f in FRACTIONS}

    def pixels(self, split) -> torch.Tensor:
        """Raw pixels ``(N, 784)`` in [0, 1]."""
        return torch.as_tensor(np.stack([np.asarray(im) for im in split["image"]]).reshape(len(split), -1)) / 255.0


def frozen_scores(train_x, test_x, data: Data) -> dict[str, dict[str, float]]:
    """``{"knn": {labels: top-1}, "probe": {labels: top-1}}`` of features ``(N, F)`` / ``(M, F)``."""
    scores = {"knn": {}, "probe": {}}
    for fraction, idx in data.subsets.items():
        label = fraction_label(fraction)
        scores["knn"][label] = knn_top1(train_x[idx], data.train_y[idx], test_x, data.test_y, k=200, temperature=0.1)
        scores["probe"][label] = train_linear_probe(train_x[idx], data.train_y[idx], test_x, data.test_y,
                                                    len(data.label_names))["accuracy"]
    return scores


def encoder_features(export: str, data: Data, random_init: bool = False):
    """Pooled features of both splits from the export, loaded with ``AutoModel`` and its own processor
    (``random_init``: the same architecture at timm's random init, BatchNorm recalibrated)."""
    from hf_contrast.hub.export import load_image_processor

    processor = load_image_processor(export)
    model = AutoModel.from_pretrained(export)
    train = with_processor(data.train, processor, "image", "label")
    if random_init:
        timm_random_init_(model, seed=0)
        recalibrate_batch_norm(model.timm_model, train, max_batches=16)
    return extract(model, train, 256)[0], extract(model, with_processor(data.test, processor, "image", "label"), 256)[0]


def finetune_scores(export: str, data: Data, folder: Path, args, random_init: bool = False,
                    fractions=FINETUNE_FRACTIONS) -> dict[str, float]:
    """Test accuracy of ``AutoModelForImageClassification`` from ``export`` (or its architecture at random
    init) fine-tuned with the stock Trainer on each share of the labels (``{fraction: epochs}``)."""
    scores = {}
    for fraction, epochs in fractions.items():
        train = data.train.select(data.subsets[fraction].tolist()) if fraction < 1 else data.train
        training_args = TrainingArguments(
            output_dir=str(folder / f"finetune_{fraction_label(fraction)}"), num_train_epochs=
            QUICK["finetune_epochs"] if args.quick else epochs, per_device_train_batch_size=128,
            per_device_eval_batch_size=256, learning_rate=1e-3, weight_decay=0.05, lr_scheduler_type="cosine",
            warmup_steps=0.1, logging_steps=10, eval_strategy="no", save_strategy="no", report_to="none",
            remove_unused_columns=False, dataloader_num_workers=0, seed=0, use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True)
        start = time.perf_counter()
        splits = (train, data.test, data.label_names, "image", "Fashion-MNIST")
        scores[fraction_label(fraction)] = finetune(FinetuneModel(model_name_or_path=export), splits, "label",
                                                    training_args, random_init=random_init)
        scores[f"{fraction_label(fraction)}_minutes"] = (time.perf_counter() - start) / 60
        shutil.rmtree(training_args.output_dir, ignore_errors=True)  # weights: not kept
    return scores


def save(result: dict, name: str, args) -> None:
    folder = Path(args.results_dir) / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[{name}] " + json.dumps({k: v for k, v in result.items() if k in ("knn", "probe", "finetune")}), flush=True)


def load(name: str, args) -> dict | None:
    path = Path(args.results_dir) / "runs" / name / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def pretrained_row(name: str, flags: list[str], data: Data, args) -> dict:
    """Pretrain (or reuse), then kNN / probe / fine-tuning of the export; copies the card and curves."""
    results = run_pretrain(name, flags, args)
    export = str(Path(args.output_dir) / "runs" / name / "encoder")
    train_x, test_x = encoder_features(export, data)
    result = dict(name=name, pretrain_flags=flags, **frozen_scores(train_x, test_x, data),
                  finetune=finetune_scores(export, data, Path(args.output_dir) / "runs" / name, args),
                  validation_knn=results.get("knn_pretrained"), pretrain_minutes=results["pretrain_minutes"],
                  images_per_second=results.get("images_per_second"),
                  epochs=next((h["epoch"] for h in reversed(results["log_history"]) if "epoch" in h), None),
                  validation_curve=[(h["step"], h["knn_top1"]) for h in results["log_history"] if "knn_top1" in h],
                  train_runtime=next((h["train_runtime"] for h in results["log_history"] if "train_runtime" in h), None))
    for file in ("README.md", "training_curves.png"):
        if (Path(export) / file).exists():
            dest = Path(args.results_dir) / "runs" / name / ("model_card.md" if file == "README.md" else file)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(Path(export) / file, dest)
    return result


def baseline_rows(data: Data, args, export: str) -> dict[str, callable]:
    """The rows that need no pretraining: ``{name: compute}``; ``export`` gives the architecture."""
    def raw():
        return dict(name="raw_pixels", **frozen_scores(data.pixels(data.train), data.pixels(data.test), data))

    def random_init():
        train_x, test_x = encoder_features(export, data, random_init=True)
        return dict(name="random_init", **frozen_scores(train_x, test_x, data),
                    finetune=finetune_scores(export, data, Path(args.output_dir) / "runs" / "random_init", args,
                                             random_init=True))

    def supervised():
        epochs = QUICK["supervised_epochs"] if args.quick else SUPERVISED_EPOCHS
        scores = finetune_scores(export, data, Path(args.output_dir) / "runs" / "supervised", args, random_init=True,
                                 fractions={1.0: epochs})
        return dict(name="supervised", epochs=epochs, accuracy=scores["100%"], minutes=scores["100%_minutes"])

    return {"raw_pixels": raw, "random_init": random_init, "supervised": supervised}


def summarize(args) -> dict:
    """Mean ± sample std over seeds of every finished row; written as summary.json and summary.md."""
    rows = {}
    for path in sorted((Path(args.results_dir) / "runs").glob("*/result.json")):
        result = json.loads(path.read_text())
        rows.setdefault(result["name"].rsplit("_s", 1)[0] if "_s" in result["name"] else result["name"], []).append(result)
    table = {}
    for group, results in rows.items():
        cells = {}
        for metric in ("knn", "probe", "finetune"):
            for label in map(fraction_label, FRACTIONS):
                values = [r[metric][label] for r in results if label in r.get(metric, {})]
                if values:
                    cells[f"{metric} {label}"] = (*mean_std(values), len(values))
        for key in ("accuracy", "pretrain_minutes", "validation_knn", "images_per_second", "epochs"):
            values = [r[key] for r in results if r.get(key) is not None]
            if values:
                cells[key] = (*mean_std(values), len(values))
        table[group] = cells
    summary = {"rows": table, "note": "(mean, sample std, runs) per cell; test top-1 on the 10,000 test images"}
    (Path(args.results_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    columns = [f"{m} {fraction_label(f)}" for m in ("knn", "probe") for f in FRACTIONS] + [
        f"finetune {fraction_label(f)}" for f in FINETUNE_FRACTIONS]
    lines = ["| row | " + " | ".join(columns) + " | minutes |", "|---" * (len(columns) + 2) + "|"]
    for group, cells in table.items():
        fmt = lambda c: "" if c is None else (f"{c[0]:.3f}" if c[2] == 1 else f"{c[0]:.3f} ± {c[1]:.3f}")  # noqa: E731
        minutes = cells.get("pretrain_minutes")
        lines.append(f"| {group} | " + " | ".join(fmt(cells.get(c)) for c in columns)
                     + f" | {'' if minutes is None else f'{minutes[0]:.0f}'} |")
        if "accuracy" in cells:
            lines[-1] = lines[-1].replace(f"| {group} |", f"| {group} (test accuracy {cells['accuracy'][0]:.3f}) |")
    (Path(args.results_dir) / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


def validate(names: list[str], args) -> dict:
    """Validation scores (kNN and probe, 1% and 100% of the labels, on the 5,000 held-out training images
    with the other 55,000 as the labelled pool) of finished runs in OUTPUT_DIR/val/NAME or OUTPUT_DIR/runs/NAME:
    the numbers every recipe choice is made on. Appended to RESULTS_DIR/validation.json; the test set is not read."""
    data = Data(args, validation=True)
    path = Path(args.results_dir) / "validation.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    for name in names:
        if name == "raw_pixels":
            table[name] = frozen_scores(data.pixels(data.train), data.pixels(data.test), data)
            print(f"[validate raw_pixels] {json.dumps(table[name])}", flush=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=2) + "\n")
            continue
        folder = next((f for f in (Path(args.output_dir) / "val" / name, Path(args.output_dir) / "runs" / name)
                       if (f / "encoder").exists()), None)
        if folder is None:
            raise SystemExit(f"--validate {name}: no OUTPUT_DIR/val/{name}/encoder or OUTPUT_DIR/runs/{name}/encoder")
        train_x, test_x = encoder_features(str(folder / "encoder"), data)
        results = json.loads((folder / "results.json").read_text())
        history = json.loads((folder / "log_history.json").read_text()) if (folder / "log_history.json").exists() else []
        table[name] = dict(**frozen_scores(train_x, test_x, data), flags=(folder / "flags.txt").read_text().split()
                           if (folder / "flags.txt").exists() else None, images_per_second=results.get("images_per_second"),
                           train_runtime=next((h["train_runtime"] for h in history if "train_runtime" in h), None))
        print(f"[validate {name}] " + json.dumps({k: table[name][k] for k in ("knn", "probe")}), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=2) + "\n")
    return table


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--idx_dir", default=FASHION_MNIST_DIR, help="The four Fashion-MNIST idx files.")
    parser.add_argument("--output_dir", default=str(ROOT / "outputs" / "fashion_mnist"),
                        help="Pretraining runs (checkpoints, weights, logs).")
    parser.add_argument("--results_dir", default=None, help="Per-run JSON, cards, curves and the summary; default: "
                        "results/fashion_mnist (--quick: OUTPUT_DIR/results).")
    parser.add_argument("--only", nargs="+", default=None, help="Run only these rows (e.g. moco_s0 raw_pixels).")
    parser.add_argument("--validate", nargs="+", default=None, metavar="NAME",
                        help="Score finished runs (OUTPUT_DIR/val/NAME or OUTPUT_DIR/runs/NAME) on the validation split "
                        "only, for recipe choices; nothing else runs.")
    parser.add_argument("--quick", action="store_true", help=f"A {QUICK['train']}-image subset with a tiny backbone "
                        "(the CI test).")
    args = parser.parse_args(argv)
    args.validation_size = 500 if args.quick else VALIDATION_SIZE
    if args.results_dir is None:
        args.results_dir = str(Path(args.output_dir) / "results") if args.quick else str(ROOT / "results" / "fashion_mnist")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.validate:
        return validate(args.validate, args)
    data = Data(args)
    runs = pretrain_runs(args.quick)
    names = [*runs, "raw_pixels", "random_init", "supervised"]
    for name in args.only or names:
        if name not in names:
            raise SystemExit(f"--only {name}: not a row; the rows are {', '.join(names)}")
    for name in args.only or names:
        if load(name, args) is not None:
            print(f"[{name}] finished earlier: {Path(args.results_dir) / 'runs' / name / 'result.json'}")
            continue
        if name in runs:
            save(pretrained_row(name, runs[name], data, args), name, args)
        else:  # the baselines take the architecture of the first exported encoder
            exports = [p for n in runs if (p := Path(args.output_dir) / "runs" / n / "encoder").exists()]
            if not exports and name != "raw_pixels":
                raise SystemExit(f"{name} needs the architecture of an exported encoder: run a pretraining row first")
            save(baseline_rows(data, args, str(exports[0]) if exports else "")[name](), name, args)
    return summarize(args)


if __name__ == "__main__":
    main()
