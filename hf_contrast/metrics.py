"""Running contrastive metrics, accumulated on device between logging steps (no sync per step)."""

from __future__ import annotations

import torch

from . import distributed
from .modeling_base import ContrastiveOutput


class ContrastiveMetrics:
    """Accumulates, over the micro-batches of a logging window:

    * ``contrastive_top1``: fraction of anchors whose positive has the highest logit;
    * ``pos_cosine`` / ``neg_cosine``: mean cosine similarity of anchors to positives / negatives;
    * ``embedding_std``: mean per-dimension std of the normalised anchor embeddings (about
      ``1/sqrt(D)`` when healthy, near 0 on collapse);
    * ``num_negatives``: negatives per anchor of the latest micro-batch.

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
        finite = torch.isfinite(logits)  # SimCLR masks each anchor's own entry with -inf
        n_neg = finite.sum(1) - 1  # (A,)
        neg_sum = logits.masked_fill(~finite, 0).sum(1) - pos  # (A,)
        neg_mean = torch.where(n_neg > 0, neg_sum / n_neg.clamp(min=1), torch.zeros_like(neg_sum))
        z = torch.nn.functional.normalize(outputs.embeddings.detach().float(), dim=1)  # (A, D)
        values = torch.stack([
            (logits.argmax(1) == labels).float().mean(),
            pos.mean() * self.temperature,
            neg_mean.mean() * self.temperature,
            z.std(0).mean(),
        ])
        self.sums = values if self.sums is None else self.sums + values
        self.count += 1
        self.num_negatives = int(outputs.num_negatives)

    def compute_and_reset(self) -> dict[str, float]:
        means = self.sums / self.count
        means = distributed.gather_no_grad(means.unsqueeze(0)).mean(0)  # average over processes
        out = {name: round(float(v), 4) for name, v in zip(self.names, means, strict=False)}
        out["num_negatives"] = self.num_negatives
        self.sums, self.count = None, 0
        return out
