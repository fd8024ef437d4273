#!/usr/bin/env python
"""Peak memory of the contrastive losses' forward + backward: the earlier implementation next to today's.

Issue 23 item 5: NT-Xent built a ``(2N, 2M)`` self-mask and a ``masked_fill`` copy of its logits, and
MoCo's same-instance masking (on by default) made several ``(B, 1 + K)`` bool temporaries and copies
of the logits per half, then ``F.cross_entropy`` saved a log-softmax copy and made two gradients.
Today the logits are one buffer with the masks written into it in place, and the loss is
``hf_contrast.models.losses.cross_entropy`` (one gradient buffer). The earlier code is kept below as a
reference copy (``old_*``, as it was at commit 74a268a), run on the same embeddings.

Measured per case (the embeddings, the queue and its ids already exist; the step is what the loss
adds on top of them): ``hf_contrast.peak_memory_bytes`` of logits + loss + backward down to the
query embeddings, the logits kept alive through the backward as a model's output keeps them. On CPU
that is the peak of PyTorch's allocator events recorded by ``torch.profiler`` (see
``hf_contrast.memory_probe``), on CUDA ``max_memory_allocated``. Each case also checks that both
implementations give the same loss and gradient.

    python benchmarks/loss_memory.py                          # B = 256, K = 65536, D = 128, N = 256
    python benchmarks/loss_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F

from hf_contrast import MoCoConfig, MoCoModel, peak_memory_bytes
from hf_contrast.models.losses import contrastive_loss, nt_xent_logits

UNKNOWN_INSTANCE = -1


# ----------------------------------------------------------------------------------------------------
# The earlier implementation (reference copy; MoCo without false-negative cancellation, as by default)
# ----------------------------------------------------------------------------------------------------


def old_nt_xent_logits(z_a, z_b, temperature):
    """``nt_xent_logits`` before: a ``(2N, 2M)`` bool self-mask and a ``masked_fill`` copy (one process)."""
    n = m = z_a.shape[0]
    anchors = F.normalize(torch.cat([z_a, z_b]).float(), dim=-1)  # (2N, D)
    candidates = F.normalize(torch.cat([z_a, z_b]).float(), dim=-1)  # (2M, D)
    logits = anchors @ candidates.T / temperature  # (2N, 2M)
    rows = torch.arange(2 * n, device=z_a.device)
    idx = torch.arange(n, device=z_a.device)
    self_cols = torch.cat([idx, idx + m])
    positives = torch.cat([idx + m, idx])
    self_mask = torch.zeros_like(logits, dtype=torch.bool)
    self_mask[rows, self_cols] = True
    return logits.masked_fill(self_mask, float("-inf")), positives


def old_info_nce_logits(query, key, negatives, temperature, valid=None):
    q, k, neg = (F.normalize(x.float(), dim=-1) for x in (query, key, negatives))
    l_pos = torch.einsum("nd,nd->n", q, k).unsqueeze(-1)  # (N, 1)
    l_neg = torch.einsum("nd,kd->nk", q, neg)  # (N, K)
    if valid is not None:
        l_neg = l_neg.masked_fill(~valid, float("-inf"))
    logits = torch.cat([l_pos, l_neg], dim=1) / temperature  # (N, 1 + K)
    return logits, torch.zeros(q.shape[0], dtype=torch.long, device=q.device)


def old_same_instance_mask(anchor_ids, candidate_ids):
    anchor_ids = anchor_ids.reshape(-1, 1)
    return (anchor_ids == candidate_ids.reshape(1, -1)) & (anchor_ids != UNKNOWN_INSTANCE)  # (A, K)


def old_cancel_negatives(logits, labels, excluded):
    """``cancel_negatives`` without false-negative cancellation (``scores=None``)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    positive = torch.zeros_like(excluded)
    positive[rows, labels] = True  # (A, C)
    masked = excluded & ~positive
    negatives = logits.shape[1] - excluded.sum(1)
    kept = logits.shape[1] - 1 - masked.sum(1)
    return logits.masked_fill(masked, float("-inf")), negatives, kept


def old_moco_half(q, k, negatives, negative_ids, valid, instance_ids, stand_in, temperature):
    """``MoCoModel._logits`` + ``_contrast`` before, one half, ``exclude_same_instance=True``."""
    logits, labels = old_info_nce_logits(q, k, negatives, temperature, valid)  # (B, 1 + K)
    n, width = q.shape[0], logits.shape[1] - 1
    if negatives.shape[0] < n:
        logits = F.pad(logits, (0, n - negatives.shape[0]), value=float("-inf"))
    in_batch = F.normalize(q.float(), dim=-1) @ F.normalize(k.float(), dim=-1).T / temperature  # (B, B)
    in_batch_masked = torch.eye(n, dtype=torch.bool, device=q.device) | ~stand_in
    logits[:, 1 : 1 + n] = torch.where(in_batch_masked, logits[:, 1 : 1 + n], in_batch)
    width = logits.shape[1] - 1
    ids = instance_ids.to(negative_ids.device)
    invalid = ~valid | old_same_instance_mask(ids, negative_ids)  # (B, K)
    excluded = F.pad(invalid.expand(n, -1), (1, width - invalid.shape[-1]), value=True)  # (B, 1 + K)
    own = in_batch_masked | old_same_instance_mask(ids, ids)
    excluded[:, 1 : 1 + n] = torch.where(stand_in, own, excluded[:, 1 : 1 + n])
    logits, _, kept = old_cancel_negatives(logits, labels, excluded)
    return logits, labels, kept


