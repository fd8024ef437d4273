#!/usr/bin/env python
"""Fine-tune an exported encoder on a labelled image dataset with plain transformers.

The encoder export (``training/pretrain.py`` writes one to ``OUTPUT_DIR/encoder``; a Hub repo id
works too) loads as ``AutoModelForImageClassification`` with a new head, and the stock
``transformers.Trainer`` trains it: no hf_contrast code in the model. With no arguments it
fine-tunes ``outputs/pretrain/encoder`` on the embedded 4,000 / 1,000 MNIST digits for 3 epochs
(about 2 minutes per model with resnet18 at 32 px on two idle CPU cores) and prints the test accuracy.

    python training/finetune.py --model_name_or_path outputs/pretrain/encoder --compare_random_init
    python training/finetune.py --model_name_or_path ORG/NAME --dataset_name cifar10 --image_column img

Every field of the dataclasses below is a command-line flag (``--help`` lists them).
``training/linear_probe.py`` shares :class:`DataArguments` and the data helpers of this script.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import timm
import torch
import transformers
from transformers import AutoModelForImageClassification, Trainer, TrainingArguments, set_seed

import hf_contrast
from hf_contrast.cli import fit_loader_to_device, make_parser, run_main, use_numeric_progress
from hf_contrast.data import find_image_column, to_rgb
from hf_contrast.hub.export import load_image_processor

logger = logging.getLogger("finetune")


@dataclass
class ModelArguments:
    """Which encoder to start from."""

    model_name_or_path: str = field(
        default="outputs/pretrain/encoder",
        metadata={"help": "An encoder export: a local folder (training/pretrain.py's OUTPUT_DIR/encoder) or a Hub id."})
    compare_random_init: bool = field(
        default=False, metadata={"help": "Also train the same architecture from random init and print both."})


@dataclass
class DataArguments:
    """The labelled dataset: the embedded digits by default, or any Hub image-classification dataset."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset name; default: the embedded 5,000 MNIST digits."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    image_column: str | None = field(default=None, metadata={"help": "Image column; found automatically."})
    label_column: str = field(default="label", metadata={"help": "Label column."})
    test_split_size: float = field(default=0.2, metadata={"help": "Held-out fraction when there is no test split."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training split."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the test split."})


TRAINING_DEFAULTS = dict(
    output_dir="outputs/finetune",
    num_train_epochs=3,
    per_device_train_batch_size=128,
    per_device_eval_batch_size=256,
    learning_rate=1e-3,
    weight_decay=0.05,
    lr_scheduler_type="cosine",
    warmup_steps=0.1,
    logging_steps=10,
    eval_strategy="no",
    save_strategy="no",
    report_to="none",
    remove_unused_columns=False,  # the images become pixel_values in with_transform
    dataloader_num_workers=0,
    seed=0,
)


def load_labelled_splits(data: DataArguments, seed: int = 0, dataset: datasets.DatasetDict | None = None):
    """``(train, test, label_names, image_column, name)`` of the dataset ``data`` describes.

    Args:
        data: the dataset, columns and truncation.
        seed: seed of the split (when there is no test split) and of the training subset.
        dataset: an already loaded ``DatasetDict`` to use instead of ``data.dataset_name``.

    Raises:
        ValueError: no train split, or the label column is missing.
    """
    if dataset is not None:
        splits, name = dataset, data.dataset_name or "the given dataset"
    elif data.dataset_name is None:
        splits, name = hf_contrast.load_default_dataset(test_size=data.test_split_size, seed=seed), "MNIST digits"
    else:
        splits, name = datasets.load_dataset(data.dataset_name, data.dataset_config_name), data.dataset_name
    if "train" not in splits:
        raise ValueError(f"The dataset {name!r} has no 'train' split; its splits are {list(splits)}")
    train = splits["train"]
    if data.label_column not in train.column_names:
        raise ValueError(f"label_column={data.label_column!r} is not a column of {name!r}; its columns are "
                         f"{train.column_names}: pass --label_column NAME")
    test = next((splits[s] for s in ("test", "validation") if s in splits), None)
    if test is None:
        parts = train.train_test_split(test_size=data.test_split_size, seed=seed)
        train, test = parts["train"], parts["test"]
    if data.max_train_samples is not None:
        train = train.shuffle(seed=seed).select(range(min(data.max_train_samples, len(train))))
    if data.max_eval_samples is not None:
        test = test.select(range(min(data.max_eval_samples, len(test))))
    feature = train.features[data.label_column]
    if isinstance(feature, datasets.ClassLabel):
        label_names = list(feature.names)
    else:  # plain integers
        label_names = [str(i) for i in range(int(max(max(train[data.label_column]), max(test[data.label_column]))) + 1)]
    return train, test, label_names, find_image_column(train, data.image_column), name


