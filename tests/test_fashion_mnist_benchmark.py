"""benchmarks/fashion_mnist.py --quick: the benchmark's whole path (pretrain.py, export, AutoModel features,
kNN and probes, fine-tuning in transformers, baselines, summary) on a 2,000-image subset, and its resume."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from hf_contrast.data.idx_dataset import FASHION_MNIST_DIR

ROOT = Path(__file__).parents[1]
PRESENT = os.path.isfile(os.path.join(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz"))
pytestmark = pytest.mark.skipif(
    not PRESENT and not os.environ.get("HF_CONTRAST_REQUIRE_FASHION_MNIST"),  # .ci/run installs it and sets this
    reason=f"Fashion-MNIST not installed in {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist)")


@pytest.fixture(scope="module")
def benchmark(pretrain):
    spec = importlib.util.spec_from_file_location("fashion_mnist_benchmark", ROOT / "benchmarks" / "fashion_mnist.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fashion_mnist_benchmark"] = module
    spec.loader.exec_module(module)
    return module


def test_quick_benchmark_end_to_end_and_resume(benchmark, tmp_path, capsys):
    summary = benchmark.main(["--quick", "--output_dir", str(tmp_path)])
    runs = tmp_path / "results" / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["moco_s0", "random_init", "raw_pixels", "supervised"]
    moco = json.loads((runs / "moco_s0" / "result.json").read_text())
    random_init = json.loads((runs / "random_init" / "result.json").read_text())
    raw = json.loads((runs / "raw_pixels" / "result.json").read_text())
    for row in (moco, random_init, raw):
        assert set(row["knn"]) == set(row["probe"]) == {"1%", "10%", "100%"}
        assert all(0.0 <= v <= 1.0 for metric in ("knn", "probe") for v in row[metric].values())
    assert moco["knn"]["100%"] > random_init["knn"]["100%"]  # pretraining learned something on its subset
    assert {"1%", "10%"} <= set(moco["finetune"]) and {"1%", "10%"} <= set(random_init["finetune"])
    assert moco["pretrain_minutes"] > 0 and moco["images_per_second"] > 0 and moco["epochs"] == pytest.approx(3)
    assert 0 < moco["validation_knn"] <= 1 and moco["pretrain_flags"][:2] == ["--method", "moco"]
    assert (runs / "moco_s0" / "model_card.md").exists() and (runs / "moco_s0" / "training_curves.png").exists()
    supervised = json.loads((runs / "supervised" / "result.json").read_text())
    assert 0.1 < supervised["accuracy"] <= 1  # above chance after one epoch on 2,000 labels
    assert summary["rows"]["moco"]["knn 100%"][0] == pytest.approx(moco["knn"]["100%"])
    assert "| raw_pixels |" in (tmp_path / "results" / "summary.md").read_text()
    # the 1% subset: 2 labels per class of the 2,000 images, the same for every row
    assert len(benchmark.balanced_subset(benchmark.Data(benchmark.parse(["--quick"])).train_y, 0.01)) == 20
    capsys.readouterr()

    again = benchmark.main(["--quick", "--output_dir", str(tmp_path)])  # resumable: every row is skipped
    assert capsys.readouterr().out.count("finished earlier") == 4
    assert again["rows"] == summary["rows"]

    # recipe choices are scored on pretrain.py's own validation split, never on the test set
    validation = benchmark.main(["--quick", "--output_dir", str(tmp_path), "--validate", "moco_s0", "raw_pixels"])
    assert set(validation) == {"moco_s0", "raw_pixels"} and set(validation["moco_s0"]["knn"]) == {"1%", "10%", "100%"}
    assert validation["moco_s0"]["flags"][:2] == ["--method", "moco"]
    assert json.loads((tmp_path / "results" / "validation.json").read_text()) == validation
    data = benchmark.Data(benchmark.parse(["--quick"]), validation=True)
    test = benchmark.Data(benchmark.parse(["--quick"]))
    assert not set(data.test["image"][i].tobytes() for i in range(50)) & set(test.test["image"][i].tobytes()
                                                                            for i in range(50))


def test_sweep_configurations():
    """The queue-or-batch sweep: five queues and three SimCLR batches on the headline recipe, whose length the
    time budget replaces; SimCLR's learning rate scales with its batch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fashion_mnist_sweep as sweep
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    configs = sweep.configurations()
    assert list(configs) == ["queue_256", "queue_1024", "queue_4096", "queue_16384", "queue_65536",
                             "simclr_batch_128", "simclr_batch_256", "simclr_batch_512"]
    assert configs["simclr_batch_512"][-1] == "0.12" and sweep.batch_of(configs["simclr_batch_512"]) == 512
    assert sweep.batch_of(configs["queue_4096"]) == 256
    assert "--num_train_epochs" not in sweep.SWEEP_RECIPE and "--knn_every_n_steps" not in sweep.SWEEP_RECIPE
    assert sweep.SWEEP_RECIPE == ["--image_size", "48", "--crop_min_scale", "0.2", "--horizontal_flip", "--temperature",
                                  "0.2"]


