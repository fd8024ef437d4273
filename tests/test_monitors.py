import datasets
import pytest
import torch
from conftest import TINY
from transformers import TrainerCallback

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    KNNMonitor,
    MoCoConfig,
    MoCoModel,
    QueueConsistencyMonitor,
    RepresentationMonitor,
    TwoViewAugmentation,
    alignment,
    eval_dataset,
    key_consistency,
    knn_accuracy,
    two_view_dataset,
    uniformity,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models at batch 8 gain nothing from a second thread, and on loaded cores two threads
    spin against each other (measured: 8 MoCo steps 11.8 s with 2 threads, 2.7 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tensor_dataset(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    x2 = x + 0.3 * torch.randn(x.shape, generator=g)
    ds = datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": x2.numpy()})
    return ds.with_format("torch")


def moco(backbone="test_resnet", **kw):
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone=backbone, queue_size=32, **{**TINY, **kw}))


def trainer_for(model, tmp_path, n=64, **kw):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=1,
                    save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                    learning_rate=0.1, logging_steps=100, report_to=[], optim="sgd")
    return ContrastiveTrainer(model=model, args=ContrastiveTrainingArguments(**{**defaults, **kw}),
                              train_dataset=tensor_dataset(n))


class KeyBatchSpy(TrainerCallback):
    """Records every key batch the trainer enqueues, by optimizer step."""

    def __init__(self):
        self.batches = {}

    def on_enqueue(self, model, key_pixel_values, keys, state):
        self.batches[state.global_step] = (key_pixel_values.clone(), keys.clone())


class ModeSpy(TrainerCallback):
    """Records the model's train/eval mode at every step end (add it after the monitors)."""

    def __init__(self):
        self.modes = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.modes.append(model.training)


