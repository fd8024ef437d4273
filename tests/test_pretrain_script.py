"""training/pretrain.py end to end on the embedded digits, shrunk to seconds with a tiny backbone."""

import json
import math

import pytest

from hf_contrast.trainer.optim import LARS


def test_pretrain_runs_and_reports(pretrain, tmp_path, capsys):
    results = pretrain.main([
        "--backbone", "test_resnet", "--projection_hidden_dim", "32", "--max_train_samples", "256",
        "--num_train_epochs", "4", "--per_device_train_batch_size", "16", "--queue_size", "128",
        "--output_dir", str(tmp_path), "--save_strategy", "no", "--knn_k", "20", "--disable_tqdm", "True",
        "--dataloader_num_workers", "0", "--knn_every_n_steps", "8", "--logging_steps", "4",
        "--eval_strategy", "steps", "--eval_steps", "8",
    ])
    out = capsys.readouterr().out
    for row in ("kNN top-1, pretrained encoder", "raw pixels", "ln(K+1)"):
        assert row in out
    assert results["knn_pretrained"] > results["knn_random_init"] + 0.05 and results["knn_raw_pixels"] > 0.8  # raw: ~0.9
    assert results["eval_loss"] < results["no_signal_loss"] and 0.0 < results["eval_contrastive_top1"] <= 1.0
    assert results["no_signal_loss"] == pytest.approx(math.log(129))
    assert results["final_loss"] < results["no_signal_loss"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    history = json.loads((tmp_path / "log_history.json").read_text())  # every logged entry, knn_top1 included
    assert [h["step"] for h in history if "knn_top1" in h] == list(range(8, 65, 8)) and any(h.get("train_runtime", 0) > 0 for h in history)
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert (tmp_path / "encoder" / "training_curves.png").exists()
    card = (tmp_path / "encoder" / "README.md").read_text()
    assert "`knn_top1`" in card  # the online kNN monitor ran and its value reached the model card


def test_pretrain_rejects_unknown_method(pretrain, tmp_path):
    with pytest.raises(ValueError, match="method='byol' is invalid"):
        pretrain.main(["--method", "byol", "--output_dir", str(tmp_path), "--max_train_samples", "64"])


def test_mocov3_lars_recipe_for_resnets(pretrain):
    """--lars on a ResNet: MoCo v3's LARS with lr 0.6 x global batch / 256, wd 1e-6, warmup 10/100,
    except where a flag was given."""
    model_args = pretrain.ModelArguments(method="mocov3", backbone="test_resnet", lars=True)
    training = pretrain.ContrastiveTrainingArguments(output_dir="unused", per_device_train_batch_size=64,
                                                     gradient_accumulation_steps=2, weight_decay=0.5, use_cpu=True)
    optimizer, recipe = pretrain.apply_mocov3_defaults(model_args, training, ["--weight_decay", "0.5"])
    assert recipe == "lars" and optimizer[0] is LARS
    assert training.learning_rate == pytest.approx(0.6 * 128 / 256) == optimizer[1]["lr"]
    assert training.weight_decay == 0.5 and training.warmup_steps == pytest.approx(0.1)  # the given flag wins
    no_lars = pretrain.ModelArguments(method="mocov3", backbone="test_resnet")
    assert pretrain.apply_mocov3_defaults(no_lars, training, []) == (None, None)  # the script's SGD stays


def test_augmentation_per_method(pretrain):
    """mocov3: the official MoCo v3 recipe (asymmetric blur and solarize, jitter (0.4, 0.4, 0.2, 0.1), crops
    0.08-1 above 64 px); at <= 64 px no blur, the script's crop scale, solarize kept on view 2. moco and
    simclr: MoCo v2's, small_images at <= 64 px."""
    small, large = pretrain.DataArguments(), pretrain.DataArguments(image_size=224, horizontal_flip=True)
    build = lambda method, data, given=frozenset(): pretrain.build_augmentation(method, data, (0.5,) * 3, (0.2,) * 3, given)  # noqa: E731
    v3 = build("mocov3", large)
    assert v3.recipe == "mocov3" and v3.overrides == {} and v3.crop_scale == (0.08, 1.0)
    assert v3.view_blur_p == (1.0, 0.1) and v3.view_solarize_p == (0.0, 0.2) and v3.jitter_strengths == (0.4, 0.4, 0.2, 0.1)
    assert build("mocov3", large, {"crop_min_scale"}).crop_scale == (0.5, 1.0)  # the flag given wins
    digits = build("mocov3", small)
    assert digits.recipe == "mocov3" and digits.overrides == {"crop_scale": (0.5, 1.0), "blur_p": (0.0, 0.0), "flip_p": 0.0}
    assert digits.view_solarize_p == (0.0, 0.2) and digits.mean == (0.5,) * 3
    assert build("mocov3", pretrain.DataArguments(blur_p=0.3)).view_blur_p == (0.3, 0.3)  # --blur_p: both views
    with pytest.raises(ValueError, match="blur_p"):
        build("moco", pretrain.DataArguments(blur_p=1.5))
    for method in ("moco", "simclr"):
        assert build(method, small).recipe == "small_images" and build(method, small).view_solarize_p == (0.0, 0.0)
        # the embedded digits keep MoCo v2's blur (3 taps at 32 px); another small dataset has none; --blur_p wins
        assert build(method, small).view_blur_p == (0.5, 0.5) and build(method, small)._blur_kernel() == 3
        assert build(method, pretrain.DataArguments(dataset_name="cifar10")).view_blur_p == (0.0, 0.0)
        assert build(method, pretrain.DataArguments(train_dir="images")).view_blur_p == (0.0, 0.0)
        assert build(method, pretrain.DataArguments(blur_p=0.0)).view_blur_p == (0.0, 0.0)
        v2 = build(method, large)
        assert v2.recipe == "mocov2" and v2.overrides == {"crop_scale": (0.5, 1.0)}  # the script's --crop_min_scale
    chosen = pretrain.DataArguments(augmentation="mocov2")  # --augmentation mocov2: MoCo v2's for mocov3 too
    assert build("mocov3", chosen).recipe == "small_images" and build("mocov3", chosen).view_solarize_p == (0.0, 0.0)
    assert build("moco", pretrain.DataArguments(augmentation="mocov3")).recipe == "mocov3"
    with pytest.raises(ValueError, match=r"augmentation='byol' is invalid: it must be one of \('mocov2', 'mocov3'\)"):
        build("moco", pretrain.DataArguments(augmentation="byol"))


def test_pretrain_mocov3_vit_runs_with_the_official_recipe(pretrain, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="pretrain")
    seen = {}
    original = pretrain.ContrastiveTrainer.create_optimizer

    def spy(self, *a, **kw):
        opt = original(self, *a, **kw)
        seen.update(cls=type(opt).__name__, lr=self.args.learning_rate, wd=self.args.weight_decay,
                    warmup=self.args.warmup_steps, model=self.model)
        return opt

    monkeypatch.setattr(pretrain.ContrastiveTrainer, "create_optimizer", spy)
    results = pretrain.main([
        "--method", "mocov3", "--backbone", "test_vit", "--projection_hidden_dim", "32",
        "--predictor_hidden_dim", "32", "--max_train_samples", "64", "--num_train_epochs", "1",
        "--per_device_train_batch_size", "32", "--output_dir", str(tmp_path), "--save_strategy", "no",
        "--knn_k", "20", "--disable_tqdm", "True", "--dataloader_num_workers", "0", "--knn_every_n_steps", "0",
        "--logging_steps", "1",
    ])
    assert seen["cls"] == "AdamW" and seen["lr"] == pytest.approx(1.5e-4 * 32 / 256)
    assert seen["wd"] == 0.1 and seen["warmup"] == pytest.approx(40 / 300)
    config = seen["model"].config
    assert config.freeze_patch_embed and config.predictor_output_batch_norm and config.backbone_kwargs["img_size"] == 32
    assert config.momentum_schedule == "cosine"
    assert results["no_signal_loss"] == pytest.approx(math.log(32) * 4 * config.temperature)
    card = (tmp_path / "encoder" / "README.md").read_text()
    assert "# MoCo v3" in card and "N*W - 1 negatives" in card
    setup = next(r.getMessage() for r in caplog.records if "training images, augmentation" in r.getMessage())
    assert "augmentation mocov3 recipe: random resized crop to 32 px, scale (0.5, 1.0)" in setup
    assert "mocov3 recipe:" in card and "no blur, solarize p=0 (view 1) / 0.2 (view 2), no flip" in card


@pytest.mark.parametrize("batches", [8, 0])
def test_precise_bn_reestimates_the_saved_encoders_statistics(pretrain, digits, tmp_path, batches):
    """--precise_bn_batches N (default 16): the encoder saved in final/ and exported carries BatchNorm statistics
    of the un-augmented training images (the first BN's running mean is the mean of the first convolution over
    exactly those images, 4 equal batches of 16), not those tracked on augmented views; 0 keeps the tracked ones."""
    import timm
    import torch
    from safetensors.torch import load_file

    from hf_contrast import AutoModel
    from hf_contrast.data import DIGITS_MEAN, DIGITS_STD, TwoViewAugmentation, eval_dataset

    results = pretrain.main([
        "--backbone", "test_resnet", "--projection_hidden_dim", "32", "--max_train_samples", "64",
        "--num_train_epochs", "2", "--per_device_train_batch_size", "16", "--queue_size", "32",
        "--output_dir", str(tmp_path), "--save_strategy", "no", "--knn_k", "20", "--disable_tqdm", "True",
        "--dataloader_num_workers", "0", "--knn_every_n_steps", "0", "--logging_steps", "4",
        "--precise_bn_batches", str(batches),
    ])
    encoder = AutoModel.from_pretrained(tmp_path / "final").encoder.eval()
    exported = timm.create_model("test_resnet", pretrained=False, num_classes=0)
    exported.load_state_dict(load_file(tmp_path / "encoder" / "model.safetensors"))
    conv, bn = encoder.conv1[0], encoder.conv1[1]  # test_resnet's deep stem: conv, BN, act, ...
    assert isinstance(conv, torch.nn.Conv2d) and isinstance(bn, torch.nn.BatchNorm2d)
    assert torch.equal(exported.conv1[1].running_mean, bn.running_mean)  # the export carries the same statistics
    aug = TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0), flip_p=0.0, mean=DIGITS_MEAN, std=DIGITS_STD)
    clean = eval_dataset(digits["train"].select(range(64)), aug)  # pretrain.py's split: the first 64 of the same train
    x = torch.stack([clean[i]["pixel_values"] for i in range(64)])  # (64, 3, 32, 32) un-augmented
    with torch.no_grad():
        first_mean = conv(x).mean((0, 2, 3))  # (C,) what the first BN sees over all 64 clean images
    card = (tmp_path / "encoder" / "README.md").read_text()
    if batches:
        assert results["precise_bn_images"] == 64
        torch.testing.assert_close(bn.running_mean, first_mean, atol=1e-5, rtol=1e-5)
        assert "re-estimated on 64 un-augmented training images" in card
    else:
        assert "precise_bn_images" not in results and "re-estimated" not in card
        assert (bn.running_mean - first_mean).abs().max() > 1e-2  # tracked on augmented views
