#!/usr/bin/env python
"""The pretraining job over several seeds, judged the way self-supervised encoders are judged.

For each seed S, ``training/pretrain.py`` runs with ``--seed S --output_dir OUTPUT_DIR/seed_S`` (plus
every other flag given here, passed through: with none, the default job). Then three encoders are
evaluated on frozen features of the held-out split: the run's final encoder, the same architecture at
random init (drawn with S, BatchNorm recalibrated, as pretrain.py's kNN report) and raw pixels. Each
gets the weighted kNN top-1 (pretrain.py's ``--knn_k``, t=0.1) and a linear probe (linear_probe.py's
L-BFGS logistic regression on standardised features) with 1%, 10% and 100% of the training labels:
class-balanced subsets drawn with ``--subset_seed``, the same for every seed and encoder.

``OUTPUT_DIR/summary.json`` and ``OUTPUT_DIR/summary.md`` hold the mean, the sample standard
deviation (n - 1) and each seed's value per row, and the wall time of each run; the table is printed.
Each seed's folder keeps pretrain.py's outputs, its ``results.json`` extended with these scores.

    python training/seeds.py                                   # the default job, seeds 0 1 2
    python training/seeds.py --seeds 0 1 --num_train_epochs 10 # any pretrain.py flag passes through
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import pretrain
import torch
from linear_probe import train_linear_probe
from transformers import AutoModel

from hf_contrast import eval_dataset, extract_features, knn_top1
from hf_contrast.cli import make_parser, run_main
from hf_contrast.evaluation import recalibrate_batch_norm

logger = logging.getLogger("seeds")

ENCODERS = {"pretrained": "pretrained", "random_init": "random init", "raw_pixels": "raw pixels"}
METRICS = {"knn": "kNN top-1", "probe": "linear probe"}
NOT_PASSED_THROUGH = {"seed": "--seeds", "streaming": None}  # pretrain.py flags this script sets or cannot use


@dataclass
class SeedsArguments:
    """The seeds, where the runs go and how they are evaluated; every other flag goes to pretrain.py."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "One pretraining run per seed."})
    output_dir: str = field(default="outputs/pretrain_seeds", metadata={
        "help": "The summary goes here, each run to OUTPUT_DIR/seed_S."})
    label_fractions: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0], metadata={
        "help": "Shares of the training labels the kNN and the probe use (class-balanced below 1)."})
    subset_seed: int = field(default=0, metadata={"help": "Seed of the labelled subsets (the same for every run)."})
    probe_max_iter: int = field(default=300, metadata={"help": "L-BFGS iterations of the linear probe."})
    probe_l2: float = field(default=1e-4, metadata={"help": "Weight penalty of the linear probe."})
    reuse_runs: bool = field(default=False, metadata={
        "help": "Seeds whose OUTPUT_DIR/seed_S already holds a finished run (final/ and results.json) are "
                "evaluated again, not retrained: finish an interrupted job, or change only the evaluation."})


