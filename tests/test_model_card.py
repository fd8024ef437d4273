"""The model card: negatives per anchor stated correctly for SimCLR (gathered and per-device) and
MoCo, gradient accumulation adding none, YAML metadata for the Hub, curves from the trainer."""

import re

import pytest
import torch
from conftest import TINY
from huggingface_hub import ModelCard
from test_hub_export import AUGMENTATION, shared_moco_run, train_tiny

from hf_contrast import EncoderCardData, MoCoConfig, MoCoModel, SimCLRConfig, SimCLRModel
from hf_contrast.models.negatives import negatives_per_anchor


@pytest.fixture(scope="module")
def simclr():
    torch.manual_seed(0)
    return SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))


def table_value(text: str, row: str) -> str:
    """The value column of the card's table row ``| row | value |``."""
    match = re.search(rf"^\| {re.escape(row)} \| (.*?) \|$", text, re.M)
    assert match, f"no row {row!r} in the card"
    return match[1]


def render(card: EncoderCardData) -> str:
    return str(card.to_model_card())


def test_simclr_gathered_card_states_2NW_minus_2(simclr):
    card = EncoderCardData.from_model(simclr, AUGMENTATION, per_device_batch_size=64, world_size=4,
                                      gradient_accumulation_steps=2)
    text = render(card)
    assert card.negatives == 2 * 64 * 4 - 2 == 510
    assert table_value(text, "negatives per anchor") == "510"
    assert "**510 negatives = 2·N·W − 2** with N = 64 images per device and W = 4 process(es)" in text
    assert table_value(text, "views gathered across processes") == "yes"
    assert table_value(text, "global batch (N × W × accumulation)") == str(64 * 4 * 2)
    assert "adds no negatives" in table_value(text, "gradient accumulation")


def test_simclr_per_device_card_states_2N_minus_2(tmp_path):
    torch.manual_seed(0)
    model = SimCLRModel(SimCLRConfig(backbone="test_resnet", gather_distributed=False, **TINY))
    card = EncoderCardData.from_model(model, AUGMENTATION, per_device_batch_size=64, world_size=4)
    text = render(card)
    assert card.negatives == 2 * 64 - 2 == 126  # the other 3 devices' views are not negatives
    assert table_value(text, "negatives per anchor") == "126"
    assert "**126 negatives = 2·N − 2**" in text and "other 3 process(es) were not used" in text
    assert table_value(text, "views gathered across processes") == "no (per-device negatives)"


def test_moco_card_states_the_queue_size_whatever_the_batch():
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=4096, momentum=0.99, momentum_schedule="cosine",
                                 **TINY))
    texts = []
    for batch, world, accumulation in ((32, 1, 1), (256, 8, 4)):
        card = EncoderCardData.from_model(model, AUGMENTATION, per_device_batch_size=batch, world_size=world,
                                          gradient_accumulation_steps=accumulation)
        assert card.negatives == 4096
        texts.append(render(card))
    for text in texts:
        assert table_value(text, "negatives per anchor") == "4096"
        assert table_value(text, "queue size") == "4096"
        assert table_value(text, "key encoder momentum") == "0.99 (cosine schedule, to 1.0 at the last step)"
        assert "**4096 negatives**" in text
    assert "spans the last 128 micro-batches" in texts[0]  # 4096 / 32 keys per micro-batch
    assert table_value(texts[1], "global batch (N × W × accumulation)") == str(256 * 8 * 4)


def test_negative_counts_match_the_trainer(simclr, digits, tmp_path):
    trainer = train_tiny(simclr, digits, tmp_path, steps=2, batch_size=8)
    card = EncoderCardData.from_trainer(trainer, AUGMENTATION)
    assert card.negatives == trainer.negatives_per_anchor() == negatives_per_anchor(simclr.config, 8, 1) == 14
    logged = {h["num_negatives"] for h in trainer.state.log_history if "num_negatives" in h}
    assert logged == {14}  # what the card states is what the loss used
    assert card.steps == 2 and card.per_device_batch_size == 8
    # without augmentation=, the normalisation comes from the TwoViewDataset the trainer read
    assert EncoderCardData.from_trainer(trainer).mean == tuple(AUGMENTATION.mean) != (0.485, 0.456, 0.406)


