"""What ``--method`` chooses where a flag is not given, for the training scripts: the model and its head
(:func:`build_model`), the two-view augmentation recipe (:func:`build_augmentation`) and MoCo v3's official
optimizer recipe (:func:`apply_mocov3_defaults`).

The functions take the script's argument dataclasses (``training/pretrain.py``'s ``ModelArguments`` and
``DataArguments``, transformers' ``TrainingArguments``; any object with the same fields will do).
"""

from __future__ import annotations

import json
import sys

from .data.splits import is_digits
from .data.views import TwoViewAugmentation
from .models.configuration import MoCoConfig, MoCoV3Config, SimCLRConfig, is_patch_backbone
from .models.moco import MoCoModel
from .models.mocov3 import MoCoV3Model
from .models.simclr import SimCLRModel
from .trainer.optim import LARS

METHODS = ("moco", "simclr", "mocov3")

DEFAULT_QUEUE_SIZE = {"moco": 2048, "mocov3": 0}  # --queue_size when not given: MoCo v3 has no queue by default

AUGMENTATION_RECIPES = ("mocov2", "mocov3")


def build_model(args, image_size: int):
    """The model of ``args.method`` (``moco``, ``simclr`` or ``mocov3``) for ``--image_size`` crops, from the
    script's ``ModelArguments``: a patch backbone gets ``img_size=image_size`` unless ``backbone_kwargs`` sets
    it; ``--queue_size`` and ``--momentum_schedule`` default by method (moco: 2048, constant; mocov3: 0,
    cosine, the official head for the backbone's family, :meth:`~hf_contrast.MoCoV3Config.for_backbone`)."""
    if args.method not in METHODS:
        raise ValueError(f"method={args.method!r} is invalid: it must be one of {METHODS}")
    backbone_kwargs = json.loads(args.backbone_kwargs)
    if "img_size" not in backbone_kwargs and is_patch_backbone(args.backbone, backbone_kwargs):
        backbone_kwargs["img_size"] = image_size  # vit_small_patch16_224 at --image_size: position embeddings fit
    common = dict(
        backbone=args.backbone,
        backbone_kwargs=backbone_kwargs,
        projection_hidden_dim=args.projection_hidden_dim,
        projection_dim=args.projection_dim,
        projection_layers=args.projection_layers,
        projection_batch_norm=args.projection_batch_norm,
        projection_output_batch_norm=args.projection_output_batch_norm,
        temperature=args.temperature,
        image_size=image_size,
        false_negatives=args.false_negatives,
        false_negative_top_k=args.false_negative_top_k,
        tau_plus=args.tau_plus,
    )
    if args.method == "moco":
        queue_size = DEFAULT_QUEUE_SIZE["moco"] if args.queue_size is None else args.queue_size
        config = MoCoConfig(queue_size=queue_size, momentum=args.momentum, key_bn_splits=args.key_bn_splits,
                            momentum_schedule=args.momentum_schedule or "constant", symmetric_loss=args.symmetric_loss,
                            exclude_same_instance=args.exclude_same_instance, **common)
        return MoCoModel(config)
    if args.method == "mocov3":  # the official head for the backbone's family (ViT: predictor BN, frozen patches)
        return MoCoV3Model(MoCoV3Config.for_backbone(
            common.pop("backbone"), **common, predictor_hidden_dim=args.predictor_hidden_dim,
            momentum=args.momentum, momentum_schedule=args.momentum_schedule or "cosine",
            queue_size=DEFAULT_QUEUE_SIZE["mocov3"] if args.queue_size is None else args.queue_size,
            exclude_same_instance=args.exclude_same_instance))
    return SimCLRModel(SimCLRConfig(**common))


DIGITS_BLUR_P = 0.5  # MoCo v2's blur kept on the embedded digits (3 taps at 32 px), see build_augmentation

SMALL_IMAGE_SIZE = 64  # at or below: no blur (it erases small images), the script's crop scale for every method


