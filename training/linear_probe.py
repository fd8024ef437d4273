#!/usr/bin/env python
"""Linear probe of an exported encoder: a linear classifier trained on its frozen features.

The encoder export (a local folder or a Hub repo id) is loaded with ``transformers.AutoModel`` and
its own preprocessing (``AutoImageProcessor``); the pooled features of both splits are extracted
once, standardised with the training split's statistics, and a multinomial logistic regression is
fitted on them (full-batch L-BFGS). The weighted kNN top-1 of the same features is
printed alongside. With no arguments it probes ``outputs/pretrain/encoder`` on the embedded
4,000 / 1,000 MNIST digits in well under a minute on two CPU cores.

    python training/linear_probe.py --model_name_or_path outputs/pretrain/encoder --compare_random_init
    python training/linear_probe.py --model_name_or_path ORG/NAME --dataset_name cifar10 --image_column img

Every field of the dataclasses below is a command-line flag (``--help`` lists them).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import torch
import torch.nn.functional as F
import transformers
from finetune import DataArguments, load_labelled_splits, timm_random_init_, with_processor
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModel

from hf_contrast import knn_top1
from hf_contrast.cli import make_parser, run_main
from hf_contrast.hub.export import load_image_processor

logger = logging.getLogger("linear_probe")


@dataclass
class ProbeArguments:
    """The encoder and the probe's optimisation."""

    model_name_or_path: str = field(
        default="outputs/pretrain/encoder",
        metadata={"help": "An encoder export: a local folder (training/pretrain.py's OUTPUT_DIR/encoder) or a Hub id."})
    compare_random_init: bool = field(
        default=False, metadata={"help": "Also probe the same architecture at random init and print both."})
    max_iter: int = field(default=300, metadata={"help": "L-BFGS iterations of the probe."})
    l2: float = field(default=1e-4, metadata={"help": "Weight penalty of the probe."})
    batch_size: int = field(default=256, metadata={"help": "Images per forward of the feature extraction."})
    knn_k: int = field(default=200, metadata={"help": "Neighbours of the kNN top-1 printed alongside."})
    seed: int = field(default=0, metadata={"help": "Seed of the split and of the random init."})
    output_dir: str = field(default="outputs/linear_probe", metadata={"help": "Where results.json goes."})


@torch.no_grad()
def extract(model: nn.Module, dataset, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled features ``(N, F)`` and labels ``(N,)`` of a dataset of ``pixel_values`` / ``labels``."""
    model.eval()
    feats, labels = [], []
    for batch in DataLoader(dataset, batch_size=batch_size):
        feats.append(model(pixel_values=batch["pixel_values"]).pooler_output.float())  # (B, F)
        labels.append(torch.as_tensor(batch["labels"]))
    return torch.cat(feats), torch.cat(labels)


def train_linear_probe(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor,
                       num_classes: int, max_iter: int = 300, l2: float = 1e-4) -> dict[str, float]:
    """Multinomial logistic regression on standardised features; return train and test accuracy.

    Full-batch L-BFGS from a zero init on a convex loss (cross-entropy + ``l2 * ||W||^2``): the result
    does not depend on a seed, a batch size or a learning rate.

    Args:
        train_x, test_x: features ``(N, F)``; standardised with ``train_x``'s mean and std.
        train_y, test_y: integer labels ``(N,)``.
        max_iter: L-BFGS iterations.
        l2: weight penalty.
    """
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    probe = nn.Linear(train_x.shape[1], num_classes)
    nn.init.zeros_(probe.weight)
    nn.init.zeros_(probe.bias)
    optimizer = torch.optim.LBFGS(probe.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                                  line_search_fn="strong_wolfe", tolerance_grad=1e-6, tolerance_change=1e-9)

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(train_x), train_y) + l2 * probe.weight.square().sum()  # logits (N, C)
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # hundreds of small steps: thread synchronisation would cost more than the matmuls
    try:
        optimizer.step(closure)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        return {"train_accuracy": (probe(train_x).argmax(1) == train_y).float().mean().item(),
                "accuracy": (probe(test_x).argmax(1) == test_y).float().mean().item()}


def probe(args: ProbeArguments, splits, label_column: str, random_init: bool = False) -> dict[str, float]:
    """Features of the export (or of its architecture at timm's random init), then the probe and kNN.

    Args:
        splits: ``(train, test, label_names, image_column, name)`` from ``load_labelled_splits``.
    """
    train, test, label_names, image_column, _ = splits
    processor = load_image_processor(args.model_name_or_path)
    model = AutoModel.from_pretrained(args.model_name_or_path)
    if random_init:
        timm_random_init_(model, args.seed)
    train_x, train_y = extract(model, with_processor(train, processor, image_column, label_column), args.batch_size)
    test_x, test_y = extract(model, with_processor(test, processor, image_column, label_column), args.batch_size)
    result = train_linear_probe(train_x, train_y, test_x, test_y, len(label_names), args.max_iter, args.l2)
    result["knn_top1"] = knn_top1(train_x, train_y, test_x, test_y, k=args.knn_k)
    return result


def main(argv: list[str] | None = None, dataset: datasets.DatasetDict | None = None) -> dict[str, dict[str, float]]:
    """Run the script with command-line ``argv``; ``dataset`` replaces the one the flags name (tests,
    notebooks)."""
    parser = make_parser((ProbeArguments, DataArguments))
    args, data_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity_error()

    splits = load_labelled_splits(data_args, args.seed, dataset)
    results = {"pretrained": probe(args, splits, data_args.label_column)}
    if args.compare_random_init:
        results["random_init"] = probe(args, splits, data_args.label_column, random_init=True)
    print(f"\nLinear probe of {args.model_name_or_path} (logistic regression on frozen features):")
    print(f"  {'':<32} {'test acc':>9} {'train acc':>9} {'kNN top-1':>9}")
    for name, r in results.items():
        label = "pretrained encoder" if name == "pretrained" else "same architecture, random init"
        print(f"  {label:<32} {r['accuracy']:>9.4f} {r['train_accuracy']:>9.4f} {r['knn_top1']:>9.4f}")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    run_main(main, make_parser((ProbeArguments, DataArguments)))
