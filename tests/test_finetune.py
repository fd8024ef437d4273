"""Downstream scripts on an encoder export: training/finetune.py (AutoModelForImageClassification and
the plain transformers.Trainer) and training/linear_probe.py (logistic regression on frozen features)."""

import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from test_hub_export import AUGMENTATION, shared_moco_run

from hf_contrast import eval_dataset, extract_features, knn_top1

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import finetune  # noqa: E402
import linear_probe  # noqa: E402


@pytest.fixture(scope="module")
def export(digits, tmp_path_factory):
    """The shared briefly trained MoCo test_resnet: its export and the model."""
    model, _, directory, _, _ = shared_moco_run(digits, tmp_path_factory)
    return directory, model


def test_probe_fits_separable_features_and_not_random_labels():
    g = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(5, 16, generator=g)
    y = torch.arange(500) % 5
    x = centres[y] + torch.randn(500, 16, generator=g)  # (500, 16): 5 separated clusters
    result = linear_probe.train_linear_probe(x[:400], y[:400], x[400:], y[400:], num_classes=5)
    assert result["accuracy"] == 1.0
    shuffled = y[torch.randperm(500, generator=g)]
    result = linear_probe.train_linear_probe(x[:400], shuffled[:400], x[400:], shuffled[400:], num_classes=5)
    assert result["accuracy"] < 0.4  # labels unrelated to the features: near chance (0.2) on held-out data


def test_linear_probe_sees_the_trained_encoder(export, digits):
    directory, model = export
    args = linear_probe.ProbeArguments(model_name_or_path=str(directory), knn_k=20)
    splits = finetune.load_labelled_splits(finetune.DataArguments(max_train_samples=400, max_eval_samples=200),
                                           dataset=digits)
    pretrained = linear_probe.probe(args, splits, "label")
    random_init = linear_probe.probe(args, splits, "label", random_init=True)
    # the same probe on features computed by hf_contrast itself from the trained model gives the same
    # numbers: the export, its processor and the script's extraction are faithful
    train, test = splits[:2]
    tr = extract_features(model.encoder, eval_dataset(train, AUGMENTATION))
    te = extract_features(model.encoder, eval_dataset(test, AUGMENTATION))
    direct = linear_probe.train_linear_probe(*tr, *te, num_classes=10)
    assert pretrained["accuracy"] == pytest.approx(direct["accuracy"], abs=0.006)  # at most 1 of 200 differs
    assert pretrained["knn_top1"] == pytest.approx(knn_top1(*tr, *te, k=20), abs=0.006)
    assert pretrained["accuracy"] > 0.3  # chance is 0.1
    assert random_init["accuracy"] != pretrained["accuracy"]


def test_random_init_is_timms_init_of_the_same_architecture(export):
    directory, _ = export
    names = [str(i) for i in range(10)]
    pretrained = finetune.load_classifier(str(directory), names)
    weights = load_file(directory / "model.safetensors")
    state = pretrained.timm_model.state_dict()
    assert all(torch.equal(state[k], w) for k, w in weights.items())
    random = finetune.load_classifier(str(directory), names, random_init=True, seed=3)
    torch.manual_seed(3)
    fresh = timm.create_model("test_resnet", num_classes=10)
    assert not torch.equal(random.timm_model.state_dict()["conv1.0.weight"], weights["conv1.0.weight"])
    for (name, a), b in zip(random.timm_model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert random.config.id2label[3] == "3" and random.timm_model.num_classes == 10


def test_finetune_script_trains_a_transformers_classifier(export, digits, tmp_path, capsys, recwarn):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from hf_contrast.data import to_rgb

    directory, _ = export
    argv = ["--model_name_or_path", str(directory), "--max_train_samples", "64", "--max_eval_samples", "64",
            "--max_steps", "2", "--per_device_train_batch_size", "32", "--output_dir", str(tmp_path),
            "--use_cpu", "--disable_tqdm", "true", "--compare_random_init"]
    results = finetune.main(argv, dataset=digits)
    assert set(results) == {"accuracy_pretrained", "accuracy_random_init"}
    out = capsys.readouterr().out
    assert "(2 optimizer steps)" in out and "epochs" not in out  # --max_steps: not the default 3 epochs
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]  # no pinning on a CPU run
    tuned = AutoModelForImageClassification.from_pretrained(tmp_path / "model")  # loads without hf_contrast code
    assert tuned.config.num_labels == 10 and type(tuned).__name__ == "TimmWrapperForImageClassification"
    # the reported accuracy is the saved classifier's on the 64 test digits, recomputed here by hand
    processor = AutoImageProcessor.from_pretrained(directory)
    test = digits["test"].select(range(64))
    pixels = processor([to_rgb(im) for im in test["image"]], return_tensors="pt")["pixel_values"]  # (64, 3, H, W)
    with torch.no_grad():
        predicted = tuned.eval()(pixel_values=pixels).logits.argmax(1)  # (64,)
    by_hand = (predicted == torch.tensor(test["label"])).float().mean().item()
    assert results["accuracy_pretrained"] == pytest.approx(by_hand, abs=1e-9)
    assert abs(results["accuracy_random_init"] * 64 - round(results["accuracy_random_init"] * 64)) < 1e-6  # k / 64
    start = load_file(directory / "model.safetensors")["conv1.0.weight"]
    assert not torch.equal(tuned.timm_model.state_dict()["conv1.0.weight"], start)  # trained from the export
