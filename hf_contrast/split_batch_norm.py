"""Split-BatchNorm for MoCo's key encoder on one process, in ONE forward pass.

Shuffle-BN needs several processes: on one, a shuffled batch has the same BatchNorm statistics as
the query's batch. MoCo's single-GPU demo instead normalises the key batch in sub-batches (its
``SplitBatchNorm``): the batch ``(N, C, ...)`` is viewed as ``(N / S, S * C, ...)``, so one
``batch_norm`` call gives each of the S sub-batches (rows ``i, i + S, i + 2S, ...``) its own
statistics. The key encoder's BatchNorm layers are swapped for these subclasses; parameters and
buffers keep their names, so checkpoints and the EMA are unchanged. With ``num_splits == 1`` (the
default, and what :meth:`~hf_contrast.MoCoModel.encode_keys` sets outside its key forward) they are
plain BatchNorm layers.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class _SplitBatchNormMixin:
    num_splits: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.num_splits
        if s == 1 or not self.training:
            return super().forward(x)
        n, c = x.shape[0], x.shape[1]
        if n % s or n // s < 2:
            raise ValueError(
                f"key_bn_splits={s} needs a key batch that splits into {s} equal sub-batches of at least 2 images, "
                f"got a batch of {n}: use a per-device batch divisible by key_bn_splits (and >= 2 * key_bn_splits), "
                "or key_bn_splits=1."
            )
        tracked = self.running_mean is not None
        split_mean = self.running_mean.repeat(s) if tracked else None  # (S * C,) every sub-batch starts alike
        split_var = self.running_var.repeat(s) if tracked else None
        momentum = 0.0 if self.momentum is None else self.momentum
        if tracked and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        weight = self.weight.repeat(s) if self.weight is not None else None
        bias = self.bias.repeat(s) if self.bias is not None else None
        y = F.batch_norm(
            x.reshape(n // s, s * c, *x.shape[2:]),  # (N / S, S * C, ...): row j, channel k*C + c is image j*S + k
            split_mean, split_var, weight, bias, True, momentum, self.eps,
        ).reshape(x.shape)
        if tracked:
            with torch.no_grad():  # the running statistics: the mean over the sub-batches, as MoCo's demo
                self.running_mean.copy_(split_mean.view(s, c).mean(0))
                self.running_var.copy_(split_var.view(s, c).mean(0))
        return y


class SplitBatchNorm1d(_SplitBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that, with ``num_splits = S > 1`` in training, normalises S interleaved
    sub-batches separately (see the module docstring)."""


class SplitBatchNorm2d(_SplitBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that, with ``num_splits = S > 1`` in training, normalises S interleaved
    sub-batches separately (see the module docstring)."""


_SPLIT_CLASSES = {nn.BatchNorm1d: SplitBatchNorm1d, nn.BatchNorm2d: SplitBatchNorm2d}


def convert_split_batch_norm(module: nn.Module) -> nn.Module:
    """Swap every plain ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` inside ``module`` for its split twin,
    in place, reusing the same parameter and buffer tensors. Other normalisation layers (e.g.
    timm's ``BatchNormAct2d``) are left as they are, with a warning: they keep full-batch statistics."""
    others = []
    for name, child in list(module.named_children()):
        twin = _SPLIT_CLASSES.get(type(child))
        if twin is not None:
            child.__class__ = twin  # same tensors, same names; only forward changes
        elif isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, _SplitBatchNormMixin):
            others.append(name)
        else:
            convert_split_batch_norm(child)
    if others:
        logger.warning(f"key_bn_splits: {others} are not plain BatchNorm1d/2d layers and keep full-batch statistics")
    return module


@contextlib.contextmanager
def split_batch_norm(modules: list[nn.Module], num_splits: int):
    """Within the block, the split BatchNorm layers of ``modules`` use ``num_splits`` sub-batches."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, _SplitBatchNormMixin)]
    for m in layers:
        m.num_splits = num_splits
    try:
        yield
    finally:
        for m in layers:
            m.num_splits = 1