def logged(trainer, key):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("key_bn_splits", [1, 4])
def test_identical_key_and_query_encoders_give_consistency_one_and_drift_zero(tmp_path, key_bn_splits):
    """lr 0 and m 0: the key encoder stays equal to the query encoder, so every stored key is
    reproduced exactly, with a BatchNorm backbone and head, if the batch is re-encoded the way it was
    encoded. With 4 random BN sub-batches re-encoding cannot reproduce the split: below 1."""
    model = moco(momentum=0.0, projection_batch_norm=True, projection_output_batch_norm=True,
                 key_bn_splits=key_bn_splits)
    trainer = trainer_for(model, tmp_path, learning_rate=0.0, weight_decay=0.0)
    monitor = QueueConsistencyMonitor(every_n_steps=4).attach(trainer)
    trainer.train()
    assert monitor.ages == [1, 2, 3, 4]  # queue 32 / 8 keys per step: the queue spans 4 steps
    last = monitor.history[-1]
    assert last["step"] == 8 and last["key_drift"] == 0.0
    for age in (1, 2, 3, 4):
        if key_bn_splits == 1:
            assert last[f"queue_consistency_age{age}"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert last[f"queue_consistency_age{age}"] < 0.999
    assert [s for s, _ in logged(trainer, "queue_consistency")] == [4, 8]
    assert monitor.records.keys() <= {5, 6, 7}  # bounded: what later measurements still need, no more


def test_consistency_per_age_matches_a_direct_computation(tmp_path):
    """LayerNorm model (no BatchNorm anywhere), m 0.5: the logged consistency of age a at the last
    step equals the cosine between the keys enqueued at step T - a and the same images re-encoded by
    the final key encoder; neighbouring ages give different values, so an off-by-one would fail."""
    model = moco("test_vit", momentum=0.5)
    trainer = trainer_for(model, tmp_path, learning_rate=0.5)
    spy = KeyBatchSpy()
    trainer.add_callback(spy)
    monitor = QueueConsistencyMonitor(every_n_steps=3, ages=[1, 3]).attach(trainer)
    trainer.train()
    last = monitor.history[-1]
    assert last["step"] == 8  # the last step is always measured, though 8 % 3 != 0

    def direct(enqueue_step):
        images, keys = spy.batches[enqueue_step]
        with torch.no_grad():
            fresh = model.key_projector(model.key_encoder(images))
        return key_consistency(keys, fresh)

    expected = {age: direct(8 - age) for age in (1, 3)}
    for age in (1, 3):
        assert last[f"queue_consistency_age{age}"] == pytest.approx(expected[age], abs=1e-5)
        assert abs(direct(8 - age - 1) - expected[age]) > 1e-3  # the test tells steps apart
    assert expected[1] > expected[3]  # older keys agree less
    assert last["queue_consistency"] == pytest.approx((expected[1] + expected[3]) / 2, abs=1e-5)
    pairs = list(zip(model.key_parameters(), model.query_parameters(), strict=True))
    diff = torch.cat([(k - q).flatten() for k, q in pairs])  # (P,) all parameters
    drift = diff.norm() / torch.cat([q.flatten() for _, q in pairs]).norm()
    assert last["key_drift"] == pytest.approx(drift.item(), rel=1e-3) and last["key_drift"] > 0


def test_known_drift_of_a_constructed_perturbation(tmp_path):
    """lr 0 and m 1: nothing moves, so a key side set to 1.1 x the query side stays at drift 0.1."""
    model = moco(momentum=1.0)
    with torch.no_grad():
        for k, q in zip(model.key_parameters(), model.query_parameters(), strict=True):
            k.copy_(1.1 * q)
    trainer = trainer_for(model, tmp_path, n=16, learning_rate=0.0, weight_decay=0.0)
    monitor = QueueConsistencyMonitor(every_n_steps=1).attach(trainer)
    trainer.train()
    assert [h["key_drift"] for h in monitor.history] == pytest.approx([0.1, 0.1], rel=1e-4)


def test_monitors_do_not_change_training(tmp_path):
    """BN running stats, train mode and the RNG are restored: same weights and buffers with or without."""
    def run(with_monitors):
        held_out = tensor_dataset(16, seed=1)  # (before the trainer: it draws from the global RNG)
        model = moco(momentum=0.9, projection_batch_norm=True, key_bn_splits=2)
        trainer = trainer_for(model, tmp_path / str(with_monitors), n=32)
        if with_monitors:
            QueueConsistencyMonitor(every_n_steps=2).attach(trainer)
            RepresentationMonitor(held_out, every_n_steps=3, num_samples=16).attach(trainer)
        trainer.train()
        return model.state_dict()

    plain, monitored = run(False), run(True)
    for name, tensor in plain.items():
        torch.testing.assert_close(monitored[name], tensor, rtol=0, atol=0, msg=name)


def test_knn_monitor_logs_knn_accuracy_computed_directly(tmp_path, digits):
    aug = TwoViewAugmentation.small_images(32)
    bank = eval_dataset(digits["train"].select(range(200)), aug)
    held_out = eval_dataset(digits["test"].select(range(100)), aug)
    model = moco(momentum=0.9)
    trainer = trainer_for(model, tmp_path, n=48, learning_rate=0.2, logging_steps=2)
    KNNMonitor(bank, held_out, every_n_steps=4, k=20, cache_inputs=True).attach(trainer)
    spy = ModeSpy()
    trainer.add_callback(spy)  # runs after the monitor at every step
    trainer.train()
    entries = logged(trainer, "knn_top1")
    assert [s for s, _ in entries] == [4, 6]  # every 4 steps, and the last step
    assert entries[-1][1] == knn_accuracy(model.encoder, bank, held_out, k=20)
    assert spy.modes == [True] * 6
    assert [s for s, _ in logged(trainer, "loss")] == [2, 4, 6]  # the training logs survive the monitor's


def test_representation_monitor_matches_direct_formulas(tmp_path):
    model = moco(momentum=0.9, projection_batch_norm=True)
    trainer = trainer_for(model, tmp_path, n=16)
    held_out = tensor_dataset(40, seed=1)
    monitor = RepresentationMonitor(held_out, every_n_steps=1, num_samples=32, batch_size=16)
    monitor.attach(trainer)
    spy = ModeSpy()
    trainer.add_callback(spy)
    trainer.train()
    assert spy.modes == [True, True]
    v1, v2 = monitor.views
    assert v1.shape == (32, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        z1, z2 = model.projector(model.encoder(v1)), model.projector(model.encoder(v2))
    last = monitor.history[-1]
    assert last["alignment"] == pytest.approx(alignment(z1, z2), abs=1e-4)
    assert last["uniformity"] == pytest.approx((uniformity(z1) + uniformity(z2)) / 2, abs=1e-4)
    zn = torch.nn.functional.normalize(z1, dim=1)
    assert last["heldout_embedding_std"] == pytest.approx(zn.std(0).mean().item(), abs=1e-5)
    assert [s for s, _ in logged(trainer, "uniformity")] == [1, 2]


def test_two_view_dataset_feeds_the_representation_monitor(tmp_path, digits):
    views = two_view_dataset(digits["test"].select(range(24)), TwoViewAugmentation.small_images(32))
    monitor = RepresentationMonitor(views, num_samples=20, batch_size=8, seed=3)
    with torch.random.fork_rng():
        a = monitor._draw_views()
        b = monitor._draw_views()
    assert a[0].shape == (20, 3, 32, 32) and torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1])


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps=0"):
        QueueConsistencyMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="ages"):
        QueueConsistencyMonitor(ages=[0, 2])
    with pytest.raises(ValueError, match="temperature"):
        KNNMonitor([], [], temperature=0)
    with pytest.raises(ValueError, match="num_samples"):
        RepresentationMonitor([], num_samples=1)
    model = moco()
    trainer = trainer_for(model, tmp_path, n=8)
    trainer.add_callback(QueueConsistencyMonitor())  # not attached: nothing to log through
    with pytest.raises(ValueError, match=r"attach\(trainer\)"):
        trainer.train()
