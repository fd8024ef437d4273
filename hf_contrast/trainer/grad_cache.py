"""Gradient caching for SimCLR (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under
Memory Limited Setup"): the in-batch negatives of a large batch at the activation memory of a chunk.

The NT-Xent loss couples every view of the batch, but only through the embeddings, which are small.
So one step runs in three parts:

1. Pass 1 embeds the batch chunk by chunk without grad, saving the RNG state before each chunk.
2. The loss over all views (gathered across processes with gradient, as without caching) is
   back-propagated to the embeddings only: detached leaves that require grad. Their ``.grad`` is
   the cache, ``(2N, D)``.
3. Pass 2 re-runs each chunk with grad under the RNG state pass 1 saw (same dropout and
   stochastic-depth masks, hence the same embeddings) and back-propagates the cached gradients
   with ``torch.autograd.backward(z_chunk, grad_chunk)``.

The gradients equal the full batch's up to float rounding for any model whose forward treats the
images of a batch independently. BatchNorm does not: it normalises each chunk with that chunk's
statistics, so the model trained is a "chunk-BN" model (gradients are exact for it, and running
statistics are updated once per chunk, by pass 2 only). A warning says so when the model has any.
The price is one extra forward pass without grad (about a third of a forward + backward).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import distributed
from ..models.base import ContrastiveOutput
from ..models.losses import cross_entropy, nt_xent_logits


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel / ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def batch_norm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers (any dimension, synchronised or not) in ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class RngState:
    """The CPU RNG state and that of the accelerator ``device`` (the inputs' device, which need not be the
    current device), captured now, replayable later."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.device = device
        self.module = None if device.type == "cpu" else torch.get_device_module(device.type)
        self.cpu = torch.get_rng_state()
        self.accelerator = None if self.module is None else self._get()

    def _get(self) -> torch.Tensor:
        return self.module.get_rng_state(self.device) if self.device.index is not None else self.module.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.index is not None:
            self.module.set_rng_state(state, self.device)
        else:
            self.module.set_rng_state(state)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block with the captured states, then restore the states the block found."""
        cpu_now = torch.get_rng_state()
        accelerator_now = None if self.module is None else self._get()
        torch.set_rng_state(self.cpu)
        if self.module is not None:
            self._set(self.accelerator)
        try:
            yield
        finally:
            torch.set_rng_state(cpu_now)
            if self.module is not None:
                self._set(accelerator_now)


@contextlib.contextmanager
def _frozen_running_stats(model: nn.Module) -> Iterator[None]:
    """Undo the BatchNorm running-statistics updates made inside the block (pass 1's)."""
    buffers = [
        b
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for b in (m.running_mean, m.running_var, m.num_batches_tracked)
        if b is not None
    ]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def _embed(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """Embeddings ``(2c, D)`` of a chunk's two views ``(c, C, H, W)``, first views first.

    Goes through the (possibly DDP-wrapped) model's forward, so DDP prepares its gradient
    reduction and accelerate's autocast wrapper applies; the chunk's own logits are discarded."""
    return model(pixel_values=x1, pixel_values_2=x2, return_loss=False).embeddings


def grad_cache_step(
    model: nn.Module,
    pixel_values: torch.Tensor,
    pixel_values_2: torch.Tensor,
    chunk_size: int,
    *,
    loss_scale: float = 1.0,
    backward: Callable[[torch.Tensor], object] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    on_loss: Callable[[ContrastiveOutput], object] | None = None,
) -> ContrastiveOutput:
    """One gradient-cached SimCLR forward + backward: accumulates into ``.grad`` what
    ``model(pixel_values, pixel_values_2).loss * loss_scale`` would, chunk by chunk.

    Args:
        model: a :class:`SimCLRModel`, or it wrapped in DDP (then gradients are all-reduced once,
            after the last chunk) or by accelerate.
        pixel_values: first views of the per-device batch, ``(N, C, H, W)``.
        pixel_values_2: second views, ``(N, C, H, W)``.
        chunk_size: images per chunk (each chunk runs ``2 * chunk_size`` views); the last chunk
            may be smaller.
        loss_scale: factor on the loss before its backward (``1 / gradient_accumulation_steps``).
        backward: how to back-propagate the loss to the cached embeddings; ``Tensor.backward`` by
            default, ``accelerator.backward`` to apply a mixed-precision grad scaler (pass 2 then
            back-propagates the already scaled cached gradients).
        no_sync: context that stops DDP's gradient all-reduce; entered for every chunk but the
            last. Defaults to ``model.no_sync`` when the model has it.
        autocast: context for the forward passes (mixed precision); the loss runs in fp32 anyway.
        on_loss: called with the output once the loss is known, before any backward (a check that
            raises there leaves the gradients untouched).

    Returns:
        The step's :class:`ContrastiveOutput`: detached loss (unscaled), logits ``(2N, 2M)``, labels,
        embeddings ``(2N, D)`` and the negatives per anchor, as the uncached forward gives them.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is invalid: chunk_size must be an integer >= 1")
    inner = unwrap_model(model)
    bn = batch_norm_layers(inner)
    if bn:
        warnings.warn(
            f"Gradient caching with {len(bn)} BatchNorm layers (e.g. {bn[0]!r}): each chunk of {chunk_size} "
            "images is normalised with its own statistics, not the batch's, so the gradients are not the "
            "full batch's. Use a backbone and head without BatchNorm (projection_batch_norm=False) for "
            "exact in-batch gradients.",
            stacklevel=2,
        )
    backward = backward or torch.Tensor.backward
    no_sync = no_sync or getattr(model, "no_sync", contextlib.nullcontext)
    n = pixel_values.shape[0]
    chunks = [slice(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]

    # Pass 1: embeddings of every chunk without grad; the RNG state each chunk started from.
    states, z_a_parts, z_b_parts = [], [], []
    with torch.no_grad(), _frozen_running_stats(inner):
        for c in chunks:
            states.append(RngState(pixel_values.device))
            with autocast():
                z = _embed(model, pixel_values[c], pixel_values_2[c])  # (2c, D)
            z_a_parts.append(z[: z.shape[0] // 2])
            z_b_parts.append(z[z.shape[0] // 2 :])
    z_a = torch.cat(z_a_parts).requires_grad_()  # (N, D) leaf: its .grad is the cache
    z_b = torch.cat(z_b_parts).requires_grad_()  # (N, D)

    # The loss over all views, back-propagated to the embeddings only.
    gather = {}
    if inner.config.gather_distributed and distributed.is_distributed():
        gather = dict(
            z_a_all=distributed.gather_with_grad(z_a),
            z_b_all=distributed.gather_with_grad(z_b),
            rank=distributed.rank(),
        )  # (N * W, D) each
    logits, labels = nt_xent_logits(z_a, z_b, inner.config.temperature, **gather)  # (2N, 2M), (2N,)
    loss = cross_entropy(logits, labels)  # one (2N, 2M) gradient buffer
    outputs = ContrastiveOutput(
        loss=loss.detach(),
        logits=logits.detach(),
        labels=labels,
        embeddings=torch.cat([z_a, z_b]).detach(),
        num_negatives=logits.shape[1] - 2,
    )
    if on_loss is not None:
        on_loss(outputs)
    backward(loss * loss_scale)
    grad_a, grad_b = z_a.grad, z_b.grad  # (N, D) each, scaled like the loss

    # Pass 2: each chunk again with grad and pass 1's randomness; its cached gradients flow into the weights.
    for i, (c, state) in enumerate(zip(chunks, states, strict=True)):
        last = i == len(chunks) - 1
        with contextlib.nullcontext() if last else no_sync():
            with state.replay(), autocast():
                z = _embed(model, pixel_values[c], pixel_values_2[c])  # (2c, D)
            torch.autograd.backward(z, torch.cat([grad_a[c], grad_b[c]]).to(z.dtype))
    return outputs
