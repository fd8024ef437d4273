"""A setup mistake on the command line: ``SCRIPT: error: --flag ...`` and exit 2, as argparse does for an unknown
flag, with no traceback; library callers of ``main`` keep the exception, and errors out of the training loop keep
their traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_contrast.cli import flag_names, make_parser, run_main
from hf_contrast.trainer.arguments import ContrastiveTrainingArguments

REPO = Path(__file__).resolve().parents[1]
TINY = ["--backbone", "test_resnet", "--max_train_samples", "32", "--per_device_train_batch_size", "16",
        "--dataloader_num_workers", "0", "--report_to", "none"]


def script(name: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "training" / name), *argv], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=300)


def test_a_config_mistake_prints_the_flag_and_exits_2(tmp_path):
    out = tmp_path / "o"
    run = script("pretrain.py", *TINY, "--queue_size", "0", "--output_dir", str(out))
    assert run.returncode == 2, run.stderr[-2000:]
    first = run.stderr.strip().splitlines()
    assert first[0].startswith("pretrain.py: error: --queue_size 0 is invalid"), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and len(first) <= 3 and not out.exists()  # the message alone; nothing written
    shown = script("pretrain.py", *TINY, "--queue_size", "0", "--output_dir", str(out),
                   env={"HF_CONTRAST_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback" in shown.stderr and "queue_size=0 is invalid" in shown.stderr


def test_a_used_output_dir_and_a_bad_backbone_read_as_flags(tmp_path):
    (tmp_path / "o" / "checkpoint-3").mkdir(parents=True)
    run = script("pretrain.py", *TINY, "--output_dir", str(tmp_path / "o"))
    assert run.returncode == 2 and run.stderr.startswith(f"pretrain.py: error: --output_dir {tmp_path / 'o'} holds")
    run = script("pretrain.py", *TINY, "--backbone", "resnet_18", "--output_dir", str(tmp_path / "b"))
    assert run.returncode == 2 and run.stderr.startswith("pretrain.py: error: --backbone resnet_18 is not a timm model")


def test_flag_names_spells_known_fields_only():
    flags = {"queue_size", "backbone", "image_size"}
    assert flag_names("queue_size=0 is invalid: it must be >= 1.", flags) == "--queue_size 0 is invalid: it must be >= 1."
    assert flag_names("backbone='resnet_18' is not a timm model", flags) == "--backbone resnet_18 is not a timm model"
    assert flag_names("image_size=30, not a multiple of 16", flags) == "--image_size 30, not a multiple of 16"
    assert flag_names("k=5 and queue_size=64.", flags) == "k=5 and --queue_size 64."  # k is not a flag


def test_library_callers_keep_the_exception_and_training_errors_keep_the_traceback(capsys):
    parser = make_parser((ContrastiveTrainingArguments,))

    def setup_mistake(argv):
        raise ValueError("learning_rate=-1 must be positive")

    with pytest.raises(SystemExit) as exit_:
        run_main(setup_mistake, parser)
    assert exit_.value.code == 2
    assert "error: --learning_rate -1 must be positive" in capsys.readouterr().err

    def _inner_training_loop():  # the name of transformers' loop: an error raised inside it is not a setup mistake
        raise ValueError("learning_rate=-1 mid-run")

    with pytest.raises(ValueError, match="mid-run"):
        run_main(lambda argv: _inner_training_loop(), parser)
