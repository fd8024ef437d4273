#!/usr/bin/env python
"""The report of the false-negative sweep: queue size x masking / cancellation x seed.

``training/ablate.py`` with ``--exclude_same_instance``, ``--false_negatives`` or
``--false_negative_report`` writes one JSON per run into ``<output_dir>/runs/`` and then calls
:func:`write_report`, which rebuilds, from every run JSON there:

- ``README.md``: the commands, a summary table (kNN top-1 per queue size and variant: the mean over
  seeds and each seed's value), the same-seed differences against no masking, and one row per run;
- ``false_negatives.png``: kNN top-1 against the queue size per variant (mean line, one marker per
  seed), and the same-class share of the candidates cancellation picks (FNC precision).

Regenerate from committed runs without training: ``python training/false_negative_report.py
results/false_negatives``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from collections import defaultdict

GRID_COMMAND = ("python training/ablate.py --momenta 0.99 --queue_sizes 256 1024 2048 4096 --seeds 0 1 "
                "--false_negative_variants none exclude eliminate attract --output_dir results/false_negatives")
VARIANTS = ("no masking", "exclude same instance", "exclude + eliminate", "exclude + attract")


def variant(settings: dict) -> str:
    """The sweep's name for a run's false-negative options."""
    if settings.get("false_negatives"):
        return f"exclude + {settings['false_negatives']}" if settings.get("exclude_same_instance") \
            else settings["false_negatives"]
    return "exclude same instance" if settings.get("exclude_same_instance") else "no masking"


def load_runs(output_dir: str) -> list[dict]:
    runs = []
    for path in sorted(glob.glob(os.path.join(output_dir, "runs", "m*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def cells(runs: list[dict]) -> dict[tuple[int, str], dict[int, float]]:
    """{(queue size, variant): {seed: kNN top-1}}."""
    out: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)
    for r in runs:
        s = r["settings"]
        out[(s["queue_size"], variant(s))][s["seed"]] = r["knn_top1"]
    return dict(out)


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def paired_deltas(grid: dict, name: str, reference: str = "no masking") -> dict[int, list[float]]:
    """{queue size: [kNN(variant) - kNN(reference) for each seed both ran]}: same-seed differences."""
    out = {}
    for (k, v), by_seed in grid.items():
        ref = grid.get((k, reference), {})
        if v == name and ref:
            out[k] = [by_seed[s] - ref[s] for s in sorted(by_seed) if s in ref]
    return dict(sorted(out.items()))


def _fmt(x, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_lines(grid: dict) -> list[str]:
    sizes = sorted({k for k, _ in grid})
    names = [v for v in VARIANTS if any((k, v) in grid for k in sizes)]
    names += sorted({v for _, v in grid} - set(names))
    lines = ["| variant | " + " | ".join(f"K = {k}" for k in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for v in names:
        row = []
        for k in sizes:
            by_seed = grid.get((k, v))
            if not by_seed:
                row.append("—")
                continue
            seeds = " / ".join(f"{by_seed[s]:.3f}" for s in sorted(by_seed))
            row.append(f"**{mean(by_seed.values()):.3f}** ({seeds})" if len(by_seed) > 1 else seeds)
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    return lines


def delta_lines(grid: dict) -> list[str]:
    spreads = [max(s.values()) - min(s.values()) for s in grid.values() if len(s) > 1]
    lines = ["| variant | " + " | ".join(f"K = {k}" for k in sorted({k for k, _ in grid})) + " |",
             "|---|" + "---|" * len({k for k, _ in grid})]
    for v in VARIANTS[1:]:
        deltas = paired_deltas(grid, v)
        if not deltas:
            continue
        row = [" / ".join(f"{d:+.3f}" for d in deltas[k]) if deltas.get(k) else "—"
               for k in sorted({k for k, _ in grid})]
        lines.append(f"| {v} | " + " | ".join(row) + " |")
    if spreads:
        lines += ["", f"Seed-to-seed spread of one cell (max - min over its seeds): median "
                      f"{sorted(spreads)[len(spreads) // 2]:.3f}, largest {max(spreads):.3f}, over "
                      f"{len(spreads)} cells with two or more seeds."]
    return lines


def run_lines(runs: list[dict]) -> list[str]:
    lines = ["| queue size | variant | seed | kNN top-1 | num_negatives | queue same class | FNC precision "
             "| final loss | ln(K+1) | minutes |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    for r in sorted(runs, key=lambda r: (r["settings"]["queue_size"], order.get(variant(r["settings"]), 9),
                                         r["settings"]["seed"])):
        s, fn = r["settings"], r.get("false_negatives") or {}
        top_k = f" top {s['false_negative_top_k']}" if s.get("false_negatives") else ""
        lines.append(f"| {s['queue_size']} | {variant(s)}{top_k} | {s['seed']} | {_fmt(r['knn_top1'])} | "
                     f"{r.get('num_negatives') or 'n/a'} | {_fmt(fn.get('queue_same_class'))} | "
                     f"{_fmt(fn.get('fnc_precision'))} | {_fmt(r['final_loss'])} | "
                     f"{_fmt(math.log(s['queue_size'] + 1))} | {r['runtime_s'] / 60:.1f} |")
    return lines


def plot(runs: list[dict], baselines: dict | None, path: str) -> None:
    """kNN top-1 and FNC precision against the queue size, one line per variant, a marker per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = cells(runs)
    sizes = sorted({k for k, _ in grid})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for i, v in enumerate(VARIANTS):
        ks = [k for k in sizes if (k, v) in grid]
        if not ks:
            continue
        color = f"C{i}"
        ax1.plot(ks, [mean(grid[(k, v)].values()) for k in ks], "-", c=color, label=f"{v} (mean)")
        for k in ks:
            ax1.plot([k] * len(grid[(k, v)]), list(grid[(k, v)].values()), "o", c=color, alpha=0.6, ms=4)
        prec = defaultdict(list)
        for r in runs:
            fn = r.get("false_negatives") or {}
            if variant(r["settings"]) == v and fn.get("fnc_precision") is not None:
                prec[r["settings"]["queue_size"]].append(fn["fnc_precision"])
        if prec:
            pk = sorted(prec)
            ax2.plot(pk, [mean(prec[k]) for k in pk], "o-", c=color, label=v)
    if baselines:
        ax1.axhline(baselines["raw_pixels"], ls="--", c="gray", label="raw pixels")
    ax2.axhline(0.1, ls=":", c="gray", label="chance (1 / 10 classes)")
    for ax in (ax1, ax2):
        ax.set(xscale="log", xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="queue size K")
        ax.minorticks_off()
        ax.legend(fontsize=8, loc="lower left")
    ax1.set(ylabel="kNN top-1 (1,000 held-out digits)", title="kNN top-1 vs queue size (dots: seeds)")
    ax2.set(ylabel="same-class share of the top-10 candidates",
            title="FNC precision: share of the 10 keys cancellation\ntakes (or would take) that are same-class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_report(output_dir: str, command: str | None = None) -> str:
    """Rebuild ``README.md`` and ``false_negatives.png`` from ``runs/``; append ``command`` to
    ``commands.txt`` first. Returns the README text."""
    commands_path = os.path.join(output_dir, "commands.txt")
    if command:
        with open(commands_path, "a") as f:
            f.write(command + "\n")
    commands = _read(commands_path).strip() if os.path.exists(commands_path) else ""
    runs = load_runs(output_dir)
    base_path = os.path.join(output_dir, "runs", "baselines.json")
    base = json.loads(_read(base_path)) if os.path.exists(base_path) else None
    plot(runs, base, os.path.join(output_dir, "false_negatives.png"))
    grid = cells(runs)
    steps = sorted({r["steps"] for r in runs})
    lines = [
        "# False negatives against the queue size on the embedded digits", "",
        "One command reproduces the whole grid (from the repository root; it reuses every run JSON in `runs/` "
        "with the same settings, so an interrupted sweep resumes):", "",
        "```", GRID_COMMAND, "```", "",
        "The committed runs were made by these calls, in order (`python training/false_negative_report.py "
        "results/false_negatives` rebuilds this page from `runs/`):", "",
        "```", commands, "```", "",
        "Recipe as in `results/ablation`: MoCo, resnet18 at 32 px, momentum 0.99, batch 128, "
        f"{'/'.join(map(str, steps))} steps (5 epochs of the 4,000 training digits), kNN top-1 (k=200) on the "
        "1,000 held-out digits"
        + (f" (raw pixels {base['raw_pixels']:.3f}, random init {base['random_init']:.3f})" if base else "")
        + ". Variants: `no masking` (the queue as in the MoCo paper; the seed-0 runs are the committed "
        "`results/ablation` runs, their JSON copied here), `exclude same instance` "
        "(`exclude_same_instance=True`: never the anchor's own image as a negative), and `+ eliminate` / "
        "`+ attract` (false-negative cancellation, top 10 by similarity to the anchor's two views).", "",
        "## kNN top-1", "", "Bold: the mean over seeds; in brackets each seed (0 / 1).", "",
        *summary_lines(grid), "",
        "## Same-seed difference against no masking", "",
        "kNN(variant) - kNN(no masking) at the same seed (seed 0 / seed 1).", "",
        *delta_lines(grid), "",
        "## Every run", "",
        "`num_negatives`: the mean per anchor after masking, last training log. Queue same class / FNC "
        "precision: FalseNegativeMonitor on 256 held-out digits at the end (share of queued keys of the "
        "query's class; same-class share of the top-10 candidates cancellation takes).", "",
        *run_lines(runs), "",
        "![false negatives](false_negatives.png)", "",
    ]
    text = "\n".join(lines)
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    write_report(sys.argv[1] if len(sys.argv) > 1 else "results/false_negatives")
