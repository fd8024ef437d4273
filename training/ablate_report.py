"""The report of ``training/ablate.py``'s momentum and queue-size sweeps: ``README.md`` (the tables, what they
say next to the paper's numbers, the seed repeats) and the plots ``momentum.png`` and ``queue_size.png``."""

from __future__ import annotations

import glob
import json
import math
import os

# ImageNet linear top-1 of MoCo (He et al. 2020, Table 4 / section 4.1), for the comparison.
PAPER_MOMENTUM = {0.0: "fails", 0.9: "55.2", 0.99: "57.8", 0.999: "59.0", 0.9999: "58.9"}


def _fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def write_report(a, mom: list[dict], que: list[dict], results: list[dict], base: dict, command: str,
                 train_size: int) -> None:
    """Write ``README.md``, ``momentum.png`` and ``queue_size.png`` into ``a.output_dir`` (``a``: the sweep's
    ``AblationArguments``; ``mom`` and ``que``: the runs of the momentum and queue-size sweeps, in order)."""
    plot_momentum(mom, base, os.path.join(a.output_dir, "momentum.png"))
    plot_queue_size(que, base, os.path.join(a.output_dir, "queue_size.png"))
    steps = results[0]["steps"]
    minutes = (base["seconds"] + sum(r["runtime_s"] for r in results)) / 60
    lines = [
        "# MoCo momentum and queue-size ablations on the embedded digits",
        "",
        "Produced by (from the repository root; the runs' JSON files are in `runs/`):",
        "",
        "```",
        command,
        "```",
        "",
        f"Setup: MoCo, timm `{a.backbone}` at 32 px, head 512-BN-ReLU-128 with output BatchNorm, temperature "
        f"{a.temperature}, SGD lr {a.learning_rate} (momentum 0.9, wd 5e-4, cosine, 5% warmup), batch "
        f"{a.batch_size}, {a.num_train_epochs:g} epochs = {steps} steps per run, one process, "
        "`key_bn_splits=1`, `symmetric_loss=False`, seed "
        f"{a.seed}. 4,000 training / 1,000 held-out MNIST digits. kNN top-1: k=200, t=0.1 on the "
        f"encoder's pooled features (raw pixels {base['raw_pixels']:.3f}, random init "
        f"{base['random_init']:.3f}). The {len(results)} runs and the baselines took {minutes:.1f} min "
        f"wall on two shared CPU cores (one torch thread).",
        "",
        "Queue consistency: mean cosine between keys in the queue and the same images re-encoded by the "
        "current key encoder (1 = the queue could have been made today), averaged over the measurements "
        f"taken every {a.consistency_every} steps once every age is in the queue; ages are key-encoder "
        "updates since the key was made, from the newest keys to the oldest in the queue. Key drift: "
        "`||theta_k - theta_q|| / ||theta_q||`, averaged over training. Alignment and uniformity "
        "(Wang & Isola 2020; lower is better for both) on 512 held-out pairs at the end.",
        "",
        f"## Momentum (queue {a.base_queue_size})",
        "",
        f"| momentum | kNN top-1 | queue consistency | by age ({' / '.join(str(x) for x in mom[0]['ages'])}) "
        "| key drift | alignment | uniformity | final loss | ln(K+1) | paper, ImageNet linear top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in mom:
        m = r["settings"]["momentum"]
        ages = " / ".join(_fmt(v) for v in r["consistency_by_age"].values())
        lines.append(f"| {m:g} | {_fmt(r['knn_top1'])} | {_fmt(r['queue_consistency'])} | {ages} | "
                     f"{_fmt(r['key_drift'], 4)} | {_fmt(r['alignment'])} | {_fmt(r['uniformity'])} | "
                     f"{_fmt(r['final_loss'])} | {_fmt(r['no_signal_loss'])} | {PAPER_MOMENTUM.get(m, '')} |")
    lines += [
        "",
        f"## Queue size (momentum {a.base_momentum:g})",
        "",
        "| queue size | span (steps) | kNN top-1 | queue consistency | oldest keys' consistency | final loss "
        "| ln(K+1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in que:
        oldest = list(r["consistency_by_age"].values())[-1]
        lines.append(f"| {r['settings']['queue_size']} | {r['ages'][-1]} | {_fmt(r['knn_top1'])} | "
                     f"{_fmt(r['queue_consistency'])} | {_fmt(oldest)} | {_fmt(r['final_loss'])} | "
                     f"{_fmt(r['no_signal_loss'])} |")
    lines += ["", *reading(a, mom, que, base, train_size)]
    lines += ["", "## Cost of the queue-consistency monitor", "",
              "| run | s / step (training) | measurements | s / measurement | share of training time |",
              "|---|---|---|---|---|"]
    for r in results:
        per = r["queue_monitor_s"] / max(r["queue_monitor_measurements"], 1)
        lines.append(f"| {r['name']} | {r['step_s']:.2f} | {r['queue_monitor_measurements']} | {per:.2f} | "
                     f"{100 * r['queue_monitor_fraction']:.1f}% |")
    lines += ["", "![momentum](momentum.png)", "", "![queue size](queue_size.png)", ""]
    with open(os.path.join(a.output_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def reading(a, mom: list[dict], que: list[dict], base: dict, train_size: int) -> list[str]:
    """What the tables say, computed from them, next to the paper's numbers."""
    out = ["## Reading", ""]
    oldest = lambda r: list(r["consistency_by_age"].values())[-1]  # noqa: E731
    if len(mom) >= 2:
        pairs = sorted(((r["settings"]["momentum"], r) for r in mom), key=lambda p: p[0])
        cons = [r["queue_consistency"] for _, r in pairs]
        monotone = all(x <= y for x, y in zip(cons, cons[1:], strict=False))
        (m_low, low), (m_high, high) = pairs[0], pairs[-1]
        out.append(
            f"- Queue consistency {'falls monotonically' if monotone else 'does NOT fall monotonically'} "
            "as the momentum falls ("
            + ", ".join(f"m = {m:g}: {r['queue_consistency']:.3f}" for m, r in pairs) + "). The oldest keys "
            f"({low['ages'][-1]} steps old) have cosine {oldest(low):.3f} with their re-encoding at "
            f"m = {m_low:g} and {oldest(high):.3f} at m = {m_high:g}. Over a run the consistency rises for "
            "every m as the cosine schedule lowers the learning rate (right panel of momentum.png).")
        best_m, _ = max(pairs, key=lambda p: p[1]["knn_top1"])
        out.append(
            "- kNN top-1 by momentum: " + ", ".join(f"m = {m:g}: {r['knn_top1']:.3f}" for m, r in pairs)
            + f"; best at m = {best_m:g} (raw pixels {base['raw_pixels']:.3f}, random init "
            f"{base['random_init']:.3f}). The paper (ImageNet, 200 epochs, linear top-1): m = 0 fails, "
            "0.9: 55.2, 0.99: 57.8, 0.999: 59.0, 0.9999: 58.9.")
        zero = next((r for m, r in pairs if m == 0), None)
        if zero is not None:
            worst = zero["knn_top1"] <= min(r["knn_top1"] for _, r in pairs)
            span = zero["ages"][-1]
            out.append(
                "- m = 0 (the key encoder is a copy of the query encoder) reaches kNN "
                f"{zero['knn_top1']:.3f}: " + ("the worst of the sweep" if worst else "it does not fail here")
                + f". The queue spans only {span} steps here ({zero['settings']['queue_size']} keys at "
                f"{a.batch_size} a step; the paper's 65,536 at 256 span 256 steps), so even m = 0's oldest "
                f"keys are {span} SGD steps stale (cosine {oldest(zero):.3f}): inconsistent, but not enough "
                "to stop learning on this data.")
        if best_m != m_high and m_high > 0:
            steps = high["steps"]
            signs = [f"final loss {high['final_loss']:.3f} against ln(K+1) = {high['no_signal_loss']:.3f}"]
            if high["uniformity"] >= max(r["uniformity"] for _, r in pairs):
                signs.append(f"the least uniform embeddings of the sweep, {high['uniformity']:.3f}")
            out.append(
                f"- m = {m_high:g} underperforms here, unlike on ImageNet: the EMA's time constant is "
                f"1 / (1 - m) = {1 / (1 - m_high):.0f} steps and a run has {steps}, so at its end the key "
                f"encoder is still {m_high ** steps:.0%} its random initialisation ({m_high:g}^{steps}). Its "
                "keys are consistent because they barely change, not because they are good ("
                + "; ".join(signs) + "). The paper's runs take about a million steps (200 epochs of ImageNet "
                "at batch 256).")
    if len(que) >= 2:
        rows = sorted(((r["settings"]["queue_size"], r) for r in que), key=lambda p: p[0])
        best_q, _ = max(rows, key=lambda p: p[1]["knn_top1"])
        falls = oldest(rows[-1][1]) < oldest(rows[0][1])
        per_epoch = train_size // a.batch_size * a.batch_size  # the last short batch is dropped
        out.append(
            "- kNN top-1 by queue size: " + ", ".join(f"K = {q}: {r['knn_top1']:.3f}" for q, r in rows)
            + f"; best at K = {best_q}. A longer queue holds older keys: the oldest keys' consistency "
            + ("falls" if falls else "changes") + f" from {oldest(rows[0][1]):.3f} (K = {rows[0][0]}) to "
            f"{oldest(rows[-1][1]):.3f} (K = {rows[-1][0]}). "
            + (f"An epoch enqueues {per_epoch} keys ({train_size} images): a queue longer than that holds an "
               "earlier key of the anchor's own image as a negative. " if rows[-1][0] > per_epoch else "")
            + ("On a corpus this small, more negatives did not pay for staler ones here "
               if best_q == rows[0][0] else "")
            + "(MoCo's CIFAR-10 demo saturates at K = 4096; ImageNet uses 65,536).")
    out += seed_repeats(a, mom + que)
    return out


def seed_repeats(a, results: list[dict]) -> list[str]:
    """A table comparing runs repeated with other seeds (``<output_dir>/seed*/runs``), if any."""
    rows, gaps = [], []
    for path in sorted(glob.glob(os.path.join(a.output_dir, "seed*", "runs", "m*.json"))):
        with open(path) as f:
            other = json.load(f)
        same = next((r for r in results if r["name"] == other["name"]), None)
        if same is not None:
            cells = [f"{r['settings']['seed']}: {r['knn_top1']:.3f} / {r['queue_consistency']:.3f}"
                     for r in (same, other)]
            rows.append(f"| {other['name']} | {cells[0]} | {cells[1]} |")
            gaps.append(abs(same["knn_top1"] - other["knn_top1"]))
    if not rows:
        return []
    return ["", f"One seed per configuration. Repeated with another seed, kNN top-1 moved by up to "
            f"{max(gaps):.3f}: smaller differences between runs above are noise. Repeats (kNN top-1 / queue "
            "consistency; made by the command in `seed1/README.md`):", "",
            "| run | seed: this table | seed: repeat |", "|---|---|---|", *rows]


def _momentum_labels(rows: list[dict]) -> list[str]:
    return [f"{r['settings']['momentum']:g}" for r in rows]


def plot_momentum(rows: list[dict], base: dict, path: str) -> None:
    """kNN top-1 and queue consistency (by age and over training) against the momentum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(rows))
    labels = _momentum_labels(rows)
    ax1.plot(x, [r["knn_top1"] for r in rows], "o-", label="MoCo")
    ax1.axhline(base["raw_pixels"], ls="--", c="gray", label="raw pixels")
    ax1.axhline(base["random_init"], ls=":", c="gray", label="random init")
    ax1.set(xticks=list(x), xticklabels=labels, xlabel="momentum m", ylabel="kNN top-1 (held out)",
            title="kNN top-1 vs momentum")
    ax1.legend()
    ages = rows[0]["ages"]
    for age in ages:
        ax2.plot(x, [r["consistency_by_age"][str(age)] for r in rows], "o-", label=f"keys {age} steps old")
    ax2.set(xticks=list(x), xticklabels=labels, xlabel="momentum m", title="queue consistency vs momentum",
            ylabel="mean cosine(stored key, re-encoded)")
    ax2.legend()
    for r, label in zip(rows, labels, strict=True):
        full = [h for h in r["log_history"] if all(f"queue_consistency_age{age}" in h for age in ages)]
        ax3.plot([h["step"] for h in full], [h["queue_consistency"] for h in full], label=f"m = {label}")
    ax3.set(xlabel="optimizer step", ylabel="queue consistency (mean over ages)", title="during training")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_queue_size(rows: list[dict], base: dict, path: str) -> None:
    """kNN top-1 and consistency of the oldest queued keys against the queue size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    sizes = [r["settings"]["queue_size"] for r in rows]
    ax1.plot(sizes, [r["knn_top1"] for r in rows], "o-", label="MoCo")
    ax1.axhline(base["raw_pixels"], ls="--", c="gray", label="raw pixels")
    ax1.axhline(base["random_init"], ls=":", c="gray", label="random init")
    ax1.set(xscale="log", xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="queue size K",
            ylabel="kNN top-1 (held out)", title="kNN top-1 vs queue size")
    ax1.minorticks_off()
    ax1.legend()
    ax2.plot(sizes, [r["queue_consistency"] for r in rows], "o-", label="mean over ages")
    ax2.plot(sizes, [list(r["consistency_by_age"].values())[-1] for r in rows], "s--", label="oldest keys")
    ax2.set(xscale="log", xticks=sizes, xticklabels=[str(s) for s in sizes], xlabel="queue size K",
            ylabel="queue consistency", title="queue consistency vs queue size")
    ax2.minorticks_off()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
