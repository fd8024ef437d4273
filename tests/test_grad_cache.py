"""Gradient-cached SimCLR: the same gradients as the full batch (no BatchNorm), on one process and on
two under torchrun, inside ContrastiveTrainer with gradient accumulation, with stochastic depth."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import TINY
from safetensors.torch import load_file

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    SimCLRConfig,
    SimCLRModel,
    nt_xent_logits,
)
from hf_contrast.trainer.grad_cache import grad_cache_step

HERE = Path(__file__).parent / "distributed"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster than two spin-waiting on shared, loaded cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def simclr(backbone="test_vit", **kw) -> SimCLRModel:
    torch.manual_seed(0)
    kw.setdefault("projection_batch_norm", False)
    return SimCLRModel(SimCLRConfig(backbone=backbone, **TINY, **kw))


def views(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randn(n, 3, 32, 32, generator=g)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert got.keys() == want.keys() and want
    for k in want:
        scale = want[k].abs().max().clamp_min(1e-12).item()
        torch.testing.assert_close(got[k], want[k], rtol=rel, atol=rel * scale, msg=k)


def test_config_field_is_validated_and_saved(tmp_path):
    assert SimCLRConfig(backbone="test_vit").grad_cache_chunk_size is None
    for bad in (0, -2, 2.5, "4", True):
        with pytest.raises(
            ValueError, match=r"grad_cache_chunk_size=.* must be None \(off\) or an integer >= 1"
        ):
            SimCLRConfig(backbone="test_vit", grad_cache_chunk_size=bad)
    SimCLRConfig(backbone="test_vit", grad_cache_chunk_size=64).save_pretrained(tmp_path)
    assert SimCLRConfig.from_pretrained(tmp_path).grad_cache_chunk_size == 64


@pytest.mark.parametrize("chunk_size", [3, 8])
def test_cached_gradients_equal_full_batch(chunk_size):
    x1, x2 = views(8)
    plain = simclr()
    out = plain(x1, x2)
    out.loss.backward()
    cached = simclr()
    got = grad_cache_step(cached, x1, x2, chunk_size, loss_scale=0.5)
    assert got.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert got.num_negatives == out.num_negatives == 2 * 8 - 2
    torch.testing.assert_close(got.logits, out.logits.detach(), rtol=1e-5, atol=1e-5)
    assert_grads_close(
        grads(cached), {k: 0.5 * g for k, g in grads(plain).items()}
    )  # loss_scale scales the gradients


def test_stochastic_depth_replays_pass_one_randomness():
    """With drop path, pass 2 must see pass 1's masks: the reference runs the same chunks with grad
    from the same seed and keeps their graphs (what caching must reproduce without keeping them)."""
    x1, x2 = views(6)
    kw = dict(backbone_kwargs={"drop_path_rate": 0.5, "proj_drop_rate": 0.3})
    ref = simclr(**kw)
    torch.manual_seed(5)
    z = torch.cat(
        [
            ref(x1[c], x2[c], return_loss=False).embeddings.unflatten(0, (2, -1))
            for c in (slice(0, 4), slice(4, 6))
        ],
        dim=1,
    )  # (2, N, D): views x images
    after_ref = torch.rand(3)
    torch.nn.functional.cross_entropy(*nt_xent_logits(z[0], z[1], ref.config.temperature)).backward()
    with torch.no_grad():
        assert not torch.allclose(z[0], ref(x1, x2, return_loss=False).embeddings[:6])  # the masks are random

    cached = simclr(**kw)
    torch.manual_seed(5)
    grad_cache_step(cached, x1, x2, chunk_size=4)
    assert torch.equal(torch.rand(3), after_ref)  # the step consumed the RNG like one pass
    assert_grads_close(grads(cached), grads(ref))


def test_batch_norm_warns_and_updates_running_stats_once_per_chunk():
    x1, x2 = views(8)
    ref = simclr("test_resnet", projection_batch_norm=True)
    for c in (slice(0, 4), slice(4, 8)):
        ref(x1[c], x2[c])  # what the running statistics should see: each chunk once, in train mode
    cached = simclr("test_resnet", projection_batch_norm=True)
    with pytest.warns(UserWarning, match=r"BatchNorm layers .* normalised with its own statistics"):
        grad_cache_step(cached, x1, x2, chunk_size=4)
    for (name, b), b_ref in zip(cached.named_buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(b, b_ref, msg=name)


def test_on_loss_runs_before_any_backward():
    x1, x2 = views(4)
    x1[0] = float("nan")
    model = simclr()

    def refuse(outputs):
        assert not torch.isfinite(outputs.loss) and outputs.num_negatives == 6
        raise FloatingPointError("non-finite loss")

    with pytest.raises(FloatingPointError):
        grad_cache_step(model, x1, x2, chunk_size=2, on_loss=refuse)
    assert all(p.grad is None for p in model.parameters())  # nothing was back-propagated


def test_bf16_autocast_close_to_plain_autocast():
    x1, x2 = views(8)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    plain = simclr()
    with autocast():
        out = plain(x1, x2)
    out.loss.backward()
    cached = simclr()
    got = grad_cache_step(cached, x1, x2, chunk_size=3, autocast=autocast)
    assert got.embeddings.dtype == torch.bfloat16 and got.logits.dtype == torch.float32
    assert got.loss.item() == pytest.approx(out.loss.item(), rel=1e-2)
    want, have = grads(plain), grads(cached)
    have_flat = torch.cat([g.flatten() for g in have.values()])
    want_flat = torch.cat([g.flatten() for g in want.values()])
    cos = torch.nn.functional.cosine_similarity(have_flat, want_flat, dim=0)
    ratio = have_flat.norm() / want_flat.norm()
    assert cos > 0.99  # bf16 rounding differs between batch shapes; the gradient is the same one
    assert ratio == pytest.approx(1.0, abs=0.01)  # same scale too (cosine alone would pass a 2x gradient)


def tensor_dataset(n=32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 3, 32, 32, generator=g)
    ds = datasets.Dataset.from_dict(
        {"pixel_values": x.numpy(), "pixel_values_2": (x + 0.3 * torch.randn_like(x)).numpy()}
    )
    return ds.with_format("torch")


def train(tmp_path, chunk_size):
    model = simclr(grad_cache_chunk_size=chunk_size)
    args = ContrastiveTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.01,
        max_grad_norm=0.0,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        report_to="none",
    )
    trainer = ContrastiveTrainer(model=model, args=args, train_dataset=tensor_dataset())
    trainer.train()
    return model, [h for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_accumulation_matches_uncached_trainer(tmp_path):
    plain, plain_logs = train(tmp_path / "plain", None)
    cached, cached_logs = train(tmp_path / "cached", 3)
    for (name, p), q in zip(cached.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert len(cached_logs) == len(plain_logs) == 2
    for got, want in zip(cached_logs, plain_logs, strict=True):
        assert got["num_negatives"] == want["num_negatives"] == 14  # 2N - 2 with N = 8 images per micro-batch
        for key in ("loss", "contrastive_top1", "pos_cosine", "neg_cosine", "embedding_std"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-4), key


def test_two_processes_equal_one_process_full_batch(tmp_path):
    """torchrun, 2 gloo processes x 4 images, chunks of 3 + 1: the DDP-averaged cached gradients equal one
    process's plain gradients over all 8 images; DDP all-reduces once (after the last chunk), and a
    cached ContrastiveTrainer run with accumulation ends at the uncached run's weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RANK", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "grad_cache_run.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    two = load_file(tmp_path / "grad_cache.safetensors")

    spec = importlib.util.spec_from_file_location("grad_cache_run", HERE / "grad_cache_run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    x1, x2 = run.global_batch()
    model = run.build()
    out = model(x1, x2)  # one process, the whole batch, no caching
    out.loss.backward()

    assert two["loss"].item() == pytest.approx(out.loss.item(), rel=1e-5)
    assert int(two["num_negatives"]) == out.num_negatives == 2 * run.N_GLOBAL - 2  # gathered: 2 * N * W - 2
    assert_grads_close({k[5:]: v for k, v in two.items() if k.startswith("grad.")}, grads(model))
    assert (
        int(two["cached_allreduce_calls"]) == int(two["plain_allreduce_calls"]) >= 1
    )  # no all-reduce per chunk
    cached = {k[7:]: v for k, v in two.items() if k.startswith("cached.")}
    plain = {k[6:]: v for k, v in two.items() if k.startswith("plain.")}
    assert_grads_close(cached, plain)  # weights after 2 steps of 2 micro-batches, DDP through accelerate
    assert not torch.equal(plain["projector.0.weight"], model.projector[0].weight)  # training moved them


def test_rng_replay_uses_the_inputs_device_not_the_current_one(monkeypatch):
    """Inputs on ``cuda:1`` while the current device is ``cuda:0``: the replayed generator must be cuda:1's.
    No machine here has two accelerators, so the device module is a stand-in that keeps one state per
    device index (the only fake in this file; the CUDA path itself runs in benchmarks/gpu_check.py)."""
    from hf_contrast.trainer.grad_cache import RngState

    class TwoDevices:
        states = {0: torch.tensor([0]), 1: torch.tensor([1])}

        def get_rng_state(self, device="cuda"):
            return self.states[torch.device(device).index or 0].clone()

        def set_rng_state(self, state, device="cuda"):
            self.states[torch.device(device).index or 0] = state.clone()

    fake = TwoDevices()
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    saved = RngState(torch.device("cuda", 1))
    assert int(saved.accelerator) == 1  # captured from the inputs' device
    fake.states[1] = torch.tensor([7])  # the chunk's forward advanced cuda:1's generator
    with saved.replay():
        assert int(fake.states[1]) == 1 and int(fake.states[0]) == 0  # cuda:1 replayed, cuda:0 untouched
    assert int(fake.states[1]) == 7  # and restored afterwards
