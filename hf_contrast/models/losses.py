"""Contrastive losses as pure functions over embeddings.

Both losses take embeddings (never a model), L2-normalise them inside and do the similarity and
log-sum-exp math in float32 with autocast disabled, so they stay finite at temperature 0.01 under
bf16/fp16 training. Each loss has a ``*_logits`` twin that returns the logits and the index of the
positive per anchor; the trainer derives its metrics (contrastive top-1, positive/negative cosine)
from those without recomputing anything.

Memory: the logits are the one large tensor of a loss (``(B, 1 + K)`` for MoCo: 64 MiB at
``B = 256``, ``K = 65536``), so they are built once and every mask is written into them in place:

* the temperature scales the ``(A, D)`` queries before the matmul, not the ``(A, C)`` logits after it;
* masked entries (an anchor's own view in NT-Xent, unused queue slots, a query's own image in the
  queue) are set to ``-inf`` in place, outside autograd, with no ``(A, C)`` mask and no copy of the
  logits. Their gradient is then whatever the loss gives an entry that is ``-inf``: exactly zero for
  every softmax-based loss (:func:`cross_entropy`, :func:`debiased_contrastive_loss`,
  :func:`multi_positive_info_nce`, ``F.cross_entropy``), the gradient of the masked logits. A
  function with a non-zero slope at ``-inf`` (``nan_to_num``) would pass gradient to them: mask with
  ``masked_fill`` first if you need that;
* :func:`cross_entropy` (the models' loss) keeps only the logits and a ``(A,)`` log-sum-exp for its
  backward and makes one ``(A, C)`` gradient, where ``F.cross_entropy`` keeps a log-softmax copy and
  makes two.

``benchmarks/loss_memory.py`` measures the peak of a loss forward + backward against the earlier
implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .queue import UNKNOWN_INSTANCE


def _no_autocast(x: torch.Tensor):
    """Autocast off for ``x``'s device (the meta device, used to check for host syncs, has none)."""
    return torch.autocast(device_type="cpu" if x.device.type == "meta" else x.device.type, enabled=False)


def _fp32_normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1)


class _CrossEntropy(torch.autograd.Function):
    """Mean cross-entropy whose backward needs only the logits and their row log-sum-exp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=1)  # (A,)
        ctx.save_for_backward(logits, lse, labels)
        return (lse - logits.gather(1, labels.unsqueeze(1)).squeeze(1)).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, labels = ctx.saved_tensors
        p = torch.sub(logits, lse.unsqueeze(1)).exp_()  # (A, C) softmax, the one buffer of the backward
        p.scatter_add_(1, labels.unsqueeze(1), torch.full_like(lse.unsqueeze(1), -1.0))  # minus one-hot
        return p.mul_(grad / logits.shape[0]), None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, labels)`` (mean over rows) with less memory.

    The backward keeps only ``logits`` (which the caller holds anyway) and their ``(A,)`` log-sum-exp,
    and builds the gradient ``softmax - one_hot`` in one ``(A, C)`` buffer; ``F.cross_entropy`` saves
    a log-softmax copy of the logits and makes two ``(A, C)`` gradients. ``-inf`` logits (masked
    candidates) get exactly zero gradient. Values agree with ``F.cross_entropy`` to float32 rounding.

    Args:
        logits: ``(A, C)`` float; ``-inf`` marks excluded candidates (each row needs a finite one).
        labels: ``(A,)`` long, the column of each row's target.
    """
    return _CrossEntropy.apply(logits, labels)