def with_processor(dataset: datasets.Dataset, processor, image_column: str, label_column: str) -> datasets.Dataset:
    """Items ``{"pixel_values" (3, H, W), "labels"}``: images made RGB, then the export's own
    preprocessing (its ``pretrained_cfg``: size, mean/std), applied lazily."""

    def transform(batch):
        pixels = processor([to_rgb(im) for im in batch[image_column]], return_tensors="pt")["pixel_values"]
        return {"pixel_values": list(pixels), "labels": batch[label_column]}  # (B, 3, H, W) as a list

    return dataset.with_transform(transform)


@torch.no_grad()
def timm_random_init_(model, seed: int = 0):
    """Give a transformers ``TimmWrapper`` model timm's own random init of its architecture, drawn
    with ``seed``: the point contrastive pretraining starts from (transformers' ``from_config``
    initialises differently). The global random state is left as it was."""
    config = model.config
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fresh = timm.create_model(config.architecture, pretrained=False, num_classes=model.timm_model.num_classes,
                                  **(config.model_args or {}))
    model.timm_model.load_state_dict(fresh.state_dict())
    return model


def load_classifier(model_name_or_path: str, label_names: list[str], random_init: bool = False, seed: int = 0):
    """``AutoModelForImageClassification`` with a new ``len(label_names)``-way head: on the exported
    encoder, or (``random_init``) on the same architecture at timm's random init drawn with ``seed``."""
    model = AutoModelForImageClassification.from_pretrained(
        model_name_or_path, num_labels=len(label_names), id2label=dict(enumerate(label_names)),
        label2id={n: i for i, n in enumerate(label_names)})
    return timm_random_init_(model, seed) if random_init else model


def accuracy(eval_prediction) -> dict[str, float]:
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def finetune(model_args: ModelArguments, splits, label_column: str, training_args: TrainingArguments,
             random_init: bool = False) -> float:
    """Train one classifier with the plain ``transformers.Trainer``; return its test accuracy.

    Args:
        splits: ``(train, test, label_names, image_column, name)`` from :func:`load_labelled_splits`.
    """
    train, test, label_names, image_column, _ = splits
    processor = load_image_processor(model_args.model_name_or_path)
    set_seed(training_args.seed)
    model = load_classifier(model_args.model_name_or_path, label_names, random_init, training_args.seed)
    trainer = Trainer(
        model=model, args=training_args, compute_metrics=accuracy,
        train_dataset=with_processor(train, processor, image_column, label_column),
        eval_dataset=with_processor(test, processor, image_column, label_column),
    )
    use_numeric_progress(trainer)  # {'loss': 2.38, ...}, not {'loss': '2.38', ...}
    trainer.train()
    if not random_init:
        trainer.save_model(os.path.join(training_args.output_dir, "model"))
    return trainer.evaluate()["eval_accuracy"]


def training_length(training_args: TrainingArguments) -> str:
    """How long each model trained, as the Trainer reads the arguments: ``--max_steps`` wins over epochs."""
    if training_args.max_steps > 0:
        return f"{training_args.max_steps} optimizer steps"
    return f"{training_args.num_train_epochs:g} epochs"


def main(argv: list[str] | None = None, dataset: datasets.DatasetDict | None = None) -> dict[str, float]:
    """Run the script with command-line ``argv``; ``dataset`` replaces the one the flags name (tests,
    notebooks)."""
    parser = make_parser((ModelArguments, DataArguments, TrainingArguments))
    parser.set_defaults(**TRAINING_DEFAULTS)
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    fit_loader_to_device(training_args)  # no pin_memory warning on the CPU
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_warning()

    splits = load_labelled_splits(data_args, training_args.seed, dataset)
    results = {"accuracy_pretrained": finetune(model_args, splits, data_args.label_column, training_args)}
    if model_args.compare_random_init:
        results["accuracy_random_init"] = finetune(model_args, splits, data_args.label_column, training_args,
                                                   random_init=True)
    if training_args.process_index == 0:
        print(f"\nFine-tuned {model_args.model_name_or_path} ({training_length(training_args)}), test accuracy:")
        print(f"  {'pretrained encoder':<32} {results['accuracy_pretrained']:.4f}")
        if "accuracy_random_init" in results:
            print(f"  {'same architecture, random init':<32} {results['accuracy_random_init']:.4f}")
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    run_main(main, make_parser((ModelArguments, DataArguments, TrainingArguments)))
