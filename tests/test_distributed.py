"""Real multi-process runs: ``torchrun --nproc_per_node 2`` on CPU with gloo.

Equivalence (backbone without BatchNorm, test_vit): 2 processes x N images give the same loss, the
same DDP-averaged gradients and the same MoCo queue as 1 process x 2N images; with gathering off the
SimCLR loss differs and reports 2N - 2 negatives, so the per-device bug is visible.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent / "distributed"
N_GLOBAL = 8


def torchrun(script: str, out_dir: Path, nproc: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(HERE / script), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory):
    """Rank 0's results of the 2-process run and the results of the same code on one process."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    torchrun("equivalence.py", two)
    spec = importlib.util.spec_from_file_location("equivalence", HERE / "equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(one))  # no process group: the whole batch of 2N images on one process
    return lambda name: (load_file(two / f"{name}.safetensors"), load_file(one / f"{name}.safetensors"))


def assert_grads_match(two: dict, one: dict) -> None:
    grads = [k for k in one if k.startswith("grad.")]
    assert grads and set(grads) == {k for k in two if k.startswith("grad.")}
    for k in grads:
        scale = one[k].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-5 * scale.item(), msg=k)


def test_simclr_gathered_equals_one_process(equivalence_runs):
    two, one = equivalence_runs("simclr")
    assert two["loss"].item() == pytest.approx(one["loss"].item(), rel=1e-5)
    assert int(two["num_negatives"]) == int(one["num_negatives"]) == 2 * N_GLOBAL - 2  # 2 * N * W - 2
    assert_grads_match(two, one)


def test_simclr_per_device_loss_differs_and_says_so(equivalence_runs):
    two, one = equivalence_runs("simclr_per_device")
    assert int(two["num_negatives"]) == 2 * (N_GLOBAL // 2) - 2  # 2N - 2: the count is honest
    assert int(one["num_negatives"]) == 2 * N_GLOBAL - 2  # one process: nothing to gather
    assert abs(two["loss"].item() - one["loss"].item()) > 1e-3  # the per-device loss is a different loss


def test_moco_equals_one_process_including_queue(equivalence_runs):
    two, one = equivalence_runs("moco")
    assert two["loss"].item() == pytest.approx(one["loss"].item(), rel=1e-5)
    assert int(two["num_negatives"]) == int(one["num_negatives"]) == 5  # the filled part of the queue
    assert_grads_match(two, one)
    torch.testing.assert_close(two["queue"], one["queue"], rtol=1e-5, atol=1e-6)  # all ranks' keys, rank order
    assert int(two["queue_ptr"]) == int(one["queue_ptr"]) == (5 + N_GLOBAL) % 12


def test_trainer_under_torchrun_keeps_ranks_identical(tmp_path):
    torchrun("trainer_run.py", tmp_path)
    r0, r1 = load_file(tmp_path / "moco_rank0.safetensors"), load_file(tmp_path / "moco_rank1.safetensors")
    assert set(r0) == set(r1)
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key  # queue, pointer, key and query encoders: bitwise
    assert int(r0["queue_filled"]) == 20 and int(r0["queue_ptr"]) == (6 * 4 * 2) % 20  # gathered keys: 8 per step
    assert len(set(r0["queue_ids"].tolist())) == 20 and int(r0["queue_ids"].min()) >= 0  # ids of both ranks' images
    assert any(not torch.equal(r0[f"key.{i}"], r0[f"query.{i}"]) for i in range(3))  # the EMA lags
    for method, negatives in (("moco", 20), ("simclr", 2 * 4 * 2 - 2)):
        info = [json.loads((tmp_path / f"{method}_rank{r}.json").read_text()) for r in (0, 1)]
        assert info[0]["world_size"] == 2 and info[0]["negatives_per_anchor"] == negatives
        assert info[0]["logs"][-1]["num_negatives"] == negatives
        assert info[0]["logs"] == info[1]["logs"]  # metrics are averaged across processes before logging
        last = info[0]["logs"][-1]  # throughput: the sum of both processes' rates, agreed by both
        assert last["images_per_second"] == pytest.approx(2 * last["images_per_second_per_process"], rel=1e-3)
    checkpoints = sorted(p.name for p in (tmp_path / "moco").iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints == ["checkpoint-3", "checkpoint-6"]
    assert (tmp_path / "moco" / "checkpoint-6" / "model.safetensors").exists()


def test_nan_on_one_process_stops_every_process_with_the_same_error(tmp_path):
    """Rank 1's loss turns NaN at step 2 (its head is poisoned); rank 0's stays finite. Both ranks must
    raise NonFiniteLossError for step 2 naming process 1, not die in the next collective. The guard reads its
    device-side record at logging steps (every 3 here): both stop at step 3."""
    torchrun("nan_run.py", tmp_path)
    info = [json.loads((tmp_path / f"nan_rank{r}.json").read_text()) for r in (0, 1)]
    for r, rank_info in enumerate(info):
        assert rank_info["error"] is not None, f"rank {r} did not raise NonFiniteLossError"
        assert rank_info["error"].startswith("Step 2: the contrastive loss is "), rank_info["error"]
        assert "(not finite on process 1 of 2)" in rank_info["error"]
        assert rank_info["step"] == 3
    assert "loss is finite here" in info[0]["error"] and "loss is nan" in info[1]["error"]
