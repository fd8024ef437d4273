"""Split-BatchNorm for MoCo's key encoder on one process, in ONE forward pass.

Shuffle-BN needs several processes: on one, a shuffled batch has the same BatchNorm statistics as
the query's batch. MoCo's single-GPU demo instead normalises the key batch in sub-batches (its
``SplitBatchNorm``). Here sub-batch ``k`` of S is the contiguous rows ``k * N / S ... (k + 1) * N / S - 1``
of the (shuffled) key batch: ``x.unflatten(0, (S, N / S))`` is a view in NCHW and channels_last
alike, ``var_mean`` over it gives ``(S, C)`` statistics, and one broadcast ``addcmul`` normalises and
applies the layer's own affine parameters (on the CPU, whose ``var_mean`` is slow, the statistics come
from two fp32 passes: the mean, then the mean square of ``x - mean``). No copy of the activation, no per-layer repeat of the
parameters, no host read (``momentum=None`` uses ``num_batches_tracked`` on the device), static shapes:
``torch.compile`` traces it without a graph break. The running statistics are updated as MoCo's
``SplitBatchNorm`` does: with the mean over the sub-batches of each one's mean and unbiased variance.

The key encoder's BatchNorm layers are swapped for these subclasses; parameters and buffers keep
their names, so checkpoints and the EMA are unchanged. With ``num_splits == 1`` (the default, and
what :meth:`~hf_contrast.MoCoModel.encode_keys` sets outside its key forward) they are plain
BatchNorm layers.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Devices whose statistics take two passes (mean, then mean square of x - mean) instead of one var_mean:
# the CPU's var_mean over these dimensions is a scalar Welford loop, several times slower.
TWO_PASS_DEVICES = {"cpu"}


def split_batch_norm_train(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, splits: int) -> torch.Tensor:
    """Training-mode BatchNorm of ``x`` ``(N, C, ...)`` with statistics per contiguous sub-batch of ``N / splits``
    rows; updates ``bn``'s running statistics as MoCo's ``SplitBatchNorm``. Output in ``x``'s memory format."""
    n, c = x.shape[0], x.shape[1]
    xs = x.unflatten(0, (splits, n // splits))  # (S, N/S, C, ...): a view in any memory format
    dims = [1, *range(3, xs.ndim)]  # all but the sub-batch and the channel
    if xs.device.type in TWO_PASS_DEVICES:
        mean = xs.mean(dims, dtype=torch.float32, keepdim=True)  # (S, 1, C, 1...)
        centred = xs - mean  # (S, N/S, C, ...) fp32, a temporary
        var = (centred * centred).mean(dims)  # (S, C) biased, two-pass: no cancellation
        mean = mean.view(splits, c)  # (S, C)
    else:  # one Welford pass, fp32 accumulation
        var, mean = torch.var_mean(xs, dim=dims, correction=0)  # (S, C) each, biased
        if var.dtype != torch.float32:  # low-precision input: the stats were accumulated in fp32
            var, mean = var.float(), mean.float()
    scale = torch.rsqrt(var + bn.eps)  # (S, C)
    if bn.weight is not None:
        scale = scale * bn.weight  # (S, C)
    shift = -mean * scale if bn.bias is None else torch.addcmul(bn.bias, mean, scale, value=-1)  # (S, C) b - mean * scale
    if x.dtype != torch.float32:
        scale, shift = scale.to(x.dtype), shift.to(x.dtype)
    shape = (splits, 1, c) + (1,) * (xs.ndim - 3)  # (S, 1, C, 1...) against (S, N/S, C, ...)
    y = torch.addcmul(shift.view(shape), xs, scale.view(shape))  # (S, N/S, C, ...): (x - mean) / std * w + b
    if bn.running_mean is not None:
        with torch.no_grad():
            weight = bn.momentum
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
                if weight is None:  # cumulative moving average, as nn.BatchNorm (on the device: no host read)
                    weight = bn.num_batches_tracked.reciprocal()  # () float32
            weight = 0.0 if weight is None else weight
            count = xs.numel() // (splits * c)  # values per channel in one sub-batch
            bn.running_mean.lerp_(mean.mean(0), weight)  # (C,) the mean over the sub-batches, as MoCo's demo
            bn.running_var.lerp_(var.mean(0).mul_(count / (count - 1)), weight)  # unbiased, as F.batch_norm
    return y.flatten(0, 1)  # (N, C, ...)


class _SplitBatchNormMixin:
    num_splits: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.num_splits
        if s == 1 or not self.training:
            return super().forward(x)
        n = x.shape[0]
        if n % s or n // s < 2:
            raise ValueError(
                f"key_bn_splits={s} needs a key batch that splits into {s} equal sub-batches of at least 2 images, "
                f"got a batch of {n}: use a per-device batch divisible by key_bn_splits (and >= 2 * key_bn_splits), "
                "or key_bn_splits=1."
            )
        self._check_input_dim(x)
        return split_batch_norm_train(self, x, s)


class SplitBatchNorm1d(_SplitBatchNormMixin, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that, with ``num_splits = S > 1`` in training, normalises S contiguous
    sub-batches separately (see the module docstring)."""


class SplitBatchNorm2d(_SplitBatchNormMixin, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that, with ``num_splits = S > 1`` in training, normalises S contiguous
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
