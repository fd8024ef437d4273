"""training/pretrain.py end to end on the embedded digits, shrunk to seconds with a tiny backbone."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "training" / "pretrain.py"


@pytest.fixture(scope="module")
def pretrain():
    spec = importlib.util.spec_from_file_location("pretrain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pretrain"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_pretrain_runs_and_reports(pretrain, tmp_path, capsys):
    results = pretrain.main([
        "--backbone", "test_resnet", "--projection_hidden_dim", "32", "--max_train_samples", "256",
        "--num_train_epochs", "4", "--per_device_train_batch_size", "16", "--queue_size", "128",
        "--output_dir", str(tmp_path), "--save_strategy", "no", "--knn_k", "20", "--disable_tqdm", "True",
        "--dataloader_num_workers", "0", "--knn_every_n_steps", "8", "--logging_steps", "4",
        "--eval_strategy", "steps", "--eval_steps", "8",
    ])
    out = capsys.readouterr().out
    for row in ("kNN top-1, pretrained encoder", "raw pixels", "ln(K+1)"):
        assert row in out
    assert results["knn_pretrained"] > results["knn_random_init"] + 0.05 and results["knn_raw_pixels"] > 0.8  # raw: ~0.9
    assert results["eval_loss"] < results["no_signal_loss"] and 0.0 < results["eval_contrastive_top1"] <= 1.0
    assert results["no_signal_loss"] == pytest.approx(math.log(129))
    assert results["final_loss"] < results["no_signal_loss"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert (tmp_path / "encoder" / "training_curves.png").exists()
    card = (tmp_path / "encoder" / "README.md").read_text()
    assert "`knn_top1`" in card  # the online kNN monitor ran and its value reached the model card


def test_pretrain_rejects_unknown_method(pretrain, tmp_path):
    with pytest.raises(ValueError, match="method='byol' is invalid"):
        pretrain.main(["--method", "byol", "--output_dir", str(tmp_path), "--max_train_samples", "64"])
