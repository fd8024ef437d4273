"""``ContrastiveTrainer.evaluate`` / ``predict``: contrastive metrics on held-out pairs, no logits kept,
nothing of the training state touched; ``predict`` returns the encoder's features."""

import pytest
import torch
from conftest import TINY

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    SimCLRConfig,
    SimCLRModel,
    TwoViewAugmentation,
    eval_dataset,
    two_view_dataset,
)
from hf_contrast.data import DIGITS_MEAN, DIGITS_STD

AUG = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), mean=DIGITS_MEAN, std=DIGITS_STD)


def trainer_for(model, digits, tmp_path, **kw):
    args = ContrastiveTrainingArguments(**{**dict(
        output_dir=str(tmp_path), per_device_train_batch_size=16, per_device_eval_batch_size=16, max_steps=3,
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, report_to="none", learning_rate=0.05,
        logging_steps=1), **kw})
    return ContrastiveTrainer(model=model, args=args, train_dataset=two_view_dataset(digits["train"].select(range(48)), AUG),
                              eval_dataset=two_view_dataset(digits["test"].select(range(40)), AUG, seed=1))


def reference_eval(model, dataset, batch_size=16):
    """The mean loss and top-1 over the eval batches, computed directly with the model in eval mode."""
    model.eval()
    losses, hits, pos = [], [], []
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            items = dataset.__getitems__(list(range(start, min(start + batch_size, len(dataset)))))
            out = model(pixel_values=torch.stack([i["pixel_values"] for i in items]),
                        pixel_values_2=torch.stack([i["pixel_values_2"] for i in items]))
            losses.append(out.loss)
            hits.append((out.logits.argmax(1) == out.labels).float().mean())
            rows = torch.arange(len(out.labels))
            pos.append(out.logits[rows, out.labels].mean() * model.config.temperature)  # mean cosine to positive
    return torch.stack(losses), torch.stack(hits), torch.stack(pos)


@pytest.mark.parametrize("method", ["moco", "simclr"])
def test_evaluate_returns_contrastive_metrics_and_leaves_training_state(tmp_path, digits, method):
    model = (MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, **TINY)) if method == "moco"
             else SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY)))
    trainer = trainer_for(model, digits, tmp_path)
    trainer.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    metrics = trainer.evaluate()
    after = model.state_dict()
    for k, v in before.items():  # queue, pointer, key encoder, BatchNorm statistics: bitwise unchanged
        assert torch.equal(v, after[k]), k
    assert torch.equal(rng, torch.get_rng_state())  # no shuffle drawn: training's RNG stream is not moved

    losses, hits, pos = reference_eval(model, trainer.eval_dataset)
    # Trainer's eval_loss is the mean over samples of per-batch losses repeated per sample (40 = 16+16+8)
    weights = torch.tensor([16.0, 16.0, 8.0])
    assert metrics["eval_loss"] == pytest.approx(float((losses * weights).sum() / weights.sum()), rel=1e-5)
    assert metrics["eval_contrastive_top1"] == pytest.approx(round(float(hits.mean()), 4), abs=1e-4)
    assert {"eval_pos_cosine", "eval_neg_cosine", "eval_embedding_std", "eval_num_negatives"} <= set(metrics)
    assert metrics["eval_num_negatives"] == (3 * 16 if method == "moco" else 2 * 8 - 2)  # queue after 3 steps; last batch 8
    assert metrics["eval_pos_cosine"] == pytest.approx(round(float(pos.mean()), 4), abs=1e-4)


def test_evaluate_keeps_no_logits(tmp_path, digits):
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, **TINY))
    trainer = trainer_for(model, digits, tmp_path)
    loader = trainer.get_eval_dataloader()
    output = trainer.evaluation_loop(loader, "Evaluation", prediction_loss_only=True)
    assert output.predictions is None and output.label_ids is None
    assert output.metrics["eval_num_negatives"] == 0  # an empty queue before training: honest count


def test_predict_returns_encoder_features(tmp_path, digits):
    model = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    trainer = trainer_for(model, digits, tmp_path)
    test = eval_dataset(digits["test"].select(range(20)), AUG)
    out = trainer.predict(test)
    model.eval()
    with torch.no_grad():
        expected = model.encoder(torch.stack([test[i]["pixel_values"] for i in range(20)]))
    assert out.predictions.shape == (20, model.encoder.num_features)
    torch.testing.assert_close(torch.as_tensor(out.predictions), expected, rtol=1e-5, atol=1e-5)


def test_eval_strategy_steps_during_training_logs_eval_metrics_and_matches_an_uninterrupted_run(tmp_path, digits):
    """Evaluating every step must not change training: same weights as a run without evaluation."""
    runs = {}
    for name, kw in (("plain", {}), ("eval", dict(eval_strategy="steps", eval_steps=1))):
        torch.manual_seed(0)
        model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, **TINY))
        trainer = trainer_for(model, digits, tmp_path / name, **kw)
        trainer.train()
        runs[name] = (model.state_dict(), trainer.state.log_history)
    for k, v in runs["plain"][0].items():
        assert torch.equal(v, runs["eval"][0][k]), k
    evals = [h for h in runs["eval"][1] if "eval_loss" in h]
    assert len(evals) == 3 and all("eval_contrastive_top1" in h for h in evals)
    assert not any("eval_loss" in h for h in runs["plain"][1])

