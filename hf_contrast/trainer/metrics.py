"""Running contrastive metrics, accumulated on device between logging steps (no sync per step)."""

from __future__ import annotations

import torch

from .. import distributed
from ..models.base import ContrastiveOutput


class ContrastiveMetrics:
    """Accumulates, over the micro-batches of a logging window:

    * ``contrastive_top1``: fraction of anchors whose positive has the highest logit;
    * ``pos_cosine`` / ``neg_cosine``: mean cosine similarity of anchors to positives / negatives;
    * ``embedding_std``: mean per-dimension std of the normalised anchor embeddings (about
      ``1/sqrt(D)`` when healthy, near 0 on collapse);
    * ``num_negatives``: negatives per anchor of the latest micro-batch (the mean per anchor after
      masking same-instance keys or cancelled false negatives).

    Values are averaged over processes when several train together.
    """

    names = ("contrastive_top1", "pos_cosine", "neg_cosine", "embedding_std")

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.sums: torch.Tensor | None = None
        self.count = 0
        self.num_negatives = 0

    @torch.no_grad()
    def update(self, outputs: ContrastiveOutput) -> None:
        logits, labels = outputs.logits.detach(), outputs.labels  # (A, C), (A,)
        rows = torch.arange(logits.shape[0], device=logits.device)
        pos = logits[rows, labels]  # (A,)
        # Entries masked with -inf per row: SimCLR masks each anchor itself (1), MoCo nothing (0). A
        # clamp at the smallest finite logit (cosine -1) turns them into a known constant, which is far
        # cheaper than an isfinite mask over a (256, 65537) MoCo logit matrix (about 165 ms -> 2-25 ms).
        lo = -1.0 / self.temperature
        if outputs.negative_counts is not None:  # per-row masks (same-instance keys, FNC)
            kept = outputs.negative_counts.to(logits.dtype)  # (A,)
            total = logits.clamp(min=lo).sum(1) - (logits.shape[1] - 1 - kept) * lo  # (A,)
            neg_mean = (total - pos) / kept.clamp(min=1)  # (A,)
        else:  # num_negatives: an int, or a 0-d device tensor (MoCo's queue while it fills): no host read
            n = outputs.num_negatives
            masked = logits.shape[1] - 1 - n  # int or ()
            plain = isinstance(masked, int) and masked == 0
            total = logits.sum(1) if plain else logits.clamp(min=lo).sum(1) - masked * lo  # (A,)
            count = n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)
            neg_mean = (total - pos) / count  # (A,) 0 when there are no negatives
        z = torch.nn.functional.normalize(outputs.embeddings.detach().float(), dim=1)  # (A, D)
        values = torch.stack([
            (logits.argmax(1) == labels).float().mean(),
            pos.mean() * self.temperature,
            neg_mean.mean() * self.temperature,
            z.std(0).mean(),
        ])
        self.sums = values if self.sums is None else self.sums + values
        self.count += 1
        self.num_negatives = outputs.num_negatives  # an int, or a 0-d tensor (mean after masking): no sync here

    def compute_and_reset(self) -> dict[str, float]:
        means = self.sums / self.count
        means = distributed.gather_no_grad(means.unsqueeze(0)).mean(0)  # average over processes
        out = {name: round(float(v), 4) for name, v in zip(self.names, means, strict=False)}
        n = self.num_negatives
        out["num_negatives"] = round(float(n), 2) if isinstance(n, torch.Tensor) else n
        self.sums, self.count = None, 0
        return out