def test_card_from_trainer_has_yaml_curves_and_knn(digits, tmp_path_factory):
    _, trainer, export, _, _ = shared_moco_run(digits, tmp_path_factory)
    knn_logged = [h["knn_top1"] for h in trainer.state.log_history if "knn_top1" in h]
    assert len(knn_logged) == 2  # KNNMonitor every 2 of the 4 steps
    card = ModelCard.load(export / "README.md")
    assert card.data.library_name == "timm" and card.data.pipeline_tag == "image-feature-extraction"
    assert {"moco", "test_resnet", "self-supervised"} <= set(card.data.tags)
    assert card.data.datasets == ["ylecun/mnist"]
    assert f"**{knn_logged[-1]:.4f}**" in card.text  # the last kNN top-1 the monitor logged
    assert "![Training curves](training_curves.png)" in card.text
    assert (export / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table_value(card.text, "optimizer steps") == "4"
    assert table_value(card.text, "negatives per anchor") == "32" == str(trainer.negatives_per_anchor())
    assert 'timm.create_model("local-dir:' in card.text and "AutoModelForImageClassification" in card.text
    assert table_value(card.text, "augmentations").startswith(
        "small_images recipe: random resized crop to 32 px, scale (0.5, 1.0)")  # the recipe named first
    windows = [h for h in trainer.state.log_history if "images_per_second" in h][1:]  # after the first
    mean = sum(h["images_per_second"] for h in windows) / len(windows)
    shown = table_value(card.text, "throughput")
    assert shown.endswith("of the time waiting for data") and " images/s over 1 process(es), " in shown
    assert abs(float(shown.split(" images/s")[0]) - mean) <= 1  # printed as a whole number


def test_card_states_throughput_from_the_logged_windows_after_the_first():
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, **TINY))
    logs = [{"loss": 1.0, "step": 10 * i, "images_per_second": ips, "data_wait_fraction": wait}
            for i, (ips, wait) in enumerate([(10.0, 0.9), (2000.0, 0.05), (3000.0, 0.15)], start=1)]
    card = EncoderCardData.from_model(model, AUGMENTATION, per_device_batch_size=32, world_size=8, log_history=logs)
    assert (card.images_per_second, card.data_wait_fraction) == (2500.0, 0.1)  # start-up window left out
    assert table_value(render(card), "throughput") == "2500 images/s over 8 process(es), 10% of the time waiting for data"
    assert "| throughput |" not in render(EncoderCardData.from_model(model, AUGMENTATION))  # not measured: no row


def test_training_curves_plot_every_logged_metric(tmp_path):
    from hf_contrast.hub.model_card import plot_training_curves

    history = [{"loss": 4.0 - s / 10, "contrastive_top1": s / 10, "step": s} for s in range(1, 6)]
    assert plot_training_curves([{"train_runtime": 1.0, "step": 5}], tmp_path / "none.png") is None
    without = plot_training_curves(history, tmp_path / "two.png")
    with_knn = plot_training_curves(history + [{"knn_top1": 0.8, "step": 5}], tmp_path / "three.png")
    from PIL import Image

    assert Image.open(with_knn).width > Image.open(without).width  # a third panel for knn_top1


def test_card_loading_snippets_name_the_repo(simclr):
    text = render(EncoderCardData.from_model(simclr, repo_id="my-org/simclr-digits"))  # no augmentation recorded
    assert 'timm.create_model("hf-hub:my-org/simclr-digits", pretrained=True)' in text
    assert 'AutoModel.from_pretrained("my-org/simclr-digits")' in text
    assert table_value(text, "negatives per anchor") == "unknown"  # SimCLR without a batch size: no guess
    assert table_value(text, "input") == "32 px, normalisation not recorded"
    assert table_value(text, "augmentations") == "not recorded"
