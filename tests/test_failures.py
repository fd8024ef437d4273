"""Safe numerics and clear errors on bad input: each raises before work is wasted and says what to change."""

import io
import logging
import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY
from PIL import Image
from transformers import TrainerCallback

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    NonFiniteLossError,
    SimCLRConfig,
    SimCLRModel,
    TwoViewAugmentation,
    two_view_dataset,
)


def tensor_dataset(n=32):
    x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": x.numpy()}).with_format("torch")


def args(tmp_path, **kw):
    return ContrastiveTrainingArguments(**{**dict(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                                  max_steps=2, save_strategy="no", use_cpu=True, disable_tqdm=True,
                                                  report_to="none"), **kw})


def test_nan_loss_stops_training_naming_the_step(tmp_path):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=16, **TINY))
    data = tensor_dataset()
    bad = data.to_dict()
    bad["pixel_values"][8][0][0][0] = float("nan")  # one NaN pixel in the second batch
    data = datasets.Dataset.from_dict(bad).with_format("torch")
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=3, learning_rate=0.0), train_dataset=data)
    trainer.get_train_dataloader = lambda: torch.utils.data.DataLoader(data, batch_size=8)  # fixed order
    with pytest.raises(NonFiniteLossError, match=r"Step 1: the contrastive loss is nan.*learning rate"):
        trainer.train()
    assert torch.isfinite(model.queue.keys).all()
    assert int(model.queue.valid().sum()) == 8  # only the first (finite) batch was enqueued


def test_non_finite_keys_are_never_enqueued(caplog):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=6, **TINY))
    keys = F.normalize(torch.randn(4, 16), dim=1)
    keys[1, 3] = float("inf")
    keys[2, 0] = float("nan")
    with caplog.at_level(logging.WARNING):
        model.enqueue(keys)
    assert int(model.queue_filled) == 2 and torch.isfinite(model.queue.keys).all()
    torch.testing.assert_close(model.queue.keys[:2], keys[[0, 3]])
    assert "Dropping 2 of 4 keys" in caplog.text


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch_fused"])
def test_skipped_fp16_step_does_not_move_the_key_encoder(tmp_path, optim):
    """A real fp16 ContrastiveTrainer run whose first backward overflows: the grad scaler skips that
    step, so the key encoder must not move; the second step is taken and is exactly one EMA. With a
    fused optimizer (Trainer's default) accelerate's ``step_was_skipped`` stays False, so the callback
    must see the skip from the scale's back-off. (Accelerate makes no scaler on CPU: torch's CPU
    GradScaler is given to it, the same code path as CUDA's.)"""
    m = 0.5
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_vit", queue_size=32, momentum=m, key_bn_splits=1, **TINY))
    with torch.no_grad():  # key != query, so an EMA over the unchanged query would still move the key
        for p in model.key_parameters():
            p.add_(0.5)
    k0, q0 = [p.clone() for p in model.key_parameters()], [p.clone() for p in model.query_parameters()]
    calls = []
    first = next(iter(model.encoder.parameters()))
    first.register_hook(lambda g: (calls.append(1), torch.full_like(g, math.inf) if len(calls) == 1 else g)[1])
    seen = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(([p.clone() for p in model.key_parameters()], [p.clone() for p in model.query_parameters()]))

    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=4, max_steps=2,
                                                         learning_rate=0.1, fp16=True, max_grad_norm=0.0, optim=optim),
                                 train_dataset=tensor_dataset(8), callbacks=[Snapshot()])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.train()
    (key1, query1), (key2, query2) = seen
    assert all(torch.equal(a, b) for a, b in zip(q0, query1, strict=True))  # step 1 was skipped...
    assert all(torch.equal(a, b) for a, b in zip(k0, key1, strict=True))  # ...and the key encoder stayed
    assert not all(torch.equal(a, b) for a, b in zip(q0, query2, strict=True))  # step 2 was taken
    for k, q, k2 in zip(k0, query2, key2, strict=True):  # with exactly one EMA
        torch.testing.assert_close(k2, m * k + (1 - m) * q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_loss_finite_at_temperature_001_under_autocast(dtype):
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_vit", queue_size=64, temperature=0.01, **TINY))
    model.enqueue(F.normalize(torch.randn(64, 16), dim=1))
    x1, x2 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x1, x2)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.loss)
    assert out.loss.item() > 1.0  # large logits (|s|/0.01 up to 100) handled by log-sum-exp, not overflowed


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY)), "no negatives"),
        (lambda: MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=4, **TINY)), "queue_size=4 is smaller"),
    ],
)
def test_setups_without_negatives_are_refused(tmp_path, build, match):
    batch = 1 if match == "no negatives" else 8
    with pytest.raises(ValueError, match=match):
        ContrastiveTrainer(model=build(), args=args(tmp_path, per_device_train_batch_size=batch),
                           train_dataset=tensor_dataset())


