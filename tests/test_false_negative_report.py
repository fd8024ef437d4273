"""The false-negative sweep's report: seeds grouped per cell, same-seed differences, the plot."""

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "false_negative_report", Path(__file__).parents[1] / "training" / "false_negative_report.py")
report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report)


def run(queue_size, seed, knn, exclude=False, fn=None):
    settings = {"queue_size": queue_size, "seed": seed, "momentum": 0.99}
    if exclude:
        settings["exclude_same_instance"] = "exclude"
    if fn:
        settings.update(false_negatives=fn, false_negative_top_k=10)
    return {"settings": settings, "knn_top1": knn, "steps": 155, "final_loss": 5.0, "runtime_s": 240.0,
            "num_negatives": queue_size - 0.5 if exclude else None,
            "false_negatives": {"queue_same_class": 0.1, "fnc_precision": 0.4} if exclude else None}


RUNS = [run(256, 0, 0.80), run(256, 1, 0.84), run(256, 0, 0.81, exclude=True), run(256, 1, 0.82, exclude=True),
        run(4096, 0, 0.70), run(4096, 0, 0.65, exclude=True, fn="attract"), run(4096, 1, 0.60, exclude=True,
                                                                               fn="attract")]


def test_variant_names():
    assert report.variant(RUNS[0]["settings"]) == "no masking"
    assert report.variant(RUNS[2]["settings"]) == "exclude same instance"
    assert report.variant(RUNS[5]["settings"]) == "exclude + attract"


def test_cells_and_same_seed_deltas():
    grid = report.cells(RUNS)
    assert grid[(256, "no masking")] == {0: 0.80, 1: 0.84}
    assert grid[(4096, "exclude + attract")] == {0: 0.65, 1: 0.60}
    deltas = report.paired_deltas(grid, "exclude same instance")
    assert deltas[256] == pytest.approx([0.01, -0.02])  # seed 0: 0.81 - 0.80; seed 1: 0.82 - 0.84
    # seed 1 has no no-masking run at 4096: only seed 0 is paired
    assert report.paired_deltas(grid, "exclude + attract")[4096] == pytest.approx([-0.05])


def test_report_tables_and_plot(tmp_path):
    (tmp_path / "runs").mkdir()
    for i, r in enumerate(RUNS):
        (tmp_path / "runs" / f"m0.99_{i}.json").write_text(json.dumps(r))
    text = report.write_report(str(tmp_path), "python training/ablate.py --seed 1")
    assert "| no masking | **0.820** (0.800 / 0.840) | 0.700 |" in text
    assert "| exclude + attract | — | **0.625** (0.650 / 0.600) |" in text
    assert "| exclude same instance | +0.010 / -0.020 | — |" in text
    assert "median 0.040, largest 0.050, over 3 cells" in text  # spreads 0.04, 0.01, 0.05
    assert "python training/ablate.py --seed 1" in (tmp_path / "commands.txt").read_text()
    assert (tmp_path / "false_negatives.png").stat().st_size > 10_000


def test_ablate_expands_seeds_and_variants_into_the_committed_run_names():
    import sys

    from transformers import HfArgumentParser

    sys.path.insert(0, str(Path(__file__).parents[1] / "training"))  # ablate imports its sibling report module
    try:
        import ablate
    finally:
        sys.path.pop(0)

    parse = HfArgumentParser(ablate.AblationArguments).parse_args_into_dataclasses
    (a,) = parse(args=["--false_negative_variants", "none", "exclude", "attract", "--seeds", "0", "1"])
    names = [ablate.run_name(0.99, 4096, c) for c in ablate.expand(a)]
    assert names == ["m0.99_q4096", "m0.99_q4096_exclude", "m0.99_q4096_exclude_attract",
                     "m0.99_q4096_seed1", "m0.99_q4096_exclude_seed1", "m0.99_q4096_exclude_attract_seed1"]
    none_seed0 = ablate.expand(a)[0]
    assert "exclude_same_instance" not in ablate.settings(none_seed0, 0.99, 4096)  # reuses the plain sweep's JSON
    assert all(c.false_negative_report for c in ablate.expand(a))
    (bad,) = parse(args=["--false_negative_variants", "drop"])
    with pytest.raises(ValueError, match=r"false_negative_variants=\['drop'\] is invalid.*'eliminate'"):
        ablate.expand(bad)


def test_ablate_report_writes_the_tables_and_plots(tmp_path):
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
    try:
        import ablate_report
    finally:
        sys.path.pop(0)

    def run(m, q, knn):
        ages = {"1": 0.9, "4": 0.8, "8": 0.7 - m / 10}
        history = [{"step": s, "queue_consistency": 0.8, **{f"queue_consistency_age{a}": v for a, v in ages.items()}}
                   for s in (1, 2)]
        return dict(name=f"m{m:g}_q{q}", steps=100, runtime_s=10.0, step_s=0.1, settings=dict(momentum=m, queue_size=q,
                    seed=0), ages=[1, 4, 8], consistency_by_age=ages, knn_top1=knn, queue_consistency=0.8 + m / 10,
                    key_drift=0.01, alignment=0.5, uniformity=-2.0, final_loss=5.0, no_signal_loss=7.0,
                    queue_monitor_s=1.0, queue_monitor_measurements=3, queue_monitor_fraction=0.05,
                    log_history=history)

    mom, que = [run(0.0, 2048, 0.6), run(0.99, 2048, 0.8)], [run(0.99, 2048, 0.8), run(0.99, 256, 0.7)]
    a = SimpleNamespace(output_dir=str(tmp_path), backbone="resnet18", temperature=0.2, learning_rate=0.06,
                        batch_size=256, num_train_epochs=10, seed=0, consistency_every=20, base_queue_size=2048,
                        base_momentum=0.99)
    ablate_report.write_report(a, mom, que, mom + que[1:], dict(seconds=5.0, raw_pixels=0.9, random_init=0.3),
                               "python training/ablate.py", 4000)
    text = (tmp_path / "README.md").read_text()
    assert "## Momentum (queue 2048)" in text and "| 0.99 | 0.800 |" in text and "python training/ablate.py" in text
    assert "best at m = 0.99" in text and "best at K = 2048" in text
    assert (tmp_path / "momentum.png").exists() and (tmp_path / "queue_size.png").exists()