def balanced_subset(labels: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """Sorted indices of a class-balanced share of ``labels`` ``(N,)``: ``round(fraction * N / C)``
    examples (at least one) of each of the C classes present, drawn at random with ``seed``;
    ``fraction == 1`` gives all ``N`` indices.

    Raises:
        ValueError: ``fraction`` outside (0, 1], or a class with fewer examples than the subset takes.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"label fraction {fraction} must be in (0, 1]")
    n = labels.shape[0]
    if fraction == 1:
        return torch.arange(n)
    classes, counts = labels.unique(return_counts=True)  # (C,), (C,)
    per_class = max(1, round(fraction * n / len(classes)))
    if int(counts.min()) < per_class:
        raise ValueError(f"{fraction:.0%} of {n} labels over {len(classes)} classes takes {per_class} per class, but "
                         f"class {int(classes[counts.argmin()])} has only {int(counts.min())}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # (N,)
    by_class = torch.sort(labels[perm], stable=True)  # grouped by class, random order within each
    start = torch.searchsorted(by_class.values, by_class.values)  # (N,) where each one's class starts
    rank = torch.arange(n) - start  # (N,) position within its class
    return perm[by_class.indices][rank < per_class].sort().values


def fraction_label(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def parse(argv: list[str] | None):
    """``(SeedsArguments, the flags passed to pretrain.py)``; every run's flags are checked before any run."""
    parser = make_parser((SeedsArguments,))
    parser.description = __doc__.split("\n\n")[0]
    parser.epilog = "Every other flag goes to training/pretrain.py (see python training/pretrain.py --help)."
    args, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    given = pretrain.explicit_flags(rest)
    for flag, instead in NOT_PASSED_THROUGH.items():
        if flag in given:
            raise ValueError(f"--{flag} is not a flag of seeds.py" + (f": use {instead}" if instead else
                             " (it evaluates every run on an in-memory labelled split)"))
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds {' '.join(map(str, args.seeds))}: give one or more distinct seeds")
    for fraction in args.label_fractions:
        if not 0 < fraction <= 1:
            raise ValueError(f"--label_fractions: {fraction} must be in (0, 1]")
    for seed in args.seeds:  # unknown flags, bad values and used output folders stop here, before any run
        if args.reuse_runs and finished(args, seed):
            continue
        _, _, run_args, training_args = pretrain.build_parser().parse_args_into_dataclasses(args=run_argv(rest, args, seed))
        resume = pretrain.resume_target(training_args.resume_from_checkpoint, training_args.output_dir)
        pretrain.check_output_dir(training_args.output_dir, resume is not None, run_args.overwrite_output_dir)
    return args, rest


def finished(args: SeedsArguments, seed: int) -> bool:
    """Whether OUTPUT_DIR/seed_S holds a finished run: its final checkpoint and its results.json."""
    folder = os.path.join(args.output_dir, f"seed_{seed}")
    return os.path.isdir(os.path.join(folder, "final")) and os.path.isfile(os.path.join(folder, "results.json"))


def run_argv(rest: list[str], args: SeedsArguments, seed: int) -> list[str]:
    return [*rest, "--seed", str(seed), "--output_dir", os.path.join(args.output_dir, f"seed_{seed}")]


def evaluate(argv: list[str], args: SeedsArguments) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, int]]:
    """``scores[encoder][metric][labels]`` of the run pretrain.py made with ``argv`` (its final encoder,
    its architecture at random init and raw pixels, on the splits, views and kNN settings of that run)
    and the number of training labels each share of the labels holds."""
    model_args, data_args, _, training_args = pretrain.build_parser().parse_args_into_dataclasses(args=argv)
    train, test, _ = pretrain.load_splits(data_args)
    if test is None or data_args.label_column not in train.column_names:
        raise ValueError(f"seeds.py needs labels ({data_args.label_column!r}) and a held-out split")
    mean, std = pretrain.normalization(data_args)
    augmentation = pretrain.build_augmentation(model_args.method, data_args, mean, std, pretrain.explicit_flags(argv))
    tr = eval_dataset(train, augmentation, data_args.image_column, data_args.label_column)
    te = eval_dataset(test, augmentation, data_args.image_column, data_args.label_column)
    torch.manual_seed(training_args.seed)  # the random init pretrain.py's kNN report draws
    encoders = {
        "pretrained": AutoModel.from_pretrained(os.path.join(training_args.output_dir, "final")).encoder,
        "random_init": recalibrate_batch_norm(pretrain.build_model(model_args, data_args.image_size).encoder, tr),
        "raw_pixels": None,
    }
    train_labels = torch.as_tensor(train[data_args.label_column])  # (N,), the order features come in
    subsets = {fraction_label(f): balanced_subset(train_labels, f, args.subset_seed) for f in args.label_fractions}
    scores = {}
    for name, encoder in encoders.items():
        train_x, train_y = extract_features(encoder, tr)  # (N, F), (N,)
        test_x, test_y = extract_features(encoder, te)  # (M, F), (M,)
        num_classes = int(max(train_y.max(), test_y.max())) + 1
        scores[name] = {"knn": {}, "probe": {}}
        for label, idx in subsets.items():
            scores[name]["knn"][label] = knn_top1(train_x[idx], train_y[idx], test_x, test_y, k=data_args.knn_k)
            probe = train_linear_probe(train_x[idx], train_y[idx], test_x, test_y, num_classes,
                                       max_iter=args.probe_max_iter, l2=args.probe_l2)
            scores[name]["probe"][label] = probe["accuracy"]
        logger.info(f"{ENCODERS[name]}: " + ", ".join(
            f"{METRICS[m]} {label} {v:.4f}" for m, per in scores[name].items() for label, v in per.items()))
    return scores, {label: len(idx) for label, idx in subsets.items()}


