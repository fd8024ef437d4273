"""The library halves of ``training/pretrain.py``, called without the script: what ``--method`` chooses
(:mod:`hf_contrast.recipes`), the splits and their normalisation (:mod:`hf_contrast.data.splits`), Precise BN
(:func:`hf_contrast.evaluation.precise_batch_norm`) and the end-of-run report (:mod:`hf_contrast.report`).
Each takes any object with the script's fields (here ``SimpleNamespace``), and the script re-exports them."""

import math
from types import SimpleNamespace

import pytest

from hf_contrast import MoCoModel, MoCoV3Model, SimCLRModel
from hf_contrast.data import DIGITS_MEAN, DIGITS_STD, IMAGENET_MEAN
from hf_contrast.data.splits import is_digits, load_splits, normalization
from hf_contrast.evaluation import precise_batch_norm
from hf_contrast.recipes import (
    DEFAULT_QUEUE_SIZE,
    apply_mocov3_defaults,
    build_augmentation,
    build_model,
    explicit_flags,
)
from hf_contrast.report import knn_details, print_report


def model_args(**overrides):
    fields = dict(method="moco", backbone="test_resnet", backbone_kwargs="{}", projection_hidden_dim=32,
                  projection_dim=16, projection_layers=2, projection_batch_norm=True,
                  projection_output_batch_norm=True, temperature=0.2, queue_size=None, momentum=0.99,
                  momentum_schedule=None, key_bn_splits=1, symmetric_loss=False, exclude_same_instance=True,
                  false_negatives=None, false_negative_top_k=10, tau_plus=0.0, predictor_hidden_dim=32, lars=False)
    return SimpleNamespace(**{**fields, **overrides})


def data_args(**overrides):
    fields = dict(dataset_name=None, dataset_config_name=None, train_dir=None, idx_dir=None, label_column="label",
                  image_column=None, test_split_size=0.2, validation_size=0, max_train_samples=None, image_size=32,
                  crop_min_scale=0.5, horizontal_flip=False, blur_p=None, augmentation=None)
    return SimpleNamespace(**{**fields, **overrides})


def test_build_model_follows_the_method_and_its_defaults():
    moco = build_model(model_args(), 32)
    assert isinstance(moco, MoCoModel) and moco.config.queue_size == DEFAULT_QUEUE_SIZE["moco"]
    assert moco.config.momentum_schedule == "constant"
    v3 = build_model(model_args(method="mocov3"), 32)
    assert isinstance(v3, MoCoV3Model) and not v3.has_queue and v3.config.momentum_schedule == "cosine"
    assert isinstance(build_model(model_args(method="simclr"), 32), SimCLRModel)
    with pytest.raises(ValueError, match="method='byol' is invalid"):
        build_model(model_args(method="byol"), 32)


def test_augmentation_recipe_and_flags_given():
    assert explicit_flags(["--blur_p", "0.2", "--crop_min_scale=0.3", "7"]) == {"blur_p", "crop_min_scale"}
    digits = build_augmentation("moco", data_args(), DIGITS_MEAN, DIGITS_MEAN)
    assert digits.recipe == "small_images" and max(digits.view_blur_p) == 0.5  # the digits keep MoCo v2's blur
    v3 = build_augmentation("mocov3", data_args(dataset_name="cifar10"), IMAGENET_MEAN, IMAGENET_MEAN)
    assert v3.recipe == "mocov3" and max(v3.view_blur_p) == 0.0  # <= 64 px: no blur
    with pytest.raises(ValueError, match="augmentation='byol' is invalid"):
        build_augmentation("moco", data_args(augmentation="byol"), IMAGENET_MEAN, IMAGENET_MEAN)


def test_mocov3_defaults_apply_only_where_no_flag_was_given():
    training = SimpleNamespace(per_device_train_batch_size=64, world_size=2, gradient_accumulation_steps=1,
                               learning_rate=0.06, weight_decay=0.5, warmup_steps=0.05, optim="sgd", optim_args=None)
    optimizer, recipe = apply_mocov3_defaults(model_args(method="mocov3", lars=True), training, ["--weight_decay", "0.5"])
    assert recipe == "lars" and optimizer[1]["lr"] == pytest.approx(0.6 * 128 / 256)
    assert training.weight_decay == 0.5 and training.warmup_steps == pytest.approx(0.1)


def test_splits_and_normalization_from_any_object_with_the_fields():
    assert is_digits(data_args()) and normalization(data_args()) == (DIGITS_MEAN, DIGITS_STD)
    assert normalization(data_args(dataset_name="cifar10"))[0] == IMAGENET_MEAN
    with pytest.raises(ValueError, match="--dataset_name cifar10 and --train_dir x: give one source of images"):
        load_splits(data_args(dataset_name="cifar10", train_dir="x"))
    train, test, name = load_splits(data_args(max_train_samples=100, validation_size=50))
    assert len(train) == 100 and len(test) == 50 and name.endswith("(50 held out for validation)")


def test_precise_bn_is_skipped_at_zero_batches():
    model = build_model(model_args(), 32)
    assert precise_batch_norm(model, None, None, SimpleNamespace(precise_bn_batches=4), None) == 0
    assert precise_batch_norm(model, [1], None, SimpleNamespace(precise_bn_batches=0), None) == 0


def test_report_prints_the_rows_it_has(capsys, tmp_path):
    model = build_model(model_args(queue_size=64), 32)
    print_report({"knn_pretrained": 0.9, "no_signal_loss": math.log(65)}, str(tmp_path), model)
    out = capsys.readouterr().out
    assert "kNN top-1, pretrained encoder" in out and "ln(K+1)" in out and "raw pixels" not in out
    assert str(tmp_path) in out
    details = knn_details(SimpleNamespace(knn_k=20), [0] * 7, {"precise_bn_images": 32})
    assert details == "k=20, t=0.1, on 7 held-out images; BatchNorm statistics re-estimated on 32 un-augmented " \
                      "training images"


def test_the_script_re_exports_what_its_callers_import(pretrain):
    for name in ("build_model", "build_augmentation", "apply_mocov3_defaults", "explicit_flags", "load_splits",
                 "normalization", "load_stream", "preflight_images", "precise_batch_norm", "print_report",
                 "export_and_push", "METHODS", "AUGMENTATION_RECIPES"):
        assert hasattr(pretrain, name), name
