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

Augmentation (``hf_contrast.recipes.build_augmentation``): ``moco`` and ``simclr`` MoCo v2's (``small_images``, no blur, at
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

import torch
import transformers
from transformers import set_seed

import hf_contrast
from hf_contrast import ContrastiveTrainer, ContrastiveTrainingArguments, KNNMonitor, knn_accuracy
from hf_contrast.cli import (
    check_output_dir,
    check_planned_steps,
    fit_loader_to_device,
    make_parser,
    run_main,
    set_help,
    use_numeric_progress,
)
from hf_contrast.data import eval_dataset, two_view_dataset
from hf_contrast.data.idx_dataset import (  # noqa: F401 - the means re-exported (tests)
    FASHION_MNIST_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    INSTALL_HINT,
)
from hf_contrast.data.splits import load_splits, load_stream, normalization, preflight_images
from hf_contrast.data.streaming import StreamingTwoViewDataset
from hf_contrast.evaluation import precise_batch_norm, recalibrate_batch_norm
from hf_contrast.hub.model_card import default_template_text
from hf_contrast.hub.push import check_can_push
from hf_contrast.models.configuration import check_timm_name
from hf_contrast.recipes import (
    AUGMENTATION_RECIPES,
    METHODS,
    apply_mocov3_defaults,
    build_augmentation,
    build_model,
    explicit_flags,
)
from hf_contrast.report import export_and_push, print_report
from hf_contrast.trainer.checkpointing import RESUME_HELP, resume_target
from hf_contrast.trainer.throughput import summarize_throughput

logger = logging.getLogger("pretrain")


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
    """Parse and check the flags, load the data, build the model, train, then report, save and export."""
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


if __name__ == "__main__":
    run_main(main, build_parser())  # a setup mistake: "pretrain.py: error: --flag ...", exit 2
    hf_contrast.distributed.shutdown()  # under torchrun: a clean exit of every process