def test_sweep_curve_leaves_out_the_knn_monitor_time():
    """The plot's x axis is training time alone: a logging window holding a kNN evaluation (a fifth of the rate)
    does not stretch it, where spreading train_runtime over the steps would."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fashion_mnist_sweep as sweep
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    history = [{"images_per_second": 256.0, "step": 10}, {"images_per_second": 51.2, "step": 20},
               {"knn_top1": 0.7, "step": 20}, {"images_per_second": 256.0, "step": 30}, {"knn_top1": 0.8, "step": 30}]
    record = dict(batch=128, curve=[(40.0, 0.7), (60.0, 0.8)])
    out = sweep.with_training_curve(record, history)
    assert out["seconds_per_step"] == 0.5  # 128 images at the median 256 images/s
    assert out["training_curve"] == [(10.0, 0.7), (15.0, 0.8)]
    assert out["curve"] == record["curve"]


def test_unknown_row_is_refused(benchmark, tmp_path):
    with pytest.raises(SystemExit, match="--only mocov4: not a row; the rows are moco_s0, raw_pixels"):
        benchmark.main(["--quick", "--output_dir", str(tmp_path), "--only", "mocov4"])


def options(flags: list[str]) -> dict[str, str | bool]:
    """``["--a", "1", "--flag", "--b", "2"]`` -> ``{"--a": "1", "--flag": True, "--b": "2"}``."""
    out = {}
    for i, f in enumerate(flags):
        if f.startswith("--"):
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else True
            assert f not in out, f"{f} given twice"
            out[f] = value
    return out


def test_headline_rows_train_for_equal_time_and_match_the_recorded_run(benchmark):
    """Each method gets the epochs that fill ~30 minutes (MoCo 9, SimCLR 6, MoCo v3 4), every flag once, and the
    MoCo row is exactly the recipe that produced the committed seed-0 result."""
    runs = benchmark.pretrain_runs(quick=False)
    assert list(runs) == ["moco_s0", "simclr_s0", "mocov3_s0", "moco_s1", "simclr_s1", "moco_s2", "simclr_s2"]
    epochs = {name: options(flags)["--num_train_epochs"] for name, flags in runs.items()}
    assert epochs == {"moco_s0": "9", "simclr_s0": "6", "mocov3_s0": "5", "moco_s1": "9", "simclr_s1": "6",
                      "moco_s2": "9", "simclr_s2": "6"}
    recorded = json.loads((ROOT / "results" / "fashion_mnist" / "runs" / "moco_s0" / "result.json").read_text())
    assert options(runs["moco_s0"]) == options(recorded["pretrain_flags"])
    assert options(runs["simclr_s2"])["--method"] == "simclr" and options(runs["simclr_s2"])["--seed"] == "2"