@pytest.mark.parametrize(
    "n,kw,match",
    [(10, dict(per_device_train_batch_size=32), r"0 optimizer steps.*10 samples; per_device_train_batch_size=32 x "
      r"world size 1 = 32 images per batch with dataloader_drop_last=True gives 0 batches.*"
      r"gradient_accumulation_steps=1.*at most 10"),
     (10, dict(per_device_train_batch_size=32, max_steps=-1, gradient_accumulation_steps=4), r"0 batches.*accumulation"
      r"_steps=4"),
     (32, dict(max_steps=-1, num_train_epochs=0), r"0 optimizer steps.*4 batches per epoch.*num_train_epochs > 0")],
)
def test_a_run_of_zero_optimizer_steps_is_refused_at_construction(tmp_path, n, kw, match):
    """Issue 24 item 2: 10 images at batch 32 trained 0 steps and exited as a success."""
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, **TINY))
    with pytest.raises(ValueError, match=match):
        ContrastiveTrainer(model=model, args=args(tmp_path, **kw), train_dataset=tensor_dataset(n))
    short = ContrastiveTrainer(model=model, args=args(tmp_path, per_device_train_batch_size=32,
                                                      dataloader_drop_last=False), train_dataset=tensor_dataset(10))
    assert len(short.get_train_dataloader()) == 1  # without drop_last the short batch is a step: accepted


def test_dataset_errors_name_what_is_wrong(tmp_path):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=16, **TINY))
    plain = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    with pytest.raises(ValueError, match=r"no image column.*\['text', 'label'\]"):
        two_view_dataset(plain, TwoViewAugmentation.small_images(32))
    empty = datasets.Dataset.from_dict({"image": []}, features=datasets.Features({"image": datasets.Image()}))
    with pytest.raises(ValueError, match="empty"):
        two_view_dataset(empty, TwoViewAugmentation.small_images(32))
    unviewed = datasets.Dataset.from_dict({"pixel_values": torch.zeros(16, 3, 32, 32).numpy()}).with_format("torch")
    with pytest.raises(ValueError, match=r"lacks \['pixel_values_2'\].*two_view_dataset"):
        ContrastiveTrainer(model=model, args=args(tmp_path), train_dataset=unviewed)


def test_corrupt_image_is_named_by_index():
    good = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(good, format="PNG")
    truncated = good.getvalue()[:40]  # a PNG cut off mid-file
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": good.getvalue(), "path": None}] * 3 + [{"bytes": truncated, "path": None}]},
        features=datasets.Features({"image": datasets.Image()}),
    )
    views = two_view_dataset(ds, TwoViewAugmentation.small_images(32))
    assert views.__getitems__([0, 1])[0]["pixel_values"].shape == (3, 32, 32)
    with pytest.raises(ValueError, match="Image 3 of column 'image' cannot be read"):
        views.__getitems__([1, 3, 2])


@pytest.mark.parametrize(
    "kwargs,field",
    [(dict(image_size=0), "image_size"), (dict(crop_scale=(0.8, 0.2)), "crop_scale"),
     (dict(jitter_p=1.5), "jitter_p"), (dict(crop_scale=(0.0, 1.0)), "crop_scale")],
)
def test_bad_augmentation_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TwoViewAugmentation(**kwargs)


def test_no_signal_value_is_ln_k_plus_1():
    """The loss of a model that cannot tell positives from negatives (all logits equal)."""
    q = F.normalize(torch.ones(4, 8), dim=1)
    from hf_contrast import info_nce_loss
    assert info_nce_loss(q, q, q.repeat(25, 1)[:99], 0.2).item() == pytest.approx(math.log(100), rel=1e-6)
