"""The encoder export: timm's Hub folder layout that loads with timm and transformers without
hf_contrast, giving the trained encoder's features; and the full checkpoint, distinct, still loading."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY
from safetensors.torch import load_file, save_file

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    KNNMonitor,
    MoCoConfig,
    MoCoModel,
    SimCLRConfig,
    SimCLRModel,
    TwoViewAugmentation,
    eval_dataset,
    export_encoder,
    two_view_dataset,
)
from hf_contrast.data import DIGITS_MEAN, DIGITS_STD, to_rgb

AUGMENTATION = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), mean=DIGITS_MEAN, std=DIGITS_STD)
EXPORT_FILES = {"config.json", "model.safetensors", "README.md", "training_curves.png"}


def train_tiny(model, digits, tmp_path, steps=4, batch_size=16, knn=False, **args):
    """A real ContrastiveTrainer run of ``steps`` optimizer steps on the digits, logging every step."""
    train = digits["train"].select(range(steps * batch_size))
    defaults = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=batch_size, max_steps=steps,
                    logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                    dataloader_num_workers=0, learning_rate=0.05, report_to="none")
    trainer = ContrastiveTrainer(model=model, args=ContrastiveTrainingArguments(**{**defaults, **args}),
                                 train_dataset=two_view_dataset(train, AUGMENTATION))
    if knn:
        memory = eval_dataset(digits["train"].select(range(200)), AUGMENTATION)
        held_out = eval_dataset(digits["test"].select(range(100)), AUGMENTATION)
        KNNMonitor(memory, held_out, every_n_steps=2, k=20).attach(trainer)
    trainer.train()
    model.eval()
    return trainer


def expected_features(encoder, digits, directory):
    """Save inputs and the encoder's features for a subprocess to compare against.

    Writes ``x`` (random tensors), ``features_x``, ``pixel_values`` (hf_contrast's eval transform of
    the digit images, also written as PNG), ``features_images`` to ``directory``."""
    torch.manual_seed(1)
    x = torch.randn(4, 3, 32, 32)
    images = [to_rgb(digits["test"][i]["image"]) for i in range(4)]
    for i, im in enumerate(images):
        im.save(directory / f"digit{i}.png")
    transform = AUGMENTATION.eval_transform()
    pixel_values = torch.stack([transform(im) for im in images])  # (4, 3, 32, 32)
    with torch.no_grad():
        tensors = {"x": x, "features_x": encoder(x), "pixel_values": pixel_values,
                   "features_images": encoder(pixel_values)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "expected.safetensors")
    return tensors


_SHARED: dict = {}


def shared_moco_run(digits, tmp_path_factory):
    """One MoCo test_resnet trained 4 steps with a kNN monitor (BatchNorm statistics moved, ``knn_top1``
    logged), exported from its trainer, its full checkpoint saved, and reference features written.

    Trained once per session and shared by the export, card, push and downstream tests (a plain cache:
    they all import this module).

    Returns:
        ``(model, trainer, export_dir, run_dir, expected_features)``.
    """
    if "moco" not in _SHARED:
        tmp = tmp_path_factory.mktemp("moco")
        torch.manual_seed(0)
        model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=32, **TINY))
        trainer = train_tiny(model, digits, tmp, knn=True)
        export = export_encoder(trainer, tmp / "encoder", augmentation=AUGMENTATION, datasets=["ylecun/mnist"],
                                dataset_description="5,000 MNIST digits")
        model.save_pretrained(tmp / "full")
        _SHARED["moco"] = model, trainer, export, tmp, expected_features(model.encoder, digits, tmp)
    return _SHARED["moco"]


@pytest.fixture(scope="module")
def moco_run(digits, tmp_path_factory):
    return shared_moco_run(digits, tmp_path_factory)


@pytest.fixture(scope="module")
def simclr_vit(digits, tmp_path_factory):
    """A SimCLR test_vit (dynamic image size, run at 32 px) exported from the model alone."""
    tmp = tmp_path_factory.mktemp("simclr")
    torch.manual_seed(0)
    model = SimCLRModel(SimCLRConfig(backbone="test_vit", **TINY)).eval()
    export = export_encoder(model, tmp / "encoder", augmentation=AUGMENTATION, per_device_batch_size=16)
    return model, export, tmp


def test_export_is_timm_hub_layout_of_the_query_encoder(moco_run):
    model, _, export, _, _ = moco_run
    assert {p.name for p in export.iterdir()} == EXPORT_FILES  # no pickle, no full checkpoint
    config = json.loads((export / "config.json").read_text())
    assert config["architecture"] == "test_resnet" and config["num_classes"] == 0
    assert config["num_features"] == model.encoder.num_features == 96
    assert "num_classes" not in config.get("model_args", {})  # the timm 1.0.31 save_for_hf trap
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 32, 32]
    assert cfg["mean"] == list(DIGITS_MEAN) and cfg["std"] == list(DIGITS_STD)
    weights = load_file(export / "model.safetensors")
    query = model.encoder.state_dict()
    assert weights.keys() == query.keys()  # the query encoder only: no key encoder, head or queue
    for name, tensor in query.items():
        assert torch.equal(weights[name], tensor), name
    key_encoder = model.key_encoder.state_dict()
    assert any(not torch.equal(weights[n], key_encoder[n]) for n in weights)  # it is not the key side


def test_vit_export_keeps_its_position_embedding_shape(simclr_vit):
    model, export, _ = simclr_vit
    config = json.loads((export / "config.json").read_text())
    assert config["model_args"]["img_size"] == list(model.encoder.patch_embed.img_size)
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]
    assert config["pretrained_cfg"]["fixed_input_size"] is False  # dynamic_img_size: loaders must not resize it


LOADERS = textwrap.dedent(r'''
    """Load each export with every loader, hf_contrast NOT imported; write features for comparison."""
    import json, sys
    import numpy as np, timm, torch
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from transformers import AutoImageProcessor, AutoModel, AutoModelForImageClassification, pipeline

    out, meta = {}, {"timm": timm.__version__}
    for name, directory in zip(sys.argv[1::2], sys.argv[2::2]):
        ref = load_file(f"{directory}/../expected.safetensors")
        images = [Image.open(f"{directory}/../digit{i}.png") for i in range(4)]
        x = ref["x"]
        with torch.no_grad():
            model = timm.create_model(f"local-dir:{directory}", pretrained=True).eval()
            out[f"{name}/timm"] = model(x)
            data_config = timm.data.resolve_data_config({}, model=model)
            transform = timm.data.create_transform(**data_config)
            out[f"{name}/timm_transform"] = torch.stack([transform(im) for im in images])
            auto = AutoModel.from_pretrained(directory)
            meta[f"{name}/auto_class"] = type(auto).__name__
            out[f"{name}/auto"] = auto(x).pooler_output
            classifier = AutoModelForImageClassification.from_pretrained(directory, num_labels=7)
            out[f"{name}/logits"] = classifier(x).logits
            timm_model = classifier.timm_model
            out[f"{name}/classifier_features"] = timm_model.forward_head(timm_model.forward_features(x), pre_logits=True)
            processor = AutoImageProcessor.from_pretrained(directory)
            meta[f"{name}/processor_class"] = type(processor).__name__
            out[f"{name}/processor"] = processor(images)["pixel_values"]
            extractor = pipeline("image-feature-extraction", model=directory)
            out[f"{name}/pipeline"] = torch.tensor(np.array(extractor(images, pool=True)), dtype=torch.float32).reshape(4, -1)
    meta["hf_contrast_imported"] = "hf_contrast" in sys.modules
    save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[0].replace(".py", ".safetensors"))
    print(json.dumps(meta))
''')


def run_loaders(exports: dict, tmp_path, pythonpath: str | None = None):
    """Run :data:`LOADERS` in a fresh interpreter (one for all exports: imports cost seconds)."""
    script = tmp_path / "loaders.py"
    script.write_text(LOADERS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    argv = [a for name, directory in exports.items() for a in (name, str(directory))]
    result = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), load_file(tmp_path / "loaders.safetensors")


def test_every_loader_gives_the_trained_features_without_hf_contrast(moco_run, simclr_vit, digits, tmp_path):
    model, export, tmp = simclr_vit
    expected = {"moco_resnet": moco_run[4], "simclr_vit": expected_features(model.encoder, digits, tmp)}
    meta, out = run_loaders({"moco_resnet": moco_run[2], "simclr_vit": export}, tmp_path)

    assert meta["hf_contrast_imported"] is False
    for name, ref in expected.items():
        assert meta[f"{name}/auto_class"] == "TimmWrapperModel"
        assert meta[f"{name}/processor_class"] == "TimmWrapperImageProcessor"
        for loader in ("timm", "auto", "classifier_features"):
            torch.testing.assert_close(out[f"{name}/{loader}"], ref["features_x"], atol=1e-5, rtol=0, msg=f"{name}/{loader}")
        assert out[f"{name}/logits"].shape == (4, 7)  # a new 7-way head on the pretrained encoder
        # both preprocessing paths reproduce hf_contrast's eval transform, so images give the same features
        torch.testing.assert_close(out[f"{name}/processor"], ref["pixel_values"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[f"{name}/timm_transform"], ref["pixel_values"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out[f"{name}/pipeline"], ref["features_images"], atol=1e-5, rtol=0)


def test_full_checkpoint_and_export_are_distinct_and_both_load(moco_run):
    from transformers import AutoModel

    model, _, export, tmp, _ = moco_run
    full = tmp / "full"
    full_config = json.loads((full / "config.json").read_text())
    export_config = json.loads((export / "config.json").read_text())
    assert full_config["model_type"] == "hf_contrast_moco" and "model_type" not in export_config
    full_weights = load_file(full / "model.safetensors")
    assert any(k.startswith("key_encoder.") for k in full_weights) and "queue.keys" in full_weights
    assert len(load_file(export / "model.safetensors")) < len(full_weights)

    for loaded in (MoCoModel.from_pretrained(full), AutoModel.from_pretrained(full)):  # continue pretraining
        assert isinstance(loaded, MoCoModel)
        assert torch.equal(loaded.queue.keys, model.queue.keys) and int(loaded.queue_filled) == int(model.queue_filled)
        for a, b in zip(loaded.key_parameters(), model.key_parameters(), strict=True):
            assert torch.equal(a, b) and not a.requires_grad
    assert type(AutoModel.from_pretrained(export)).__name__ == "TimmWrapperModel"


def test_export_refuses_a_non_empty_directory_and_loses_nothing(moco_run, tmp_path):
    model = moco_run[0]
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        export_encoder(model, target, augmentation=AUGMENTATION)
    assert [p.name for p in target.iterdir()] == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    export_encoder(model, target, augmentation=AUGMENTATION, overwrite=True)
    assert (target / "notes.txt").read_text() == "mine" and (target / "model.safetensors").is_file()


def test_export_rejects_what_is_not_a_contrastive_model(tmp_path):
    with pytest.raises(ValueError, match="MoCoModel, a SimCLRModel or a ContrastiveTrainer"):
        export_encoder(torch.nn.Linear(2, 2), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_without_normalisation_records_imagenet_and_warns(simclr_vit, tmp_path, caplog):
    model = simclr_vit[0]
    with caplog.at_level("WARNING"):
        export_encoder(model, tmp_path / "e")
    assert "mean/std" in caplog.text
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())["pretrained_cfg"]
    assert cfg["mean"] == [0.485, 0.456, 0.406]

