"""Exact resume past the first epoch (augmentation seeded by epoch), with DataLoader workers and
under ``torchrun --nproc_per_node 2``: the run stopped one step into epoch 2 and resumed ends
bitwise equal to the uninterrupted run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "resume" / "epoch_run.py"


def load_script():
    spec = importlib.util.spec_from_file_location("epoch_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_bitwise_equal(out: Path, rank: int = 0) -> None:
    full, resumed = load_file(out / f"full_rank{rank}.safetensors"), load_file(out / f"resumed_rank{rank}.safetensors")
    assert set(full) == set(resumed)
    different = [k for k in full if not torch.equal(full[k], resumed[k])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_in_epoch_2_is_exact(tmp_path, workers):
    load_script().main(str(tmp_path), workers)
    assert_bitwise_equal(tmp_path)


def test_resume_in_epoch_2_is_exact_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           str(tmp_path), "--workers", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        assert_bitwise_equal(tmp_path, rank)
    a, b = load_file(tmp_path / "full_rank0.safetensors"), load_file(tmp_path / "full_rank1.safetensors")
    shared = [k for k in a if "running_" not in k and "num_batches" not in k]  # weights, queue: equal on all ranks
    assert "queue" in shared and "queue_ids" in shared and all(torch.equal(a[k], b[k]) for k in shared)
    assert any(not torch.equal(a[k], b[k]) for k in a if "running_mean" in k)  # each rank's own BN statistics
