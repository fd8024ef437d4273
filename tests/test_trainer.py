import logging
import math

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
    SimCLRConfig,
    SimCLRModel,
    TwoViewAugmentation,
    momentum_at,
    two_view_dataset,
)


def tensor_dataset(n=64, seed=0):
    """A plain datasets.Dataset whose items hold pixel_values and pixel_values_2 tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    ds = datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": (x + 0.1 * torch.randn_like(x)).numpy()})
    return ds.with_format("torch")


def args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=1, save_strategy="no",
                    use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return ContrastiveTrainingArguments(**{**defaults, **kw})


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_one_ema_per_optimizer_step_under_accumulation(tmp_path, schedule):
    """With learning rate 0 the query weights stay put, so after S optimizer steps the key weights
    are exactly q + prod(m_t) * (k0 - q); one EMA per micro-batch would give the square of that."""
    torch.manual_seed(0)
    m = 0.5
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=40, momentum=m, momentum_schedule=schedule, **TINY))
    with torch.no_grad():
        for p in model.key_parameters():
            p.add_(torch.randn_like(p))
    q0 = [p.clone() for p in model.query_parameters()]
    k0 = [p.clone() for p in model.key_parameters()]
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, learning_rate=0.0, weight_decay=0.0,
                                                         gradient_accumulation_steps=2, lr_scheduler_type="constant"),
                                 train_dataset=tensor_dataset(64))

    class CountEnqueues(TrainerCallback):
        sizes: list = []

        def on_enqueue(self, keys, **kwargs):
            self.sizes.append(keys.shape[0])

    counter = CountEnqueues()
    trainer.add_callback(counter)
    trainer.train()
    steps = trainer.state.global_step
    assert steps == 4  # 64 images / (8 per micro-batch * 2 micro-batches)
    factor = math.prod(momentum_at(s, steps, m, schedule) for s in range(steps))
    for q, q_before in zip(model.query_parameters(), q0, strict=False):
        assert torch.equal(q, q_before)
    for k, k_before, q in zip(model.key_parameters(), k0, q0, strict=False):
        torch.testing.assert_close(k, q + factor * (k_before - q), rtol=1e-5, atol=1e-6)
    assert counter.sizes == [8] * 8  # one enqueue per micro-batch (not per optimizer step), of 8 keys
    # a queue of 40 tells the counts apart: 64 keys -> full, pointer 24 (32 keys would leave it at 32 of 40)
    assert int(model.queue_filled) == 40 and int(model.queue_ptr) == (8 * 8) % 40


def test_key_encoder_never_in_optimizer(tmp_path):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=16, **TINY))
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path), train_dataset=tensor_dataset(16))
    trainer.create_optimizer()
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in model.key_parameters()}
    assert {id(p) for p in model.query_parameters()} == in_optimizer


@pytest.mark.parametrize("method", ["moco", "simclr"])
def test_short_training_run_learns_and_logs_true_counts(tmp_path, digits, method):
    torch.manual_seed(0)
    if method == "moco":
        model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=96, momentum=0.9, key_bn_splits=1,
                                     projection_batch_norm=True, projection_output_batch_norm=True, **TINY))
    else:
        model = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    train = two_view_dataset(digits["train"].select(range(256)), TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1)))
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=32, num_train_epochs=6,
                                                         learning_rate=0.05, logging_steps=8), train_dataset=train)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 6
    for key in ("contrastive_top1", "pos_cosine", "neg_cosine", "embedding_std", "num_negatives", "learning_rate"):
        assert key in logs[-1]
    if method == "moco":
        assert logs[-1]["num_negatives"] == 96 and logs[-1]["queue_fill"] == 1.0 and logs[-1]["momentum"] == 0.9
    else:
        assert logs[-1]["num_negatives"] == 2 * 32 - 2
    assert logs[-1]["loss"] < logs[1]["loss"] - 0.1  # the loss goes down
    margin = [h["pos_cosine"] - h["neg_cosine"] for h in logs]
    assert margin[-1] > margin[1] + 0.1  # views of one image move together, apart from the others
    if method == "simclr":  # (MoCo's top-1 is noisy here: its keys change as the key encoder catches up)
        assert logs[-1]["contrastive_top1"] > logs[1]["contrastive_top1"]
    assert logs[-1]["pos_cosine"] > logs[-1]["neg_cosine"]


def test_simclr_with_accumulation_warns_once(tmp_path, caplog):
    model = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    with caplog.at_level(logging.WARNING, logger="hf_contrast.trainer"):
        ContrastiveTrainer(model=model, args=args(tmp_path, gradient_accumulation_steps=4), train_dataset=tensor_dataset(16))
    messages = [r.getMessage() for r in caplog.records if "does not add negatives" in r.getMessage()]
    assert len(messages) == 1 and "each anchor still has 14 negatives" in messages[0]  # 2 * 8 * 1 - 2


def test_no_signal_is_detected_and_reported(tmp_path, caplog):
    """Temperature 100 makes every logit about 0: the loss sits at ln(K+1), which must be reported."""
    model = SimCLRModel(SimCLRConfig(backbone="test_resnet", temperature=100.0, **TINY))
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, learning_rate=0.0, logging_steps=1),
                                 train_dataset=tensor_dataset(32))
    with caplog.at_level(logging.WARNING, logger="hf_contrast.trainer"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs[-1]["loss"] == pytest.approx(math.log(15), rel=5e-3)  # 2N-2 = 14 negatives + 1 positive
    assert any("no learning signal" in r.getMessage() and "ln(K+1)" in r.getMessage() for r in caplog.records)


def test_trainer_rejects_other_models(tmp_path):
    with pytest.raises(ValueError, match="needs a contrastive model .a ContrastivePreTrainedModel.*got Linear"):
        ContrastiveTrainer(model=torch.nn.Linear(2, 2), args=args(tmp_path))


def test_sharded_training_is_refused_with_a_reason(tmp_path, monkeypatch):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=16, **TINY))
    training_args = args(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` with an FSDP config sets
    with pytest.raises(ValueError, match="FSDP or DeepSpeed.*EMA"):
        ContrastiveTrainer(model=model, args=training_args, train_dataset=tensor_dataset(16))
