"""Diagnostics of contrastive training as pure functions over tensors: how consistent MoCo's queued
keys are with today's key encoder, how far the key encoder trails the query encoder, and the health
of the embedding distribution (alignment and uniformity, Wang & Isola 2020).

The training-time callbacks that compute them every N steps live in :mod:`hf_contrast.trainer.monitors`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def key_consistency(stored_keys: torch.Tensor, fresh_keys: torch.Tensor) -> float:
    """Mean cosine similarity between keys stored in the queue and the same inputs re-encoded now.

    1.0 means the queued keys could have been made by today's key encoder; lower values mean the
    negatives come from weights that no longer exist (MoCo's argument for a slow momentum encoder).

    Args:
        stored_keys: ``(N, D)`` keys as they were enqueued.
        fresh_keys: ``(N, D)`` keys of the same inputs from the current key encoder, row for row.
    """
    if stored_keys.ndim != 2 or stored_keys.shape != fresh_keys.shape or stored_keys.shape[0] == 0:
        raise ValueError(
            f"stored_keys and fresh_keys must be non-empty (N, D) tensors of one shape, got "
            f"{tuple(stored_keys.shape)} and {tuple(fresh_keys.shape)}"
        )
    a = F.normalize(stored_keys.float(), dim=1)  # (N, D)
    b = F.normalize(fresh_keys.float().to(a.device), dim=1)  # (N, D)
    return (a * b).sum(1).mean().item()  # mean of the N row-wise cosines


@torch.no_grad()
def parameter_drift(key_params: Iterable[torch.Tensor], query_params: Iterable[torch.Tensor]) -> float:
    """Relative distance ``||theta_k - theta_q|| / ||theta_q||`` over all parameters, flattened.

    0 when the key encoder equals the query encoder (momentum 0); it grows as the EMA lags behind.
    BatchNorm running statistics are buffers, not parameters: pass parameters only.
    """
    key_params, query_params = list(key_params), list(query_params)
    if len(key_params) != len(query_params) or not query_params:
        raise ValueError(f"key_params and query_params must be matching non-empty lists, got "
                         f"{len(key_params)} and {len(query_params)} tensors")
    diff_sq = sum((k.float() - q.float()).pow(2).sum() for k, q in zip(key_params, query_params, strict=True))
    norm_sq = sum(q.float().pow(2).sum() for q in query_params)
    if norm_sq == 0:
        raise ValueError("query_params are all zero: the relative drift is undefined")
    return (diff_sq.sqrt() / norm_sq.sqrt()).item()


@torch.no_grad()
def alignment(x: torch.Tensor, y: torch.Tensor, alpha: float = 2.0) -> float:
    """Alignment of positive pairs, ``E ||f(x) - f(y)||^alpha`` on L2-normalised embeddings
    (Wang & Isola 2020, alpha = 2). 0 when the two views of every image map to one point; at most
    ``2^alpha`` (antipodal pairs). Lower is better.

    Args:
        x: ``(N, D)`` embeddings of the first views.
        y: ``(N, D)`` embeddings of the second views, row for row.
        alpha: exponent of the distance, > 0.
    """
    if x.ndim != 2 or x.shape != y.shape or x.shape[0] == 0:
        raise ValueError(f"x and y must be non-empty (N, D) tensors of one shape, "
                         f"got {tuple(x.shape)} and {tuple(y.shape)}")
    if alpha <= 0:
        raise ValueError(f"alpha={alpha!r} is invalid: alpha must be > 0 (2 in Wang & Isola)")
    x, y = F.normalize(x.float(), dim=1), F.normalize(y.float(), dim=1)  # (N, D) each
    return (x - y).norm(dim=1).pow(alpha).mean().item()  # mean over the N pairs


@torch.no_grad()
def uniformity(x: torch.Tensor, t: float = 2.0) -> float:
    """Uniformity, ``log E exp(-t ||f(x_i) - f(x_j)||^2)`` over all pairs ``i < j`` of L2-normalised
    embeddings (Wang & Isola 2020, t = 2). 0 when all embeddings coincide (collapse); more negative
    is more uniform on the sphere (about ``-2 t`` for many random directions in high dimension).

    Args:
        x: ``(N, D)`` embeddings, N >= 2.
        t: the Gaussian potential's scale, > 0.
    """
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"x must be an (N, D) tensor with N >= 2, got {tuple(x.shape)}")
    if t <= 0:
        raise ValueError(f"t={t!r} is invalid: t must be > 0 (2 in Wang & Isola)")
    x = F.normalize(x.float(), dim=1)  # (N, D)
    sq_dist = torch.pdist(x).pow(2)  # (N (N - 1) / 2,) one entry per pair i < j
    return sq_dist.mul(-t).exp().mean().log().item()
