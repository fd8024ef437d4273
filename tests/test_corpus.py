"""Know your corpus: the false-negative estimate against a simulation of reshuffled epochs, the
warning at training start and the planner's line."""

import importlib.util
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_contrast.models.corpus import false_negative_estimate
from hf_contrast.trainer.checks import warn_narrow_corpus

spec = importlib.util.spec_from_file_location("training_plan_corpus", Path(__file__).parents[1] / "training" / "plan.py")
plan = sys.modules["training_plan_corpus"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)


def simulate(k, n, epochs=12, seed=0, keys_per_image=1):
    """A FIFO queue of the K newest keys over reshuffled epochs of N images (each image enqueuing
    ``keys_per_image`` keys at once): the share of anchors whose own earlier key is queued, and the
    mean number of such keys, measured."""
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.repeat(rng.permutation(n), keys_per_image) for _ in range(epochs)])
    hits, counts = [], []
    for t in range(keys_per_image * 3 * n + k, len(stream), keys_per_image):  # t: the anchor's first key
        window = stream[t - k:t]
        c = int((window == stream[t]).sum())
        hits.append(c > 0)
        counts.append(c)
    return float(np.mean(hits)), float(np.mean(counts))


@pytest.mark.parametrize("k,n", [(100, 400), (300, 400), (600, 400), (1000, 400)])
def test_own_key_probability_matches_a_simulation(k, n):
    est = false_negative_estimate(k, n, num_classes=10)
    prob, keys = simulate(k, n)
    assert est.own_image_probability == pytest.approx(prob, abs=0.02)
    assert est.own_image_keys == pytest.approx(keys, abs=0.03)
    assert est.same_class == k / 10 and est.fraction == k / n
    if k <= n:
        assert est.own_image_probability == k * k / (2 * n * n)


@pytest.mark.parametrize("k,n", [(300, 400), (1000, 400)])
def test_two_keys_per_image_match_a_simulation(k, n):
    """Both views enqueued (symmetric loss, MoCo v3's queue): the queue spans K/2 images, two keys each."""
    est = false_negative_estimate(k, n, num_classes=10, keys_per_image=2)
    prob, keys = simulate(k, n, keys_per_image=2)
    assert est.own_image_probability == pytest.approx(prob, abs=0.02)
    assert est.own_image_keys == pytest.approx(keys, abs=0.05)
    one = false_negative_estimate(k, n, num_classes=10)
    assert est.own_image_probability < one.own_image_probability and est.same_class == one.same_class == k / 10
    assert "(K/2)^2/2N^2: both views are queued" in est.describe() and "K^2/2N^2;" in one.describe()
    with pytest.raises(ValueError, match="keys_per_image"):
        false_negative_estimate(k, n, keys_per_image=0)


def test_in_batch_pool_never_holds_the_own_image_and_text_states_the_numbers():
    assert false_negative_estimate(510, 1000, queued=False).own_image_probability == 0
    text = false_negative_estimate(4096, 4000, 10).describe()
    assert "102.4% of the 4,000 images" in text and "about 410 negatives (10%) share its class" in text


def test_trainer_warns_on_a_narrow_corpus(digits, caplog, tmp_path):
    import torch
    from conftest import TINY

    from hf_contrast import (
        ContrastiveTrainer,
        ContrastiveTrainingArguments,
        MoCoConfig,
        MoCoModel,
        TwoViewAugmentation,
        two_view_dataset,
    )

    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=2048, **TINY))
    args = ContrastiveTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=0,
                                        use_cpu=True, report_to="none", disable_tqdm=True)
    trainer = ContrastiveTrainer(model=model, args=args,
                                 train_dataset=two_view_dataset(digits["train"], TwoViewAugmentation.small_images(32)))
    with caplog.at_level(logging.WARNING, logger="hf_contrast.trainer"):
        warn_narrow_corpus(trainer)
    text = caplog.text
    assert "51.2% of the 4,000 images" in text and "probability 13.1%" in text and "about 205 negatives" in text
    assert text.rstrip().endswith("256 gave kNN 0.806 and 4,096 gave 0.768).") and "Try queue_size=565:" in text
    assert "exclude_same_instance=True masks" not in text  # on by default: not advised as if it were off
    caplog.clear()
    model.config.symmetric_loss = True  # both views enter the queue: it spans 1,024 images
    with caplog.at_level(logging.WARNING, logger="hf_contrast.trainer"):
        warn_narrow_corpus(trainer)
    assert "probability 3.3%" in caplog.text and "both views are queued; about 0.07 such keys" in caplog.text
    assert "Try queue_size=1131:" in caplog.text  # the queue spans K/2 images: twice the keys for the same budget


@pytest.mark.parametrize("n,budget", [(4000, 0.01), (50_000, 0.01), (1000, 0.05), (2624, 0.01)])
def test_suggested_pool_is_the_largest_queue_within_the_budget(n, budget):
    """Checked against the estimate itself (and so against the simulation above): the suggestion's own-image
    probability is within the budget and one key more is over it."""
    k = false_negative_estimate(64, n, own_image_budget=budget).suggested_pool
    assert false_negative_estimate(k, n).own_image_probability <= budget
    assert false_negative_estimate(k + 1, n).own_image_probability > budget
    assert false_negative_estimate(k, n, queued=False).suggested_pool == k  # in-batch: the pool itself
    with pytest.raises(ValueError, match="own_image_budget=0 is invalid"):
        false_negative_estimate(k, n, own_image_budget=0)


def test_planner_adds_the_estimate():
    text = plan.false_negative_lines(32768, 510, 50000, 10)
    assert "65.5% of the 50,000 images" in text and "probability 21.5%" in text and "about 3,277" in text
    assert "consider false_negatives='eliminate'" in text
    assert "Suggested queue size: 7,071 (own-image probability <= 1%" in text and "(queue_size=7071)" in text