@torch.no_grad()
def mask_negatives_(
    logits: torch.Tensor, valid: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Write ``-inf`` into negative logits ``(A, K)`` in place, outside autograd (see the module docstring).

    Masked: the columns of unused slots (``valid`` False: a ``(K,)`` mask, broadcast) and, with ids, the
    entries where a query meets a key of its own image (``query_ids[a] == negative_ids[k]``, unknown ids
    ``-1`` never match). The id comparison is the one ``(A, K)`` bool temporary, freed on return.

    Args:
        logits: ``(A, K)`` float, a fresh matmul result (or a column block of one) nothing has saved.
        valid: ``(K,)`` bool, which slots hold real keys; ``None``: all.
        query_ids: ``(A,)`` long, each query's image; ``None``: no same-instance masking.
        negative_ids: ``(K,)`` long, each key's image (required with ``query_ids``).

    Returns:
        ``(A,)`` long, how many valid negatives of each row the ids masked; ``None`` without ids.
    """
    if valid is not None:
        logits.masked_fill_(~valid, float("-inf"))  # (K,) mask broadcast over the rows
    if query_ids is None:
        return None
    query_ids = query_ids.to(negative_ids.device).reshape(-1)  # (A,)
    if valid is not None:  # unused slots match no query: already masked, and not counted
        negative_ids = torch.where(valid, negative_ids, UNKNOWN_INSTANCE)  # (K,)
    known = query_ids != UNKNOWN_INSTANCE  # (A,)
    same = query_ids.unsqueeze(1) == negative_ids.unsqueeze(0)  # (A, K) bool
    same &= known.unsqueeze(1)
    logits.masked_fill_(same, float("-inf"))
    del same
    # counted by binary search in the sorted ids: a row sum of the (A, K) mask would make an int64 copy on CPU
    sorted_ids = torch.sort(negative_ids).values  # (K,)
    count = torch.searchsorted(sorted_ids, query_ids, right=True) - torch.searchsorted(sorted_ids, query_ids)
    return count * known  # (A,)


def _with_negatives(
    q_t: torch.Tensor, leading: torch.Tensor, negatives: torch.Tensor, valid: torch.Tensor | None,
    query_ids: torch.Tensor | None, negative_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[leading | q_t @ normalize(negatives).T]``: ``(A, P + K)`` logits from queries already scaled by
    ``1 / T`` ``(A, D)``, leading columns ``(A, P)`` and negatives ``(K, D)``, masked by
    :func:`mask_negatives_` before the one concatenation. Returns the logits and the masked counts."""
    neg = _fp32_normalize(negatives)  # (K, D) a new tensor: enqueuing in place later cannot touch autograd
    l_neg = q_t @ neg.T  # (A, K)
    matches = mask_negatives_(l_neg, valid, query_ids, negative_ids)
    return torch.cat([leading, l_neg], dim=1), matches  # (A, P + K); l_neg is freed here


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
    anchor's own entry is ``-inf`` (written in place on two diagonals: no ``(2N, 2M)`` mask or copy);
    its positive is the other view of the same image.

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
    gathered = z_a_all is not None or z_b_all is not None
    z_a_all = z_a if z_a_all is None else z_a_all
    z_b_all = z_b if z_b_all is None else z_b_all
    n, m = z_a.shape[0], z_a_all.shape[0]
    start = rank * n  # the local images among the M
    with _no_autocast(z_a):
        candidates = _fp32_normalize(torch.cat([z_a_all, z_b_all]))  # (2M, D)
        anchors = _fp32_normalize(torch.cat([z_a, z_b])) if gathered else candidates  # (2N, D)
        anchors = anchors / temperature  # scaled by 1/T
        logits = anchors @ candidates.T  # (2N, 2M)
        with torch.no_grad():  # anchor i meets itself at column start + i, anchor N + i at M + start + i
            logits[:n, start : start + n].diagonal().fill_(float("-inf"))
            logits[n:, m + start : m + start + n].diagonal().fill_(float("-inf"))
    idx = torch.arange(n, device=z_a.device) + start  # (N,)
    positives = torch.cat([idx + m, idx])  # (2N,) the other view of the same image
    return logits, positives


def nt_xent_loss(z_a: torch.Tensor, z_b: torch.Tensor, temperature: float, **gather_kwargs) -> torch.Tensor:
    """SimCLR's NT-Xent loss: 2N views, 1 positive and 2N - 2 negatives per anchor.

    The mean over all 2N anchors of ``-log(exp(s_pos / t) / sum_{k != self} exp(s_k / t))`` with
    cosine similarities ``s``. Keyword arguments ``z_a_all``, ``z_b_all`` and ``rank`` extend the
    candidates to views gathered from other processes (see :func:`nt_xent_logits`).
    """
    logits, positives = nt_xent_logits(z_a, z_b, temperature, **gather_kwargs)
    return cross_entropy(logits, positives)


def info_nce_logits(
    query: torch.Tensor, key: torch.Tensor, negatives: torch.Tensor, temperature: float,
    valid: torch.Tensor | None = None, *, query_ids: torch.Tensor | None = None,
    negative_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of MoCo's InfoNCE: the positive in column 0, then the K negatives.

    The logits are one ``(N, 1 + K)`` buffer; masked entries are written into it in place
    (:func:`mask_negatives_`).

    Args:
        query: queries, shape ``(N, D)``.
        key: their positive keys, shape ``(N, D)``.
        negatives: the negative keys (MoCo's queue), shape ``(K, D)``; K may be 0.
        temperature: softmax temperature, > 0.
        valid: ``(K,)`` bool, which rows of ``negatives`` are real keys (a partly filled queue); the
            columns of the others are ``-inf``, so they take no part in any softmax. ``None``: all.
        query_ids: ``(N,)`` long, each query's image: with ``negative_ids`` ``(K,)``, the negatives of
            a query's own image are ``-inf`` (unknown ids ``-1`` never match). ``None``: none masked.
        negative_ids: ``(K,)`` long, each negative's image.

    Returns:
        ``(logits, labels)``: float32 logits ``(N, 1 + K)`` and zeros ``(N,)``.
    """
    with _no_autocast(query):
        q_t = _fp32_normalize(query) / temperature  # (N, D) scaled by 1/T
        k = _fp32_normalize(key)  # (N, D)
        l_pos = torch.einsum("nd,nd->n", q_t, k).unsqueeze(-1)  # positive logits: (N, 1)
        logits, _ = _with_negatives(q_t, l_pos, negatives, valid, query_ids, negative_ids)  # (N, 1 + K)
    labels = torch.zeros(q_t.shape[0], dtype=torch.long, device=q_t.device)
    return logits, labels


def info_nce_loss(
    query: torch.Tensor, key: torch.Tensor, negatives: torch.Tensor, temperature: float
) -> torch.Tensor:
    """MoCo's InfoNCE loss: cross-entropy picking each query's key among 1 + K candidates."""
    logits, labels = info_nce_logits(query, key, negatives, temperature)
    return cross_entropy(logits, labels)


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
    """The loss the models train with: cross-entropy (InfoNCE / NT-Xent, :func:`cross_entropy`), the
    debiased loss when ``tau_plus > 0``, or the multi-positive InfoNCE when ``positive_mask`` is given
    (FNC attract)."""
    if positive_mask is not None:
        if tau_plus > 0:
            raise ValueError("tau_plus > 0 cannot be combined with false_negatives='attract'")
        return multi_positive_info_nce(logits, positive_mask)
    if tau_plus > 0:
        return debiased_contrastive_loss(logits, labels, temperature, tau_plus)
    return cross_entropy(logits, labels)


def mocov3_logits(
    query: torch.Tensor, keys: torch.Tensor, temperature: float, rank: int = 0, queue: torch.Tensor | None = None,
    queue_valid: torch.Tensor | None = None, *, query_ids: torch.Tensor | None = None,
    queue_ids: torch.Tensor | None = None,
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
        query_ids: ``(N,)`` long, each query's image: with ``queue_ids`` ``(K,)``, the queued keys of a
            query's own image are ``-inf`` (in place, see :func:`mask_negatives_`; in-batch keys never).
        queue_ids: ``(K,)`` long, each queued key's image.

    Returns:
        ``(logits, labels)``: float32 logits ``(N, M)`` (``(N, M + K)`` with a queue) and the positive's
        column ``(N,)``; every other column is a negative.
    """
    with _no_autocast(query):
        q_t = _fp32_normalize(query) / temperature  # (N, D) scaled by 1/T
        logits = q_t @ _fp32_normalize(keys).T  # (N, M)
        if queue is not None:
            logits, _ = _with_negatives(q_t, logits, queue, queue_valid, query_ids, queue_ids)  # (N, M + K)
    n = q_t.shape[0]
    labels = torch.arange(n, device=q_t.device) + rank * n  # (N,) this process's images among the M keys
    return logits, labels


def mocov3_loss(query: torch.Tensor, keys: torch.Tensor, temperature: float, rank: int = 0) -> torch.Tensor:
    """MoCo v3's ``ctr(q, k) = CrossEntropy(q @ k.T / T, labels) * 2T`` (see :func:`mocov3_logits`).

    The ``2T`` factor is the official code's: it keeps the gradient's scale independent of ``T``.
    The full MoCo v3 loss is ``mocov3_loss(q1, k2) + mocov3_loss(q2, k1)``.
    """
    logits, labels = mocov3_logits(query, keys, temperature, rank)
    return cross_entropy(logits, labels) * (2 * temperature)
