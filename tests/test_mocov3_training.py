"""MoCo v3 in ContrastiveTrainer: the momentum trajectory equals the official update-inside-forward
order, checkpoints round-trip strictly (momentum side included), monitors accept or refuse it."""

import datasets
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hf_contrast import (
    CheckpointError,
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    KNNMonitor,
    MoCoV3Config,
    MoCoV3Model,
    QueueConsistencyMonitor,
    RepresentationMonitor,
    knn_accuracy,
    momentum_at,
    negatives_per_anchor,
)

HEADS = dict(projection_hidden_dim=32, projection_dim=16, predictor_hidden_dim=24, image_size=32)


def build(backbone="test_resnet", **kw) -> MoCoV3Model:
    torch.manual_seed(0)
    return MoCoV3Model(MoCoV3Config.for_backbone(backbone, **{**HEADS, **kw}))


def tensor_dataset(n=64, seed=0, labels=False, ids=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    data = {"pixel_values": x.numpy(), "pixel_values_2": (x + 0.1 * torch.randn_like(x)).numpy()}
    if labels:
        data["labels"] = (torch.arange(n) % 4).numpy()
    if ids:
        data["instance_id"] = torch.arange(n).numpy()
    return datasets.Dataset.from_dict(data).with_format("torch")


def args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, save_strategy="no", use_cpu=True,
                    disable_tqdm=True, seed=0, dataloader_num_workers=0, learning_rate=0.05, report_to="none",
                    logging_steps=1)
    return ContrastiveTrainingArguments(**{**defaults, **kw})


class Recorder:
    """Snapshots of the query side and the momentum side at the start of every forward."""

    def __init__(self, model):
        self.query, self.key = [], []
        model.register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        self.query.append([p.detach().clone() for p in module.query_parameters()])
        self.key.append([p.detach().clone() for p in module.key_parameters()])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_momentum_trajectory_equals_the_official_order(tmp_path, accumulation):
    """Official moco-v3: iteration i starts with theta_k <- m_i theta_k + (1 - m_i) theta_q(i), with
    m_i the cosine schedule at i and theta_q(i) the query weights after i optimizer steps, then makes
    the keys. Recomputed here from the query weights the real run had, the momentum encoder must be
    the one every forward of the trainer used (both micro-batches of a step see the same one)."""
    model = build(momentum=0.5)
    rec = Recorder(model)
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=5, gradient_accumulation_steps=accumulation),
                                 train_dataset=tensor_dataset(80))
    trainer.train()
    steps = trainer.state.global_step
    assert steps == 5 and len(rec.query) == 5 * accumulation
    theta_k = [p.clone() for p in rec.key[0]]  # the initial copy of the query side
    for i in range(steps):
        m = momentum_at(i, steps, 0.5, "cosine")
        theta_q = rec.query[i * accumulation]
        theta_k = [m * k + (1 - m) * q for k, q in zip(theta_k, theta_q, strict=True)]  # official, start of iteration i
        for j in range(accumulation):
            for got, want in zip(rec.key[i * accumulation + j], theta_k, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(rec.key[-1], rec.query[-1], strict=True))  # it lags
    assert trainer.momentum_callback.last_momentum == 1.0  # the update after the last step changes nothing
    for got, want in zip(model.key_parameters(), theta_k, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    logs = [h for h in trainer.state.log_history if "num_negatives" in h]
    assert logs and all(h["num_negatives"] == 7 for h in logs)  # N - 1 on one process
    assert logs[0]["momentum"] == pytest.approx(momentum_at(1, steps, 0.5, "cosine"))


def test_predictor_and_query_side_trained_momentum_side_not(tmp_path):
    model = build()
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=1), train_dataset=tensor_dataset(8))
    trainer.create_optimizer()
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in model.key_parameters()}
    assert {id(p) for p in [*model.query_parameters(), *model.predictor.parameters()]} == in_optimizer
    with pytest.raises(ValueError, match="no negatives"):
        ContrastiveTrainer(model=build(), args=args(tmp_path, per_device_train_batch_size=1),
                           train_dataset=tensor_dataset(8))


