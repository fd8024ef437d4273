import math

import torch
import torch.nn.functional as F

from hf_contrast import ContrastiveMetrics, ContrastiveOutput, info_nce_logits, nt_xent_logits


def naive(logits, labels, embeddings, t):
    """Straight from the definitions, one anchor at a time."""
    top1, pos, neg = [], [], []
    for i in range(logits.shape[0]):
        row = logits[i]
        others = [row[j].item() for j in range(row.shape[0]) if j != labels[i] and math.isfinite(row[j].item())]
        top1.append(float(row.argmax().item() == labels[i].item()))
        pos.append(row[labels[i]].item() * t)
        neg.append(sum(others) / len(others) * t)
    z = F.normalize(embeddings, dim=1)
    return [sum(top1) / len(top1), sum(pos) / len(pos), sum(neg) / len(neg), z.std(0).mean().item()]


def test_metrics_match_definitions_for_simclr_and_moco_logits():
    g = torch.Generator().manual_seed(0)
    z_a, z_b, queue = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(20, 8, generator=g)
    cases = [
        (nt_xent_logits(z_a, z_b, 0.1), torch.cat([z_a, z_b]), 0.1, 10),  # self entries are -inf
        (info_nce_logits(z_a, z_b, F.normalize(queue, dim=1), 0.2), z_a, 0.2, 20),
    ]
    for (logits, labels), emb, t, k in cases:
        metrics = ContrastiveMetrics(t)
        metrics.update(ContrastiveOutput(logits=logits, labels=labels, embeddings=emb, num_negatives=k))
        got = metrics.compute_and_reset()
        want = naive(logits, labels, emb, t)
        for name, value in zip(ContrastiveMetrics.names, want, strict=True):
            assert abs(got[name] - value) < 2e-4, (name, got[name], value)
        assert got["num_negatives"] == k


def test_metrics_take_a_device_count_of_negatives_without_reading_it():
    """MoCo's queue fills over the first steps: its logits then hold -inf columns for the empty slots and
    ``num_negatives`` is a 0-d tensor. The metrics equal the naive definitions and read nothing on the host
    until ``compute_and_reset``."""
    g = torch.Generator().manual_seed(1)
    z_a, z_b, queue = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(20, 8, generator=g)
    logits, labels = info_nce_logits(z_a, z_b, F.normalize(queue, dim=1), 0.2)  # (6, 21)
    logits[:, 13:] = float("-inf")  # 8 empty queue slots: 12 real negatives
    metrics = ContrastiveMetrics(0.2)
    with torch.profiler.profile() as prof:
        metrics.update(ContrastiveOutput(logits=logits, labels=labels, embeddings=z_a, num_negatives=torch.tensor(12)))
    assert "aten::_local_scalar_dense" not in {e.name for e in prof.events()}
    got = metrics.compute_and_reset()
    for name, value in zip(ContrastiveMetrics.names, naive(logits, labels, z_a, 0.2), strict=True):
        assert abs(got[name] - value) < 2e-4, (name, got[name], value)
    assert got["num_negatives"] == 12