def summarize(per_seed: dict[int, dict], wall: dict[int, dict[str, float]], args: SeedsArguments,
              rest: list[str], label_counts: dict[str, int]) -> dict:
    """Mean, sample std and each seed's value per (metric, labels, encoder) row, and the wall times."""
    seeds = list(per_seed)
    rows = []
    for metric in METRICS:
        for label in map(fraction_label, args.label_fractions):
            for encoder in ENCODERS:
                values = [per_seed[s][encoder][metric][label] for s in seeds]
                mean, std = mean_std(values)
                rows.append(dict(metric=metric, labels=label, encoder=encoder, values=values, mean=mean, std=std))
    means = {(r["metric"], r["labels"], r["encoder"]): r["mean"] for r in rows}
    beats = {f"{m} {label}": means[m, label, "pretrained"] > means[m, label, "raw_pixels"]
             for m in METRICS for label in map(fraction_label, args.label_fractions)}
    return dict(seeds=seeds, pretrain_flags=rest, label_fractions=args.label_fractions,
                label_counts=label_counts, subset_seed=args.subset_seed,
                std="sample standard deviation (n - 1) over seeds", rows=rows, pretrained_beats_raw_pixels=beats,
                wall_seconds={k: [wall[s][k] for s in seeds] for k in ("pretrain", "evaluation")})


def markdown(summary: dict) -> str:
    """The summary as a markdown table (mean ± std, then each seed's value) and the wall times."""
    seeds = summary["seeds"]
    head = f"| labels | metric | {' | '.join(ENCODERS.values())} |\n| --- | --- |" + " --- |" * len(ENCODERS)
    lines = [f"Mean ± sample std over seeds {', '.join(map(str, seeds))} (each seed's value in brackets); "
             "top-1 on the held-out split, frozen features.", "", head]
    cells = {(r["metric"], r["labels"], r["encoder"]): r for r in summary["rows"]}
    for metric, metric_name in METRICS.items():
        for fraction in summary["label_fractions"]:
            label = fraction_label(fraction)
            count = f"{label} ({summary['label_counts'][label]} labels)"
            row = [f"{c['mean']:.3f} ± {c['std']:.3f} ({', '.join(f'{v:.3f}' for v in c['values'])})"
                   for c in (cells[metric, label, e] for e in ENCODERS)]
            lines.append(f"| {count} | {metric_name} | {' | '.join(row)} |")
    beats = [k for k, v in summary["pretrained_beats_raw_pixels"].items() if v]
    lines += ["", "Pretrained beats raw pixels on the mean: " + (", ".join(beats) if beats else "in no row") + "."]
    for key, values in summary["wall_seconds"].items():
        known = [v for v in values if v is not None]
        lines.append(f"Wall time, {key} per run: {', '.join('n/a' if v is None else f'{v:.0f} s' for v in values)}"
                     + (f" (mean {statistics.fmean(known) / 60:.1f} min)." if known else "."))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    """Run pretrain.py once per seed, evaluate each run, write and print the summary; returns it."""
    args, rest = parse(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])
    per_seed, wall = {}, {}
    for i, seed in enumerate(args.seeds):
        argv_seed = run_argv(rest, args, seed)
        logger.info(f"Run {i + 1}/{len(args.seeds)}, seed {seed}: python training/pretrain.py {' '.join(argv_seed)}")
        path = os.path.join(args.output_dir, f"seed_{seed}", "results.json")
        start = time.perf_counter()
        if args.reuse_runs and finished(args, seed):
            with open(path) as f:
                results = json.load(f)
            pretrain_seconds = results.get("wall_seconds", {}).get("pretrain")  # None: the run did not record it
            logger.info(f"Seed {seed}: reusing the finished run in {os.path.dirname(path)}")
        else:
            results = pretrain.main(argv_seed)
            pretrain_seconds = time.perf_counter() - start
            logger.info(f"Seed {seed}: pretrain.py took {pretrain_seconds / 60:.1f} min")
        middle = time.perf_counter()
        logger.info(f"Seed {seed}: kNN and linear probes with {', '.join(map(fraction_label, args.label_fractions))} "
                    "of the labels")
        per_seed[seed], label_counts = evaluate(argv_seed, args)
        wall[seed] = {"pretrain": pretrain_seconds, "evaluation": time.perf_counter() - middle}
        results.update(frozen_features=per_seed[seed], wall_seconds=wall[seed])
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
    summary = summarize(per_seed, wall, args, rest, label_counts)
    table = markdown(summary)
    with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    return summary


if __name__ == "__main__":
    run_main(main, pretrain.build_parser())  # the flags it passes on are pretrain.py's
