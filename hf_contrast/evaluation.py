"""Evaluation of frozen features: weighted kNN top-1 (the InstDisc / MoCo monitor), and the BatchNorm statistics
re-estimated on un-augmented images before an encoder is judged (Precise BN)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .data.map_dataset import eval_dataset

logger = logging.getLogger(__name__)


@torch.no_grad()
def extract_features(
    encoder: nn.Module | None, dataset, batch_size: int = 256, device: str | torch.device | None = None,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and labels of a dataset whose items hold ``pixel_values`` and ``labels``.

    Args:
        encoder: maps ``(B, C, H, W)`` to ``(B, F)``; ``None`` returns the flattened pixels.
        dataset: e.g. :func:`hf_contrast.data.eval_dataset`.
        batch_size: images per forward.
        device: where to run; defaults to the encoder's device.
        progress: show a progress bar.

    Returns:
        ``(features (N, F) float32 on CPU, labels (N,) long)``.
    """
    if encoder is not None:
        was_training = encoder.training
        encoder.eval()
        device = device or next(encoder.parameters()).device
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    feats, labels = [], []
    for batch in tqdm(loader, desc="features", disable=not progress, leave=False):
        x = batch["pixel_values"]
        f = x.flatten(1) if encoder is None else encoder(x.to(device)).float().cpu()  # (B, F)
        feats.append(f)
        labels.append(torch.as_tensor(batch["labels"]))
    if encoder is not None:
        encoder.train(was_training)
    return torch.cat(feats), torch.cat(labels)


@torch.no_grad()
def knn_top1(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    k: int = 200,
    temperature: float = 0.1,
    chunk_size: int = 1024,
) -> float:
    """Weighted kNN top-1 accuracy with cosine similarity (Wu et al. 2018, MoCo's CIFAR monitor).

    Each test sample votes over its ``k`` nearest training samples, each weighted by
    ``exp(cos / temperature)``; the class with the largest summed weight wins.
    """
    if train_features.shape[0] == 0 or test_features.shape[0] == 0:
        raise ValueError("knn_top1 needs at least one training and one test sample")
    k = min(k, train_features.shape[0])
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    bank = F.normalize(train_features.float(), dim=1)  # (Ntr, F)
    correct = 0
    for start in range(0, test_features.shape[0], chunk_size):
        q = F.normalize(test_features[start : start + chunk_size].float(), dim=1)  # (b, F)
        sim, idx = (q @ bank.T).topk(k, dim=1)  # (b, k)
        weights = (sim / temperature).exp()  # (b, k)
        votes = torch.zeros(q.shape[0], num_classes)
        votes.scatter_add_(1, train_labels[idx].long(), weights)  # (b, C)
        correct += (votes.argmax(1) == test_labels[start : start + chunk_size]).sum().item()
    return correct / test_features.shape[0]


def knn_accuracy(encoder: nn.Module | None, train_dataset, test_dataset, k: int = 200,
                 temperature: float = 0.1, batch_size: int = 256, progress: bool = False) -> float:
    """Extract features of both splits with ``encoder`` (``None``: raw pixels) and return kNN top-1."""
    train = extract_features(encoder, train_dataset, batch_size, progress=progress)
    test = extract_features(encoder, test_dataset, batch_size, progress=progress)
    return knn_top1(*train, *test, k=k, temperature=temperature)


@torch.no_grad()
def recalibrate_batch_norm(encoder: nn.Module, dataset, max_batches: int = 8, batch_size: int = 256,
                           seed: int = 0) -> nn.Module:
    """Re-estimate BatchNorm running statistics of ``encoder`` on ``dataset`` (items with
    ``pixel_values``), as a cumulative average over up to ``max_batches`` batches (Precise BN, Wu &
    Johnson 2021, "Rethinking 'Batch' in BatchNorm"). Weights are untouched; the batches are drawn with a
    generator seeded by ``seed`` (the global RNG is untouched). Returns ``encoder``.

    Two uses: a randomly initialised encoder evaluated with its initial running statistics (mean 0,
    var 1) gives features that say nothing about it, so a fair random-init baseline recalibrates
    first; and a pretrained encoder's running statistics describe the augmented views it was trained
    on (jittered brightness and contrast, crops), not the un-augmented images it will embed, so
    ``training/pretrain.py`` re-estimates them on the training images before it saves and exports."""
    norms = [m for m in encoder.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return encoder
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average over the batches seen
    was_training = encoder.training
    encoder.train()
    device = next(encoder.parameters()).device
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    for i, batch in enumerate(loader):
        if i == max_batches:
            break
        encoder(batch["pixel_values"].to(device))
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    encoder.train(was_training)
    return encoder


def precise_batch_norm(model, train, augmentation, data_args, training_args) -> int:
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