# ----------------------------------------------------------------------------------------------------


def moco_case(model, b, halves, device, old):
    """The loss step of a MoCo model over ``halves`` query/key pairings of ``b`` images (training, full queue)."""
    g = torch.Generator().manual_seed(1)
    d = model.config.projection_dim
    queries = [torch.randn(b, d, generator=g).to(device).requires_grad_() for _ in range(halves)]  # (B, D) leaves
    keys = [F.normalize(torch.randn(b, d, generator=g), dim=1).to(device) for _ in range(halves)]
    ids = torch.arange(b, device=device)
    queue = (model.queue.keys, model.queue.instance_ids, model.queue.valid())
    stand_in = model.queue.filled == 0  # () False: the queue is full
    t = model.config.temperature
    result = {}

    def step():
        if old:
            parts = [old_moco_half(q, k, *queue, ids, stand_in, t) for q, k in zip(queries, keys, strict=True)]
            logits, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (2B, 1 + K)
            loss = F.cross_entropy(logits, labels)
        else:
            q, k = torch.cat(queries), torch.cat(keys)  # what MoCoModel.forward hands _contrast
            logits, labels, *_ = model._contrast(q, k, *queue, ids.repeat(halves), stand_in, halves)
            loss = contrastive_loss(logits, labels, t)
        loss.backward()
        result.update(loss=loss.detach(), grads=[q.grad.clone() for q in queries], logits_bytes=logits.numel() * 4)
        del logits  # the model's output holds the logits until here

    return step, result, queries


def nt_xent_case(n, d, t, device, old):
    g = torch.Generator().manual_seed(2)
    z_a, z_b = (torch.randn(n, d, generator=g).to(device).requires_grad_() for _ in range(2))
    result = {}

    def step():
        if old:
            logits, positives = old_nt_xent_logits(z_a, z_b, t)
            loss = F.cross_entropy(logits, positives)
        else:
            logits, positives = nt_xent_logits(z_a, z_b, t)
            loss = contrastive_loss(logits, positives, t)
        loss.backward()
        result.update(loss=loss.detach(), grads=[z_a.grad.clone(), z_b.grad.clone()], logits_bytes=logits.numel() * 4)
        del logits

    return step, result, (z_a, z_b)


def measure(make, device):
    """Peak bytes of the old and the new step (after one warm-up each), their loss and gradient gap."""
    out = {}
    for old in (True, False):
        step, result, leaves = make(old)
        step()  # warm-up: lazy inits
        for x in leaves:
            x.grad = None
        out[old] = (peak_memory_bytes(step, device), result)
    (old_peak, old_res), (new_peak, new_res) = out[True], out[False]
    loss_gap = (old_res["loss"] - new_res["loss"]).abs().item()
    grad_gap = max((a - b).abs().max().item() for a, b in zip(old_res["grads"], new_res["grads"], strict=True))
    grad_scale = max(a.abs().max().item() for a in old_res["grads"])
    return old_peak, new_peak, new_res["logits_bytes"], loss_gap, grad_gap / grad_scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, default=256, help="MoCo's B")
    p.add_argument("--queue_size", type=int, default=65536, help="MoCo's K")
    p.add_argument("--dim", type=int, default=128, help="embedding width D")
    p.add_argument("--nt_xent_batch", type=int, default=256, help="SimCLR's N (logits (2N, 2N))")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = MoCoConfig(backbone="test_resnet", image_size=32, projection_hidden_dim=32, projection_dim=a.dim,
                        queue_size=a.queue_size, temperature=a.temperature)
    model = MoCoModel(config).to(device).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50 * a.batch_size, (a.queue_size,), generator=g)  # some of the batch's images queued
    model.enqueue(torch.randn(a.queue_size, a.dim, generator=g).to(device), ids.to(device))
    print(f"device {device}; B = {a.batch_size}, K = {a.queue_size}, D = {a.dim}; NT-Xent N = {a.nt_xent_batch}; "
          f"peak of logits + loss + backward (MiB), earlier implementation vs today's")
    print(f"{'case':<34}{'logits':>9}{'before':>10}{'after':>10}{'ratio':>8}   loss gap / grad gap (rel)")
    cases = [
        ("MoCo v2 (B, 1 + K), same-instance", lambda old: moco_case(model, a.batch_size, 1, device, old)),
        ("MoCo v2 symmetric (2B, 1 + K)", lambda old: moco_case(model, a.batch_size, 2, device, old)),
        ("NT-Xent (2N, 2N)", lambda old: nt_xent_case(a.nt_xent_batch, a.dim, a.temperature, device, old)),
    ]
    mib = 2.0**20
    for name, make in cases:
        old_peak, new_peak, logits_bytes, loss_gap, grad_gap = measure(make, device)
        print(f"{name:<34}{logits_bytes / mib:9.1f}{old_peak / mib:10.1f}{new_peak / mib:10.1f}"
              f"{old_peak / new_peak:7.2f}x   {loss_gap:.1e} / {grad_gap:.1e}")
        assert math.isfinite(loss_gap) and loss_gap < 1e-4 and grad_gap < 1e-5, (name, loss_gap, grad_gap)


if __name__ == "__main__":
    main()
