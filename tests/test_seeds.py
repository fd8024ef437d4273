"""training/seeds.py: the pretraining job over seeds, judged by kNN and linear probes with a share of the labels."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

TRAINING = Path(__file__).parents[1] / "training"

# training/pretrain.py shrunk to seconds (the flags of test_pretrain_script.py, 2 steps)
TINY = ["--backbone", "test_resnet", "--projection_hidden_dim", "32", "--max_train_samples", "200",
        "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "16", "--queue_size", "64",
        "--save_strategy", "no", "--knn_k", "20", "--disable_tqdm", "True", "--dataloader_num_workers", "0",
        "--knn_every_n_steps", "0"]


@pytest.fixture(scope="module")
def seeds(pretrain):
    """``training/seeds.py`` as a module (it imports ``pretrain`` and ``linear_probe`` from training/)."""
    sys.path.insert(0, str(TRAINING))
    try:
        import seeds as module
    finally:
        sys.path.remove(str(TRAINING))
    return module


def test_balanced_subset_is_class_balanced_and_sized(seeds):
    counts = [400, 450, 500, 380]  # unequal classes, shuffled
    labels = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[torch.randperm(sum(counts))]  # (1730,)
    for fraction, per_class in ((0.01, 4), (0.1, 43)):  # round(fraction * 1730 / 4)
        idx = seeds.balanced_subset(labels, fraction, seed=0)
        assert len(idx) == 4 * per_class and len(idx.unique()) == len(idx) and bool((idx.diff() > 0).all())
        assert labels[idx].bincount().tolist() == [per_class] * 4
        assert torch.equal(idx, seeds.balanced_subset(labels, fraction, seed=0))  # a fixed seed: the same subset
        assert not torch.equal(idx, seeds.balanced_subset(labels, fraction, seed=1))
    assert torch.equal(seeds.balanced_subset(labels, 1.0), torch.arange(len(labels)))
    assert len(seeds.balanced_subset(torch.tensor([0, 0, 0, 1, 1, 2]), 0.01)) == 3  # at least one of each class
    with pytest.raises(ValueError, match="class 1 has only 2"):
        seeds.balanced_subset(torch.tensor([0] * 10 + [1] * 2), 0.5)  # 3 per class
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        seeds.balanced_subset(labels, 0.0)


def test_digits_subsets_are_4_and_40_per_class(seeds, digits):
    labels = torch.tensor(digits["train"]["label"])  # the default job's 4,000 training digits, 400 per class
    for fraction, per_class in ((0.01, 4), (0.1, 40)):
        idx = seeds.balanced_subset(labels, fraction)
        assert len(idx) == 10 * per_class and labels[idx].bincount().tolist() == [per_class] * 10


def test_seeds_summary(seeds, tmp_path, capsys):
    out = tmp_path / "runs"
    summary = seeds.main(["--seeds", "0", "1", "--output_dir", str(out), *TINY])
    printed = capsys.readouterr().out
    assert summary["seeds"] == [0, 1] and summary["label_counts"] == {"1%": 10, "10%": 20, "100%": 200}
    per_seed = {s: json.loads((out / f"seed_{s}" / "results.json").read_text()) for s in (0, 1)}
    assert len(summary["rows"]) == 2 * 3 * 3  # (kNN, probe) x (1%, 10%, 100%) x (pretrained, random init, pixels)
    for row in summary["rows"]:
        values = [per_seed[s]["frozen_features"][row["encoder"]][row["metric"]][row["labels"]] for s in (0, 1)]
        assert row["values"] == values
        assert row["mean"] == pytest.approx(np.mean(values)) and row["std"] == pytest.approx(np.std(values, ddof=1))
    for s in (0, 1):  # the evaluation reproduces each run's own kNN report on all the labels
        knn = {e: per_seed[s]["frozen_features"][e]["knn"]["100%"] for e in ("pretrained", "random_init", "raw_pixels")}
        assert knn == {e: per_seed[s][f"knn_{e}"] for e in knn}
        assert per_seed[s]["wall_seconds"]["pretrain"] > 0
    rows = {(r["metric"], r["labels"], r["encoder"]): r for r in summary["rows"]}
    assert rows["probe", "1%", "raw_pixels"]["std"] == 0  # pixels and the labelled subset do not depend on the seed
    assert rows["knn", "100%", "pretrained"]["values"][0] != rows["knn", "100%", "pretrained"]["values"][1]
    assert json.loads((out / "summary.json").read_text()) == summary
    table = (out / "summary.md").read_text()
    assert table in printed
    cell = lambda r: f"{r['mean']:.3f} ± {r['std']:.3f} ({r['values'][0]:.3f}, {r['values'][1]:.3f})"  # noqa: E731
    expected = " | ".join(cell(rows["probe", "1%", e]) for e in ("pretrained", "random_init", "raw_pixels"))
    assert f"| 1% (10 labels) | linear probe | {expected} |" in table.splitlines()

    # --reuse_runs evaluates the finished runs again without retraining them: the same scores
    final = out / "seed_0" / "final" / "model.safetensors"
    stamp = final.stat().st_mtime_ns
    again = seeds.main(["--seeds", "0", "1", "--output_dir", str(out), "--reuse_runs", "True", *TINY])
    assert final.stat().st_mtime_ns == stamp
    assert [r["values"] for r in again["rows"]] == [r["values"] for r in summary["rows"]]
    assert again["wall_seconds"]["pretrain"] == summary["wall_seconds"]["pretrain"]


def test_seeds_rejects_bad_flags_before_any_run(seeds, tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(ValueError, match="--seed is not a flag of seeds.py: use --seeds"):
        seeds.main(["--output_dir", str(out), "--seed", "3", *TINY])
    with pytest.raises(ValueError, match="--lerning_rate"):  # an unknown pretrain.py flag
        seeds.main(["--output_dir", str(out), "--lerning_rate", "0.1", *TINY])
    with pytest.raises(ValueError, match="give one or more distinct seeds"):
        seeds.main(["--seeds", "1", "1", "--output_dir", str(out), *TINY])
    with pytest.raises(ValueError, match=r"--label_fractions: 2.0 must be in \(0, 1\]"):
        seeds.main(["--label_fractions", "0.1", "2", "--output_dir", str(out), *TINY])
    assert not out.exists()
    (out / "seed_1" / "checkpoint-100").mkdir(parents=True)  # a previous run in the second seed's folder
    with pytest.raises(FileExistsError, match="seed_1 holds a previous run"):
        seeds.main(["--seeds", "0", "1", "--output_dir", str(out), *TINY])
    assert not (out / "seed_0").exists()  # refused before the first run