def final_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("queue_size", [0, 40])
def test_checkpoint_round_trip_is_strict_and_exact(tmp_path, queue_size):
    """Resuming at step 2 of 4 ends bitwise where the uninterrupted run ends; with a queue (40 slots, 16
    keys a step: it wraps) the queue, its ids, entry steps and host-side pointer come back too."""
    common = dict(max_steps=4, save_strategy="steps", save_steps=2)
    ref_model = build(queue_size=queue_size)
    ContrastiveTrainer(model=ref_model, args=args(tmp_path / "ref", **common),
                       train_dataset=tensor_dataset(64, ids=True)).train()
    reference = final_state(ref_model)

    model = build(queue_size=queue_size)
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path / "resumed", **common),
                                 train_dataset=tensor_dataset(64, ids=True))
    trainer.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-2"))
    state = final_state(model)
    assert set(state) == set(reference) and any(k.startswith("momentum_encoder.") for k in state)
    for k in reference:
        assert torch.equal(state[k], reference[k]), k  # momentum side, BatchNorm statistics, predictor: bitwise
    assert any(k.startswith("queue.") for k in state) == (queue_size > 0)
    if queue_size:
        assert (model.queue.pointer, model.queue_filled) == (ref_model.queue.pointer, 40) == (64 % 40, 40)
        assert set(model.queue.instance_ids.tolist()) <= set(range(64)) and model.queue.entry_steps.max() == 3

    checkpoint = tmp_path / "ref" / "checkpoint-2"
    weights = load_file(checkpoint / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("momentum_projector.")},
              checkpoint / "model.safetensors")
    trainer = ContrastiveTrainer(model=build(), args=args(tmp_path / "broken", **common),
                                 train_dataset=tensor_dataset(64))
    with pytest.raises(CheckpointError, match=r"missing: momentum_projector \(\d+ tensors\)"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_queue_monitor_refuses_knn_and_representation_monitors_work(tmp_path):
    model = build("test_vit")
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=tensor_dataset(16))
    with pytest.raises(ValueError, match="MoCo v3.*has no queue.*KNNMonitor"):
        QueueConsistencyMonitor(every_n_steps=1).attach(trainer)
    labelled = tensor_dataset(32, seed=3, labels=True)
    knn = KNNMonitor(labelled, labelled, every_n_steps=2, k=5).attach(trainer)
    rep = RepresentationMonitor(labelled, every_n_steps=2, num_samples=16).attach(trainer)
    trainer.train()
    assert knn.history and knn.history[-1]["step"] == 2  # the monitor's figure is the encoder's, recomputed here
    assert knn.history[-1]["knn_top1"] == pytest.approx(knn_accuracy(model.encoder.eval(), labelled, labelled, k=5),
                                                        abs=1e-4)
    assert rep.history and rep.history[-1]["heldout_embedding_std"] > 0
    assert any("knn_top1" in h for h in trainer.state.log_history)


def test_export_loads_without_hf_contrast_and_card_states_the_negatives(digits, tmp_path):
    """The query encoder of a trained MoCo v3 (ResNet with BatchNorm; ViT with its frozen patch
    projection) exports in timm format; timm and transformers load it with hf_contrast not imported
    and give its features; the card says where the N*W - 1 negatives come from."""
    from test_hub_export import AUGMENTATION, expected_features, run_loaders, train_tiny

    from hf_contrast import export_encoder

    exports, expected = {}, {}
    for backbone in ("test_resnet", "test_vit"):
        tmp = tmp_path / backbone
        tmp.mkdir()
        model = build(backbone)
        trainer = train_tiny(model, digits, tmp, steps=1, batch_size=16)
        exports[backbone] = export_encoder(trainer, tmp / "encoder", augmentation=AUGMENTATION)
        expected[backbone] = expected_features(model.encoder, digits, tmp)
        weights = load_file(exports[backbone] / "model.safetensors")
        assert weights.keys() == model.encoder.state_dict().keys()  # query encoder only
        momentum = model.momentum_encoder.state_dict()
        assert any(not torch.equal(weights[k], momentum[k]) for k in weights)  # not the momentum side
    meta, out = run_loaders(exports, tmp_path)
    assert meta["hf_contrast_imported"] is False
    for name, ref in expected.items():
        for loader in ("timm", "auto", "classifier_features", "pipeline"):
            want = ref["features_images"] if loader == "pipeline" else ref["features_x"]
            torch.testing.assert_close(out[f"{name}/{loader}"], want, atol=1e-5, rtol=0, msg=f"{name}/{loader}")
    card = (exports["test_resnet"] / "README.md").read_text()
    assert "# MoCo v3 test_resnet encoder" in card
    assert "**15 negatives**: in-batch keys of the momentum encoder, gathered over W processes: N*W - 1 negatives" in card
    assert "N = 16 images per device and W = 1 process(es)" in card
    assert "| negatives per anchor | 15 |" in card and "| queue | none" in card
    assert "0.99 (cosine schedule, to 1.0 at the last step)" in card and "predictor 2-layer MLP 24-16" in card


