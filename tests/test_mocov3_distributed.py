"""MoCo v3 across processes (``torchrun --nproc_per_node 2``, gloo, CPU): keys gathered without
gradient, queries local, labels offset by rank give the loss and the DDP gradients of one process
with the full batch (also with a pre-filled queue); with gathering off each query sees only its
device's N - 1 keys."""

import importlib.util

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import HERE, assert_grads_match, torchrun

N_GLOBAL = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    torchrun("mocov3_run.py", two)
    spec = importlib.util.spec_from_file_location("mocov3_run", HERE / "mocov3_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(one))  # no process group: the whole batch on one process
    return lambda name: (load_file(two / f"{name}.safetensors"), load_file(one / f"{name}.safetensors"))


def test_gathered_keys_equal_one_process_with_the_full_batch(runs):
    two, one = runs("mocov3")
    assert two["loss"].item() == pytest.approx(one["loss"].item(), rel=1e-5)
    assert int(two["num_negatives"]) == int(one["num_negatives"]) == N_GLOBAL - 1  # N * W - 1
    assert_grads_match(two, one)
    assert "grad.predictor.0.weight" in one and not any(k.startswith("grad.momentum_") for k in one)
    assert "grad.encoder.patch_embed.proj.weight" not in one  # frozen patch projection (ViT recipe)


def test_per_device_negatives_are_visible_when_gathering_is_off(runs):
    two, one = runs("mocov3_per_device")
    assert int(two["num_negatives"]) == N_GLOBAL // 2 - 1  # N - 1: the count is honest
    assert int(one["num_negatives"]) == N_GLOBAL - 1
    assert abs(two["loss"].item() - one["loss"].item()) > 1e-3  # a different loss
    grads = [k for k in one if k.startswith("grad.")]
    assert any(not torch.allclose(two[k], one[k], rtol=1e-3, atol=1e-6) for k in grads)


def test_false_negative_cancellation_over_gathered_keys_equals_one_process(runs):
    two, one = runs("mocov3_attract")  # candidates are the gathered keys of both ranks
    assert two["loss"].item() == pytest.approx(one["loss"].item(), rel=1e-5)
    assert float(two["num_negatives"]) == float(one["num_negatives"]) == N_GLOBAL - 1 - 2  # top 2 taken
    assert_grads_match(two, one)
    plain, _ = runs("mocov3")
    assert abs(two["loss"].item() - plain["loss"].item()) > 1e-4  # attraction changed the loss


def test_prefilled_queue_over_gathered_keys_equals_one_process(runs):
    two, one = runs("mocov3_queue")  # 10 queued keys; images 1 and 5 each have one queued key, masked
    assert two["loss"].item() == pytest.approx(one["loss"].item(), rel=1e-5)
    assert float(two["num_negatives"]) == float(one["num_negatives"]) == pytest.approx(N_GLOBAL - 1 + 10 - 2 / 8)
    assert_grads_match(two, one)
    plain, _ = runs("mocov3")
    assert abs(two["loss"].item() - plain["loss"].item()) > 1e-3  # the queue entered the loss