def build_augmentation(method: str, data_args, mean, std, given: set[str] = frozenset()):
    """The two-view augmentation of ``--method`` for ``data_args`` (``given``: flags on the command line);
    ``--augmentation mocov2|mocov3`` picks the recipe for any method.

    ``moco`` and ``simclr``: MoCo v2's recipe, its CIFAR variant (``small_images``, no blur) at
    ``--image_size`` <= 64. ``mocov3``: the official MoCo v3 / BYOL recipe
    (:meth:`~hf_contrast.TwoViewAugmentation.mocov3`: asymmetric, blur p 1.0 / 0.1, solarize p 0 / 0.2,
    jitter (0.4, 0.4, 0.2, 0.1)); at <= 64 px it drops the blur as ``small_images`` does and keeps the
    asymmetry in solarize. The crop's smallest area is ``--crop_min_scale`` (0.5, chosen for the
    digits) for every method at <= 64 px; above, mocov3 takes the official 0.08 unless the flag is
    given (for any method with ``--augmentation mocov3``). Flips follow ``--horizontal_flip`` (off: digits
    are not mirror-symmetric). ``--blur_p`` sets the blur probability of both views; without it the
    embedded digits (no ``--dataset_name`` / ``--train_dir``) keep MoCo v2's blur, p 0.5 with a 3-tap
    kernel at 32 px, in the mocov2 recipe: the views of the code that measured kNN 0.883-0.889 were
    slightly blurred by their crop kernel (``roi_align``'s 2x2 sampling), and without any blur the
    default job lost 0.017 kNN (``results/bisect/``).
    """
    recipe = data_args.augmentation or ("mocov3" if method == "mocov3" else "mocov2")
    if recipe not in AUGMENTATION_RECIPES:
        raise ValueError(f"augmentation={recipe!r} is invalid: it must be one of {AUGMENTATION_RECIPES} "
                         "(or not given: the method's)")
    small = data_args.image_size <= SMALL_IMAGE_SIZE
    common = dict(image_size=data_args.image_size, flip_p=0.5 if data_args.horizontal_flip else 0.0, mean=mean, std=std)
    if data_args.blur_p is not None:
        common["blur_p"] = data_args.blur_p
    elif recipe == "mocov2" and is_digits(data_args):
        common["blur_p"] = DIGITS_BLUR_P  # the embedded digits: see the docstring
    if recipe == "mocov3":
        if small and "blur_p" not in common:
            common["blur_p"] = 0.0
        if small or "crop_min_scale" in given:
            common["crop_scale"] = (data_args.crop_min_scale, 1.0)
        return TwoViewAugmentation.mocov3(**common)
    if small:
        return TwoViewAugmentation.small_images(crop_scale=(data_args.crop_min_scale, 1.0), **common)
    return TwoViewAugmentation(crop_scale=(data_args.crop_min_scale, 1.0), recipe="mocov2", **common)


MOCOV3_VIT_TRAINING = dict(optim="adamw_torch", optim_args=None, weight_decay=0.1, warmup_steps=40 / 300)

MOCOV3_LARS_TRAINING = dict(weight_decay=1e-6, warmup_steps=10 / 100)

MOCOV3_BASE_LR = {"vit": 1.5e-4, "lars": 0.6}  # x global batch / 256, as main_moco.py


def explicit_flags(argv: list[str] | None) -> set[str]:
    """Names of the flags given on the command line (``--name value`` or ``--name=value``)."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


def apply_mocov3_defaults(model_args, training_args, argv: list[str] | None):
    """The official MoCo v3 optimizer recipe, for the flags not given; returns ``(optimizer_cls_and_kwargs, recipe)``
    (``(None, None)`` when the script's SGD defaults stay)."""
    vit = is_patch_backbone(model_args.backbone, json.loads(model_args.backbone_kwargs))
    if not vit and not model_args.lars:
        return None, None
    recipe = "vit" if vit else "lars"
    given = explicit_flags(argv)
    for name, value in (MOCOV3_VIT_TRAINING if vit else MOCOV3_LARS_TRAINING).items():
        if name not in given:
            setattr(training_args, name, value)
    if "learning_rate" not in given:
        global_batch = (training_args.per_device_train_batch_size * training_args.world_size
                        * training_args.gradient_accumulation_steps)
        training_args.learning_rate = MOCOV3_BASE_LR[recipe] * global_batch / 256
    if vit:
        return None, recipe
    return (LARS, {"lr": training_args.learning_rate, "momentum": 0.9}), recipe