def test_cancellation_trains_and_logs_the_count_after_cancellation(tmp_path):
    """In the trainer, v3 with false_negatives logs num_negatives = N - 1 - top_k (batch 8, top 3)."""
    model = build(false_negatives="eliminate", false_negative_top_k=3)
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=tensor_dataset(16))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["num_negatives"] == 8 - 1 - 3 for h in logs)


def test_queue_is_enqueued_once_per_step_with_both_views_and_counted(tmp_path):
    """queue_size > 0: after each step the trainer enqueues 2N keys (view 2, then view 1, with their ids)
    once; the logged num_negatives is N - 1 + the fill the step saw, queue_fill the fill after it."""
    model = build(queue_size=64)
    enqueued = []
    original = model.enqueue
    model.enqueue = lambda keys, ids=None, **kw: (enqueued.append((keys.clone(), ids.clone())), original(keys, ids, **kw))
    trainer = ContrastiveTrainer(model=model, args=args(tmp_path, max_steps=2), train_dataset=tensor_dataset(64, ids=True))
    trainer.train()
    assert len(enqueued) == 2 and all(k.shape == (16, 16) and i.shape == (16,) for k, i in enqueued)
    assert (model.queue.pointer, model.queue_filled) == (32, 32)
    for step, (keys, ids) in enumerate(enqueued):
        assert torch.equal(ids[:8], ids[8:]) and len(set(ids[:8].tolist())) == 8  # the same 8 images, two views
        torch.testing.assert_close(model.queue.keys[16 * step : 16 * (step + 1)], F.normalize(keys, dim=1))
        assert torch.equal(model.queue.instance_ids[16 * step : 16 * (step + 1)], ids)
    assert model.queue.entry_steps[:32].tolist() == [0] * 16 + [1] * 16
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["num_negatives"] for h in logs] == [8 - 1 + 0, 8 - 1 + 16]  # first step: empty queue
    assert [h["queue_fill"] for h in logs] == [16 / 64, 32 / 64]
    assert negatives_per_anchor(model.config, 8) == 8 - 1 + 64 == trainer.negatives_per_anchor()
    with pytest.raises(ValueError, match=r"queue_size=12 is smaller than the 16 keys .* x 2 views\) of MoCo v3"):
        ContrastiveTrainer(model=build(queue_size=12), args=args(tmp_path), train_dataset=tensor_dataset(16))
    with pytest.raises(ValueError, match="MoCo v3 model does not queue as is"):
        QueueConsistencyMonitor(every_n_steps=1).attach(trainer)


def test_pretrain_script_queue_size_defaults_per_method(pretrain):
    """``--queue_size`` unset: 0 (no queue) for mocov3, 2048 for moco; ``--queue_size K`` gives v3 a queue."""
    common = dict(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, predictor_hidden_dim=24)
    assert pretrain.build_model(pretrain.ModelArguments(method="mocov3", **common), 32).config.queue_size == 0
    assert not pretrain.build_model(pretrain.ModelArguments(method="mocov3", **common), 32).has_queue
    queued = pretrain.build_model(pretrain.ModelArguments(method="mocov3", queue_size=64, **common), 32)
    assert queued.has_queue and queued.queue.keys.shape == (64, 16) and queued.config.exclude_same_instance
    assert pretrain.build_model(pretrain.ModelArguments(method="moco", **common), 32).config.queue_size == 2048
