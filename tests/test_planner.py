"""The memory planner: a short probe of the real backbone predicts the measured peak of a real SimCLR
step 4x larger (or at a larger image) within 25%, and the recommendation follows from the numbers."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

from hf_contrast import SimCLRConfig, SimCLRModel, peak_memory_bytes, probe_activation_memory
from hf_contrast.memory_probe import ActivationProbe, training_state_bytes

spec = importlib.util.spec_from_file_location(
    "training_plan", Path(__file__).parents[1] / "training" / "plan.py"
)
plan = sys.modules["training_plan"] = importlib.util.module_from_spec(
    spec
)  # dataclasses look their module up
spec.loader.exec_module(plan)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster than two spin-waiting on shared, loaded cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def measured_simclr_peak(backbone: str, image_size: int, images: int) -> int:
    """Peak bytes of a real SimCLR forward + NT-Xent + backward (weights and their zeroed gradients
    already allocated, as from the second training step on)."""
    torch.manual_seed(0)
    model = SimCLRModel(SimCLRConfig(backbone=backbone, **{**TINY, "image_size": image_size}))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x1, x2 = torch.randn(2, images, 3, image_size, image_size)  # (N, 3, H, W) each
    return peak_memory_bytes(lambda: model(x1, x2).loss.backward())


@pytest.mark.parametrize(
    ("backbone", "image_size", "probe_image_size"),
    [("test_resnet", 32, None), ("test_vit", 32, None), ("resnet18", 32, None), ("resnet18", 64, 32)],
)
def test_probe_predicts_a_larger_simclr_step_within_25_percent(backbone, image_size, probe_image_size):
    probe = probe_activation_memory(
        backbone,
        image_size,
        probe_image_size=probe_image_size,
        projection_hidden_dim=TINY["projection_hidden_dim"],
        projection_dim=TINY["projection_dim"],
    )
    images = 2 * probe.probe_views[1]  # 2N views: 4x the probe's larger batch
    predicted = (
        probe.fixed_bytes + plan.simclr_activation_bytes(probe, images) + plan.input_bytes(probe, 2 * images)
    )  # SimCLRModel concatenates the views: one more input copy
    measured = measured_simclr_peak(backbone, image_size, images)
    assert predicted == pytest.approx(measured, rel=0.25), (predicted / 2**20, measured / 2**20)
    assert probe.per_view_bytes > 0 and probe.num_params > 0


def resnet50_like() -> ActivationProbe:
    return ActivationProbe(
        "resnet50", 224, 224, (2, 4), num_params=28_000_000, per_view_bytes=81 * 2**20, fixed_bytes=1e8
    )


def run(target, memory_gb=80.0, devices=8, **kw):
    return plan.plan(
        resnet50_like(),
        num_devices=devices,
        device_memory_bytes=memory_gb * 1e9,
        target_negatives=target,
        **kw,
    )


def by_name(plans):
    return {p.name.split(" (")[0].split(", gathered over")[0]: p for p in plans}


def test_65536_negatives_on_8_gpus_recommends_moco_and_counts_its_memory():
    plans, choice, reason = run(65536)
    assert choice.startswith("MoCo") and "global SimCLR batch of 32,776" in reason
    p = by_name(plans)
    assert p["MoCo"].negatives == 65536 and p["MoCo"].batch_per_device == 32
    assert p["MoCo"].extra_bytes == 28_000_000 * 4 + 65536 * 128 * 4  # key encoder + queue (32 MiB)
    assert p["SimCLR"].negatives == 2 * 4097 * 8 - 2 >= 65536  # gathered: 2 N W - 2
    assert p["SimCLR, per device"].negatives == 2 * 32769 - 2
    assert all(q.state_bytes == training_state_bytes(28_000_000, "sgd") == 28_000_000 * 12 for q in plans)


def test_recommends_gathered_when_it_fits_and_cached_when_only_a_chunk_fits():
    _, choice, _ = run(4094)  # global batch 2,048: 256 per device, about 41 GiB
    assert choice.startswith("SimCLR, gathered over 8")
    plans, choice, reason = run(16382)  # 1,024 per device: too big; chunks fit
    assert choice == "SimCLR, gathered + grad cache" and "BatchNorm" in reason
    cached = by_name(plans)["SimCLR, gathered + grad cache"]
    assert cached.total_bytes <= 0.9 * 80e9 < by_name(plans)["SimCLR"].total_bytes
    assert 1 <= cached.chunk < cached.batch_per_device == 1024
    _, choice, _ = run(4094, memory_gb=0.1)
    assert choice == "none"


def test_cli_prints_table_and_recommendation(capsys):
    text = plan.main(
        [
            "--backbone",
            "test_vit",
            "--image_size",
            "32",
            "--device_memory_gb",
            "1",
            "--num_devices",
            "2",
            "--target_negatives",
            "510",
            "--optimizer",
            "adamw",
        ]
    )
    assert "Recommendation: SimCLR, gathered over 2" in text and "MoCo (queue 510, dim 128)" in text
    with pytest.raises(SystemExit):
        plan.main(["--num_devices", "0"])
    assert "--num_devices=0 is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's prefix matching would read it as --num_devices
        plan.main(["--num_dev", "2"])
    assert "unrecognized arguments: --num_dev" in capsys.readouterr().err


def test_predict_step_is_the_plan_of_one_device():
    """The GPU check compares ``predict_step`` with a measured step: it must give the bytes ``plan``
    prints for the same batch on one device (the same formulas), and refuse unknown methods."""
    probe = resnet50_like()
    plans = by_name(run(16382, devices=1, memory_gb=200.0)[0])
    cached, moco = plans["SimCLR, gathered + grad cache"], plans["MoCo"]
    got = plan.predict_step(probe, "simclr_cached", cached.batch_per_device, chunk=cached.chunk)
    assert got.total_bytes == cached.total_bytes and got.negatives == cached.negatives
    got = plan.predict_step(probe, "moco", moco.batch_per_device, queue_size=16382)
    assert got.total_bytes == moco.total_bytes
    got = plan.predict_step(probe, "simclr", 256)
    assert got.activation_bytes == 512 * probe.per_view_bytes + 4 * 4.0 * 512 * 512  # views + 4 logits copies
    with pytest.raises(ValueError, match="method='byol' is invalid"):
        plan.predict_step(probe, "byol", 8)
    with pytest.raises(ValueError, match="chunk=None is invalid"):
        plan.predict_step(probe, "simclr_cached", 8)
