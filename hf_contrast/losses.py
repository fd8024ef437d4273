"""Contrastive losses as pure functions over embeddings.

Both losses take embeddings (never a model), L2-normalise them inside and do the similarity and
log-sum-exp math in float32 with autocast disabled, so they stay finite at temperature 0.01 under
bf16/fp16 training. Each loss has a ``*_logits`` twin that returns the logits and the index of the
positive per anchor; the trainer derives its metrics (contrastive top-1, positive/negative cosine)
from those without recomputing anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _no_autocast(x: torch.Tensor):
    """Autocast off for ``x``'s device (the meta device, used to check for host syncs, has none)."""
    return torch.autocast(device_type="cpu" if x.device.type == "meta" else x.device.type, enabled=False)


def _fp32_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1)


def nt_xent_logits(
    z_a: torch.Tensor,
    z_b: torch.Tensor,
    temperature: float,
    *,
    z_a_all: torch.Tensor | None = None,
    z_b_all: torch.Tensor | None = None,
    rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and positive indices of SimCLR's NT-Xent loss.

    Anchors are the 2N local views ``[z_a; z_b]``. Candidates are all 2M views
    ``[z_a_all; z_b_all]`` (M = N * world_size when gathered across processes, else M = N). Each
    anchor's own entry is masked with ``-inf``; its positive is the other view of the same image.

    Args:
        z_a: first views of the local batch, shape ``(N, D)``.
        z_b: second views, shape ``(N, D)``.
        temperature: softmax temperature, > 0.
        z_a_all: first views gathered over processes, shape ``(M, D)``; defaults to ``z_a``.
        z_b_all: second views gathered over processes, shape ``(M, D)``; defaults to ``z_b``.
        rank: index of this process; the local batch sits at rows ``rank*N ... rank*N + N - 1``
            of the gathered tensors.

    Returns:
        ``(logits, positives)``: logits of shape ``(2N, 2M)`` (float32, self entries ``-inf``)
        and the positive's column for each anchor, shape ``(2N,)``.
    """
    if z_a.shape != z_b.shape:
        raise ValueError(f"z_a and z_b must have the same shape, got {tuple(z_a.shape)} and {tuple(z_b.shape)}")
    z_a_all = z_a if z_a_all is None else z_a_all
    z_b_all = z_b if z_b_all is None else z_b_all
    n, m = z_a.shape[0], z_a_all.shape[0]
    with _no_autocast(z_a):
        anchors = _fp32_normalize(torch.cat([z_a, z_b]))  # (2N, D)
        candidates = _fp32_normalize(torch.cat([z_a_all, z_b_all]))  # (2M, D)
        logits = anchors @ candidates.T / temperature  # (2N, 2M)
        rows = torch.arange(2 * n, device=z_a.device)
        idx = torch.arange(n, device=z_a.device) + rank * n  # (N,) local images among the M
        self_cols = torch.cat([idx, idx + m])  # (2N,) where each anchor meets itself
        positives = torch.cat([idx + m, idx])  # (2N,) the other view of the same image
        self_mask = torch.zeros_like(logits, dtype=torch.bool)
        self_mask[rows, self_cols] = True
        logits = logits.masked_fill(self_mask, float("-inf"))
    return logits, positives


def nt_xent_loss(z_a: torch.Tensor, z_b: torch.Tensor, temperature: float, **gather_kwargs) -> torch.Tensor:
    """SimCLR's NT-Xent loss: 2N views, 1 positive and 2N - 2 negatives per anchor.

    The mean over all 2N anchors of ``-log(exp(s_pos / t) / sum_{k != self} exp(s_k / t))`` with
    cosine similarities ``s``. Keyword arguments ``z_a_all``, ``z_b_all`` and ``rank`` extend the
    candidates to views gathered from other processes (see :func:`nt_xent_logits`).
    """
    logits, positives = nt_xent_logits(z_a, z_b, temperature, **gather_kwargs)
    return F.cross_entropy(logits, positives)


def info_nce_logits(
    query: torch.Tensor, key: torch.Tensor, negatives: torch.Tensor, temperature: float,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of MoCo's InfoNCE: the positive in column 0, then the K negatives.

    Args:
        query: queries, shape ``(N, D)``.
        key: their positive keys, shape ``(N, D)``.
        negatives: the negative keys (MoCo's queue), shape ``(K, D)``; K may be 0.
        temperature: softmax temperature, > 0.
        valid: ``(K,)`` bool, which rows of ``negatives`` are real keys (a partly filled queue); the
            columns of the others are ``-inf``, so they take no part in any softmax. ``None``: all.

    Returns:
        ``(logits, labels)``: float32 logits ``(N, 1 + K)`` and zeros ``(N,)``.
    """
    with _no_autocast(query):
        q = _fp32_normalize(query)  # (N, D)
        k = _fp32_normalize(key)  # (N, D)
        neg = _fp32_normalize(negatives)  # (K, D)
        l_pos = torch.einsum("nd,nd->n", q, k).unsqueeze(-1)  # positive logits: (N, 1)
        l_neg = torch.einsum("nd,kd->nk", q, neg)  # negative logits: (N, K)
        if valid is not None:
            l_neg = l_neg.masked_fill(~valid, float("-inf"))  # (N, K) unused queue slots
        logits = torch.cat([l_pos, l_neg], dim=1) / temperature  # (N, 1 + K)
    labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return logits, labels


def info_nce_loss(
    query: torch.Tensor, key: torch.Tensor, negatives: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MoCo's InfoNCE loss: cross-entropy picking each query's key among 1 + K candidates."""
    logits, labels = info_nce_logits(query, key, negatives, temperature)
    return F.cross_entropy(logits, labels)


def debiased_contrastive_loss(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, tau_plus: float
) -> torch.Tensor:
    """Debiased contrastive loss (Chuang et al. 2020, eq. 6 / their ``criterion``), over logits.

    For anchor i with positive term ``pos = exp(s+ / t)``, its N_i negative terms ``neg_j = exp(s_j / t)``
    (every finite logit of the row except the positive's; ``-inf`` entries are excluded and not
    counted) and class prior ``tau_plus``::

        Ng  = max((sum_j neg_j - tau_plus * N_i * pos) / (1 - tau_plus), N_i * exp(-1 / t))
        l_i = -log(pos / (pos + Ng))

    The clamp at ``N_i * exp(-1/t)`` is the paper's (the smallest value the negatives' sum can take
    for cosine similarities). With ``tau_plus = 0`` this is InfoNCE exactly whenever every logit is
    a cosine divided by ``t`` (as :func:`info_nce_logits` and :func:`nt_xent_logits` make them):
    each ``neg_j >= exp(-1/t)``, so the clamp cannot bind. It binds (and the loss differs from
    InfoNCE) only for logits below ``-1/t``, i.e. similarities that are not cosines.

    Args:
        logits: ``(A, C)`` similarities / temperature; ``-inf`` marks excluded candidates.
        labels: ``(A,)`` column of each anchor's positive.
        temperature: the ``t`` the logits were divided by (> 0).
        tau_plus: class prior, in [0, 1).

    Returns:
        The mean loss over anchors (float32).
    """
    if not 0.0 <= tau_plus < 1.0:
        raise ValueError(f"tau_plus={tau_plus!r} is invalid: tau_plus must be in [0, 1) (0.1 in the paper)")
    with _no_autocast(logits):
        logits = logits.float()
        pos_logit = logits.gather(1, labels.unsqueeze(1)).squeeze(1)  # (A,)
        neg = logits.scatter(1, labels.unsqueeze(1), float("-inf"))  # (A, C) without the positive (no host tensor)
        n = (neg > float("-inf")).sum(1).to(logits.dtype)  # (A,) negatives per anchor
        shift = torch.maximum(pos_logit, neg.amax(1)).detach()  # (A,) for a stable exp
        pos = torch.exp(pos_logit - shift)  # (A,) exp(s+/t), scaled by exp(-shift)
        neg_sum = torch.exp(neg - shift[:, None]).sum(1)  # (A,) sum_j exp(s_j/t), same scale
        ng = (neg_sum - tau_plus * n * pos) / (1.0 - tau_plus)
        ng = torch.maximum(ng, n * torch.exp(-1.0 / temperature - shift))  # the paper's clamp
        return (torch.log(pos + ng) - (pos_logit - shift)).mean()


def multi_positive_info_nce(logits: torch.Tensor, positive_mask: torch.Tensor) -> torch.Tensor:
    """InfoNCE with several positives per anchor (FNC's attraction, SupCon's form).

    ``l_i = -1/|P_i| * sum_{p in P_i} log(exp(logits_ip) / sum_c exp(logits_ic))``: the softmax runs
    over every finite candidate of the row (positives included), and the log-probabilities of the
    positives are averaged.

    Args:
        logits: ``(A, C)``; ``-inf`` marks excluded candidates.
        positive_mask: ``(A, C)`` bool, True for each positive (at least one per row).

    Returns:
        The mean loss over anchors (float32).
    """
    with _no_autocast(logits):
        log_prob = torch.log_softmax(logits.float(), dim=1)  # (A, C)
        pos = positive_mask.to(log_prob.dtype)
        picked = torch.where(positive_mask, log_prob, torch.zeros_like(log_prob)).sum(1)  # (A,) no -inf * 0
        return (-picked / pos.sum(1).clamp(min=1.0)).mean()


def contrastive_loss(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, tau_plus: float = 0.0,
    positive_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss the models train with: cross-entropy (InfoNCE / NT-Xent), the debiased loss when
    ``tau_plus > 0``, or the multi-positive InfoNCE when ``positive_mask`` is given (FNC attract)."""
    if positive_mask is not None:
        if tau_plus > 0:
            raise ValueError("tau_plus > 0 cannot be combined with false_negatives='attract'")
        return multi_positive_info_nce(logits, positive_mask)
    if tau_plus > 0:
        return debiased_contrastive_loss(logits, labels, temperature, tau_plus)
    return F.cross_entropy(logits, labels)


def mocov3_logits(
    query: torch.Tensor, keys: torch.Tensor, temperature: float, rank: int = 0, queue: torch.Tensor | None = None,
    queue_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of MoCo v3's ``ctr(q, k)``: each local query against every key of the batch.

    Args:
        query: this process's queries (predictor outputs), shape ``(N, D)``.
        keys: the momentum encoder's keys of the other view, gathered over all processes in rank
            order, shape ``(M, D)`` with ``M = N * W`` (``M = N`` on one process).
        temperature: softmax temperature, > 0.
        rank: index of this process; query ``i`` is the image of key ``rank * N + i``.
        queue: queued keys of earlier steps ``(K, D)`` (``MoCoV3Config.queue_size > 0``), appended as
            ``K`` extra negative columns; ``None``: the official in-batch ``ctr``.
        queue_valid: ``(K,)`` bool, which queue rows are real keys; the others' columns are ``-inf``.

    Returns:
        ``(logits, labels)``: float32 logits ``(N, M)`` (``(N, M + K)`` with a queue) and the positive's
        column ``(N,)``; every other column is a negative.
    """
    with _no_autocast(query):
        q = _fp32_normalize(query)  # (N, D)
        k = _fp32_normalize(keys)  # (M, D)
        logits = torch.einsum("nd,md->nm", q, k) / temperature  # (N, M)
        if queue is not None:  # normalised into a new tensor: enqueuing in place later cannot touch autograd
            l_queue = torch.einsum("nd,kd->nk", q, _fp32_normalize(queue)) / temperature  # (N, K)
            if queue_valid is not None:
                l_queue = l_queue.masked_fill(~queue_valid, float("-inf"))  # (N, K) unused queue slots
            logits = torch.cat([logits, l_queue], dim=1)  # (N, M + K)
    n = q.shape[0]
    labels = torch.arange(n, device=q.device) + rank * n  # (N,) this process's images among the M keys
    return logits, labels


def mocov3_loss(query: torch.Tensor, keys: torch.Tensor, temperature: float, rank: int = 0) -> torch.Tensor:
    """MoCo v3's ``ctr(q, k) = CrossEntropy(q @ k.T / T, labels) * 2T`` (see :func:`mocov3_logits`).

    The ``2T`` factor is the official code's: it keeps the gradient's scale independent of ``T``.
    The full MoCo v3 loss is ``mocov3_loss(q1, k2) + mocov3_loss(q2, k1)``.
    """
    logits, labels = mocov3_logits(query, keys, temperature, rank)
    return F.cross_entropy(logits, labels) * (2 * temperature)
