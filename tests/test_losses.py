import math

import pytest
import torch
import torch.nn.functional as F

from hf_contrast import info_nce_logits, info_nce_loss, nt_xent_logits, nt_xent_loss


def naive_nt_xent(z_a, z_b, t):
    """SimCLR Algorithm 1, written as loops: l(i, j) = -log exp(s_ij/t) / sum_{k != i} exp(s_ik/t)."""
    z = torch.cat([z_a, z_b]).double()
    n2 = z.shape[0]
    n = n2 // 2
    s = [[float(F.cosine_similarity(z[i], z[j], dim=0)) for j in range(n2)] for i in range(n2)]
    total = 0.0
    for i in range(n2):
        j = (i + n) % n2
        denom = sum(math.exp(s[i][k] / t) for k in range(n2) if k != i)
        total += -math.log(math.exp(s[i][j] / t) / denom)
    return total / n2


def naive_info_nce(q, k, queue, t):
    """MoCo Algorithm 1, per query: -log exp(q.k+/t) / (exp(q.k+/t) + sum_j exp(q.k_j/t))."""
    q, k, queue = (F.normalize(x.double(), dim=1) for x in (q, k, queue))
    total = 0.0
    for i in range(q.shape[0]):
        pos = math.exp(float(q[i] @ k[i]) / t)
        neg = sum(math.exp(float(q[i] @ queue[j]) / t) for j in range(queue.shape[0]))
        total += -math.log(pos / (pos + neg))
    return total / q.shape[0]


@pytest.mark.parametrize("n,d,t", [(2, 3, 0.5), (4, 8, 0.1), (7, 16, 0.2), (16, 5, 1.0)])
def test_nt_xent_matches_naive_loop(n, d, t):
    g = torch.Generator().manual_seed(n * 100 + d)
    z_a, z_b = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    assert nt_xent_loss(z_a, z_b, t).item() == pytest.approx(naive_nt_xent(z_a, z_b, t), rel=1e-5)


def test_nt_xent_logits_structure():
    n = 5
    logits, pos = nt_xent_logits(torch.randn(n, 4), torch.randn(n, 4), 0.1)
    assert logits.shape == (2 * n, 2 * n)
    assert torch.isinf(logits.diagonal()).all()  # each anchor's own entry is masked
    assert torch.isfinite(logits).sum(1).eq(2 * n - 1).all()  # 1 positive + 2N-2 negatives
    assert pos.tolist() == list(range(n, 2 * n)) + list(range(n))


@pytest.mark.parametrize("n,k,d,t", [(1, 0, 4, 0.2), (3, 5, 4, 0.2), (6, 17, 8, 0.07), (4, 33, 16, 1.0)])
def test_info_nce_matches_naive_loop(n, k, d, t):
    g = torch.Generator().manual_seed(n + k + d)
    q, key, queue = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(k, d, generator=g)
    assert info_nce_loss(q, key, queue, t).item() == pytest.approx(naive_info_nce(q, key, queue, t), rel=1e-5, abs=1e-7)
    logits, labels = info_nce_logits(q, key, queue, t)
    assert logits.shape == (n, 1 + k) and labels.eq(0).all()


def test_losses_stable_at_low_temperature():
    g = torch.Generator().manual_seed(0)
    z_a, z_b = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    loss = nt_xent_loss(z_a, z_b, 0.01)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(naive_nt_xent(z_a, z_b, 0.01), rel=1e-4)
    q, k, queue = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(100, 16, generator=g)
    loss = info_nce_loss(q, k, queue, 0.01)
    assert torch.isfinite(loss) and loss.item() > 50  # a large but finite value, not inf
    assert loss.item() == pytest.approx(naive_info_nce(q, k, queue, 0.01), rel=1e-4)


def test_losses_run_in_fp32_under_autocast():
    """Under bf16 autocast the losses upcast their inputs and compute in fp32: the result equals the fp32
    loss of the bf16-rounded inputs to 1e-6 (a bf16 matmul inside would be off by about 1e-2)."""
    g = torch.Generator().manual_seed(1)
    z_a, z_b = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    queue = F.normalize(torch.randn(64, 16, generator=g), dim=1)
    rounded = [x.bfloat16() for x in (z_a, z_b, queue)]
    ref_nt = nt_xent_loss(rounded[0].float(), rounded[1].float(), 0.05)
    ref_info = info_nce_loss(rounded[0].float(), rounded[1].float(), rounded[2].float(), 0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = nt_xent_logits(rounded[0], rounded[1], 0.05)
        loss_nt = nt_xent_loss(rounded[0], rounded[1], 0.05)
        info_logits, _ = info_nce_logits(rounded[0], rounded[1], rounded[2], 0.05)
        loss_info = info_nce_loss(rounded[0], rounded[1], rounded[2], 0.05)
    assert logits.dtype == info_logits.dtype == loss_nt.dtype == loss_info.dtype == torch.float32
    assert loss_nt.item() == pytest.approx(ref_nt.item(), rel=1e-6)
    assert loss_info.item() == pytest.approx(ref_info.item(), rel=1e-6)


def test_nt_xent_gathered_rank_slices_average_to_full_loss():
    """Two 'processes' each computing their anchors against all views average to the 1-process loss."""
    g = torch.Generator().manual_seed(2)
    z_a, z_b = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    full = nt_xent_loss(z_a, z_b, 0.2)
    parts = [
        nt_xent_loss(z_a[r * 4 : r * 4 + 4], z_b[r * 4 : r * 4 + 4], 0.2, z_a_all=z_a, z_b_all=z_b, rank=r)
        for r in range(2)
    ]
    assert (sum(parts) / 2).item() == pytest.approx(full.item(), rel=1e-6)
    local = nt_xent_loss(z_a[:4], z_b[:4], 0.2)  # per-device loss: fewer negatives, another value
    assert abs(local.item() - parts[0].item()) > 1e-3
