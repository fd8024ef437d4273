"""Masks for negatives that are not negatives: the anchor's own image, and likely same-class
candidates found by false-negative cancellation (FNC, Huynh et al., WACV 2022).

FNC as the paper and google-research/fnc ``objective.py`` run it: every candidate negative is
scored by its cosine similarity to each of the anchor's *support views* (extra augmentations of the
anchor's image), the scores are aggregated over the support views (max or mean), and per anchor the
``top_k`` highest-scoring candidates (also above ``threshold`` when one is given: the code applies
``fn_topk`` and ``fn_threshold`` together) are taken as false negatives. They are then either
removed from the denominator ("elimination") or also used as positives ("attraction": the
multi-positive InfoNCE of :func:`hf_contrast.models.losses.multi_positive_info_nce`).

Simplification here: the support set is the anchor's own two views (MoCo: the query and its key;
SimCLR: both views of the anchor's image), not extra augmentations, and the aggregation is max.
This costs no extra forward pass; the paper's support views are separate crops, which see more of
the image. Candidate selection is a discrete choice and carries no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .queue import UNKNOWN_INSTANCE


def same_instance_mask(anchor_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """``(A, K)`` bool: candidate k comes from anchor a's own image (unknown ids never match)."""
    anchor_ids = anchor_ids.reshape(-1, 1)  # (A, 1)
    return (anchor_ids == candidate_ids.reshape(1, -1)) & (anchor_ids != UNKNOWN_INSTANCE)  # (A, K)


@torch.no_grad()
def support_scores(support: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Max over support views of the cosine similarity: ``(A, S, D)``, ``(K, D)`` -> ``(A, K)``."""
    s = F.normalize(support.detach().float(), dim=-1)  # (A, S, D)
    c = F.normalize(candidates.detach().float(), dim=-1)  # (K, D)
    return torch.einsum("asd,kd->ask", s, c).amax(1)  # (A, K)


@torch.no_grad()
def top_k_false_negatives(
    scores: torch.Tensor, excluded: torch.Tensor | None, top_k: int, threshold: float | None = None
) -> torch.Tensor:
    """``(A, K)`` bool: per anchor, the ``top_k`` highest ``scores`` among candidates not
    ``excluded`` (and above ``threshold`` when given)."""
    if excluded is not None:
        scores = scores.masked_fill(excluded, float("-inf"))
    k = min(top_k, scores.shape[1])
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k == 0:
        return mask
    values, index = scores.topk(k, dim=1)  # (A, k)
    keep = values > float("-inf") if threshold is None else values > threshold  # (A, k)
    return mask.scatter_(1, index, keep)


def cancel_negatives(
    logits: torch.Tensor, labels: torch.Tensor, excluded: torch.Tensor, scores: torch.Tensor | None, config,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply the masks of a config to one block of logits.

    Args:
        logits: ``(A, C)`` similarities / temperature.
        labels: ``(A,)`` the positive's column.
        excluded: ``(A, C)`` bool, columns that are never negatives (the positive, the anchor
            itself, its own image's queued keys); of these, only the positive stays in the logits.
        scores: ``(A, C)`` FNC scores of the columns (:func:`support_scores`), or None when off.
        config: a :class:`~hf_contrast.ContrastiveConfig` (``false_negatives``, ``..._top_k``,
            ``..._threshold``).

    Returns:
        ``(logits, positive_mask, negatives, kept, removed)``: logits with masked entries ``-inf``;
        the ``(A, C)`` positive mask for "attract" (else None); per anchor ``(A,)``: the true
        negatives after masking, the non-positive columns left in the logits (negatives plus
        attracted candidates), and the number FNC took (None when off).
    """
    rows = torch.arange(logits.shape[0], device=logits.device)
    positive = torch.zeros_like(excluded)
    positive[rows, labels] = True  # (A, C)
    masked = excluded & ~positive  # (A, C) dropped from the denominator
    fn = removed = positive_mask = None
    if config.false_negatives is not None and scores is not None:
        fn = top_k_false_negatives(scores, excluded, config.false_negative_top_k, config.false_negative_threshold)
        removed = fn.sum(1)  # (A,)
        if config.false_negatives == "eliminate":
            masked = masked | fn
        else:  # attract: the cancelled candidates join the positives
            positive_mask = positive | fn
    negatives = logits.shape[1] - excluded.sum(1) - (removed if removed is not None else 0)  # (A,)
    kept = logits.shape[1] - 1 - masked.sum(1)  # (A,)
    return logits.masked_fill(masked, float("-inf")), positive_mask, negatives, kept, removed
