"""The training step as the GPU needs it: no host-device sync on non-logging steps, a non-finite loss
still caught (at the next logging step or save, naming the step), channels_last end to end, and
throughput in every training log."""

import os

import datasets
import pytest
import torch
from conftest import TINY
from transformers import TrainerCallback

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    MoCoV3Config,
    MoCoV3Model,
    NonFiniteLossError,
    SimCLRConfig,
    SimCLRModel,
)
from hf_contrast.trainer.throughput import ThroughputMeter


def tensor_dataset(n=64, nan_at=None):
    x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    if nan_at is not None:
        x[nan_at, 0, 0, 0] = float("nan")
    ds = datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": (x + 0.1).numpy(),
                                     "instance_id": torch.arange(n).numpy()})
    return ds.with_format("torch")


def args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4, save_strategy="no",
                    use_cpu=True, disable_tqdm=True, seed=0, report_to="none", optim="sgd", learning_rate=0.01)
    return ContrastiveTrainingArguments(**{**defaults, **kw})


MODELS = {
    "moco": lambda: MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, key_bn_splits=2, **TINY)),
    "moco_fnc": lambda: MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, false_negatives="eliminate",
                                             **TINY)),
    "mocov3": lambda: MoCoV3Model(MoCoV3Config(backbone="test_resnet", **TINY)),
    "mocov3_queue": lambda: MoCoV3Model(MoCoV3Config(backbone="test_resnet", queue_size=64, **TINY)),
    "simclr": lambda: SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY)),
}


class ProfileOneStep(TrainerCallback):
    """Profiles the whole of optimizer step ``step`` (forward, backward, clip, optimizer, EMA, enqueue)."""

    def __init__(self, step):
        self.step, self.prof, self.events = step, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None and self.events is None:
            self.prof.__exit__(None, None, None)
            self.events = [e.name for e in self.prof.events()]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_non_logging_step_reads_nothing_on_the_host(tmp_path, name):
    """``aten::_local_scalar_dense`` is what every ``.item()``, ``int()``/``float()``/``bool()`` of a
    tensor, ``.tolist()`` and ``nonzero`` runs: on a GPU each one waits for the device. Before this
    change the trainer's finiteness check (2 per micro-batch) and transformers' ``logging_nan_inf_filter``
    (2 more) made four in every step."""
    probe = ProfileOneStep(step=2)
    trainer = ContrastiveTrainer(model=MODELS[name](), args=args(tmp_path, logging_steps=10),
                                 train_dataset=tensor_dataset(), callbacks=[probe])
    trainer.train()
    assert probe.events, "the step was not profiled"
    assert any("convolution" in e for e in probe.events)  # the profile saw the model's step
    syncs = [e for e in probe.events if e in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")]
    assert syncs == []


def test_nan_is_reported_at_the_next_save_naming_its_step_and_never_checkpointed(tmp_path):
    model = MODELS["moco"]()
    data = tensor_dataset(nan_at=9)  # a NaN pixel in the second batch: optimizer step 1
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=6, logging_steps=5, save_strategy="steps",
                                                        save_steps=3, learning_rate=0.0), train_dataset=data)
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=8)  # fixed order
    with pytest.raises(NonFiniteLossError, match=r"Step 1: the contrastive loss is nan.*learning rate"):
        trainer.train()
    assert trainer.state.global_step == 3  # found at the first save after the bad step, not at the end
    assert not os.path.exists(tmp_path / "checkpoint-3")  # no checkpoint holds weights of the bad step or later
    assert torch.isfinite(model.queue.keys).all()
    # the first (finite) batch's 8 keys entered; the bad step's keys and every later step's did not
    assert torch.equal(model.queue.instance_ids[:8], torch.arange(8))
    assert (model.queue.instance_ids[8:] == -1).all()


def test_nan_is_reported_at_the_next_logging_step(tmp_path):
    model = MODELS["simclr"]()
    data = tensor_dataset(nan_at=17)  # optimizer step 2
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=8, logging_steps=4), train_dataset=data)
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=8)
    with pytest.raises(NonFiniteLossError, match=r"Step 2: the contrastive loss is nan"):
        trainer.train()
    assert trainer.state.global_step == 4
    with pytest.raises(NonFiniteLossError):  # nor can the user save the damaged weights afterwards
        trainer.save_model(str(tmp_path / "final"))


@pytest.mark.parametrize("name", ["moco", "simclr"])
def test_channels_last_runs_the_model_and_the_views_in_nhwc(tmp_path, name):
    model = MODELS[name]()
    seen = []
    conv = next(m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_pre_hook(lambda m, inp: seen.append(inp[0].is_contiguous(memory_format=torch.channels_last)))
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, channels_last=True, max_steps=2),
                                 train_dataset=tensor_dataset())
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):  # query and key side
            assert m.weight.is_contiguous(memory_format=torch.channels_last)
    trainer.train()
    assert seen and all(seen)  # every conv input of the query encoder in NHWC
    trainer.save_model(str(tmp_path / "final"))  # safetensors of NHWC weights
    loaded = type(model).from_pretrained(str(tmp_path / "final"))
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_channels_last_default_is_off_on_cpu_and_false_turns_it_off(tmp_path):
    model = MODELS["moco"]()
    assert not ContrastiveTrainer(model=model, args=args(tmp_path), train_dataset=tensor_dataset()).channels_last
    assert not ContrastiveTrainer(model=model, args=args(tmp_path, channels_last=False),
                                  train_dataset=tensor_dataset()).channels_last
    conv = next(m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d))
    assert not conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_throughput_is_in_every_training_log(tmp_path):
    trainer = ContrastiveTrainer(model=MODELS["moco"](), args=args(tmp_path, max_steps=6, logging_steps=2),
                                 train_dataset=tensor_dataset())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        assert h["images_per_second"] > 0
        assert h["images_per_second"] == h["images_per_second_per_process"]  # one process
        assert 0 <= h["data_wait_fraction"] <= 1


def test_throughput_meter_counts_images_and_waiting_per_window(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("hf_contrast.trainer.throughput.time.perf_counter", lambda: clock[0])
    meter = ThroughputMeter()
    meter.reset()
    for _ in range(5):  # 5 batches of 32 images: 0.1 s waiting for each, 0.3 s of compute
        meter.fetched(0.1, 32)
        clock[0] += 0.4
    # 160 images in 2.0 s of wall time, 0.5 s of it waiting
    assert meter.read_and_reset() == {"images_per_second": 80.0, "images_per_second_per_process": 80.0,
                                      "data_wait_fraction": 0.25}
    clock[0] += 1.0
    meter.fetched(0.0, 10)
    assert meter.read_and_reset()["images_per_second_per_process"] == 10.0  # a new window
    assert meter.read_and_reset() == {}  # nothing fetched
