"""The debiased contrastive loss (Chuang et al. 2020) and the multi-positive InfoNCE against loops
written from the papers' formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_contrast import (
    MoCoConfig,
    MoCoV3Config,
    MoCoV3Model,
    SimCLRConfig,
    debiased_contrastive_loss,
    info_nce_logits,
    mocov3_logits,
    multi_positive_info_nce,
)


def naive_dcl(logits, labels, t, tau_plus):
    """Chuang et al. eq. (6) per anchor: Ng = max((sum neg - tau+ N pos) / (1 - tau+), N e^{-1/t})."""
    total = 0.0
    for i in range(logits.shape[0]):
        row = [float(v) for v in logits[i]]
        pos = math.exp(row[int(labels[i])])
        neg = [math.exp(v) for j, v in enumerate(row) if j != int(labels[i]) and v != float("-inf")]
        n = len(neg)
        ng = max((sum(neg) - tau_plus * n * pos) / (1 - tau_plus), n * math.exp(-1 / t))
        total += -math.log(pos / (pos + ng))
    return total / logits.shape[0]


def cosine_logits(t, seed=0, n=6, k=20, d=8):
    g = torch.Generator().manual_seed(seed)
    q, key, queue = (torch.randn(*s, generator=g) for s in ((n, d), (n, d), (k, d)))
    return info_nce_logits(q, key, queue, t)


@pytest.mark.parametrize("tau_plus", [0.05, 0.1, 0.3])
def test_dcl_equals_the_paper_formula(tau_plus):
    logits, labels = cosine_logits(0.2)
    logits[1, 3] = float("-inf")  # an excluded candidate is neither summed nor counted
    got = debiased_contrastive_loss(logits, labels, 0.2, tau_plus).item()
    assert got == pytest.approx(naive_dcl(logits.double(), labels, 0.2, tau_plus), rel=1e-5)
    assert got != pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-3)  # really debiased


def test_dcl_clamp_binds_with_a_large_prior():
    logits, labels = cosine_logits(0.2, seed=3)
    logits[:, 0] = logits[:, 1:].max(1).values + 2.0  # a positive far above its negatives
    got = debiased_contrastive_loss(logits, labels, 0.2, 0.9).item()
    assert got == pytest.approx(naive_dcl(logits.double(), labels, 0.2, 0.9), rel=1e-5)
    n = logits.shape[1] - 1  # with the clamp active, Ng = N e^{-1/t}
    by_clamp = sum(-math.log(math.exp(float(r[0])) / (math.exp(float(r[0])) + n * math.exp(-1 / 0.2))) for r in logits)
    assert got == pytest.approx(by_clamp / logits.shape[0], rel=1e-5)


def test_dcl_at_tau_plus_zero_is_infonce_for_cosine_logits_and_not_below_minus_one_over_t():
    logits, labels = cosine_logits(0.1, seed=1)
    torch.testing.assert_close(debiased_contrastive_loss(logits, labels, 0.1, 0.0), F.cross_entropy(logits, labels))
    # logits below -1/t (not cosines) make the clamp bind: the loss then differs from InfoNCE
    low = torch.tensor([[-5.0, -30.0, -40.0]])
    assert debiased_contrastive_loss(low, torch.zeros(1, dtype=torch.long), 0.1, 0.0).item() > F.cross_entropy(
        low, torch.zeros(1, dtype=torch.long)).item() + 1e-4


def test_mocov3_debiased_loss_is_the_formula_on_each_half_times_2t():
    torch.manual_seed(0)
    t, tau = 0.2, 0.3
    m = MoCoV3Model(MoCoV3Config(backbone="test_resnet", tau_plus=tau, temperature=t, projection_hidden_dim=32,
                                 projection_dim=16, predictor_hidden_dim=24, image_size=32)).eval()
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(6, 3, 32, 32, generator=g), torch.randn(6, 3, 32, 32, generator=g)
    loss = m(x1, x2).loss.item()
    with torch.no_grad():
        halves = [mocov3_logits(m.predictor(m.projector(m.encoder(a))), m.encode_keys(b), t) for a, b in ((x1, x2), (x2, x1))]
    want = sum(naive_dcl(lg.double(), lb, t, tau) * 2 * t for lg, lb in halves)
    assert loss == pytest.approx(want, rel=1e-5)
    assert loss != pytest.approx(sum(F.cross_entropy(lg, lb).item() * 2 * t for lg, lb in halves), rel=1e-3)


def test_multi_positive_info_nce_matches_a_loop():
    logits, labels = cosine_logits(0.2, seed=2)
    logits[0, 5] = float("-inf")
    positives = torch.zeros_like(logits, dtype=torch.bool)
    positives[:, 0] = True
    positives[0, [2, 7]] = True
    positives[3, 1] = True
    expected = 0.0
    for i in range(logits.shape[0]):
        denom = sum(math.exp(float(v)) for v in logits[i] if v != float("-inf"))
        cols = [j for j in range(logits.shape[1]) if positives[i, j]]
        expected += -sum(float(logits[i, j]) - math.log(denom) for j in cols) / len(cols)
    assert multi_positive_info_nce(logits, positives).item() == pytest.approx(expected / logits.shape[0], rel=1e-5)


def test_config_fields_are_validated():
    assert MoCoConfig(backbone="test_resnet").tau_plus == 0.0 and SimCLRConfig(backbone="test_resnet", tau_plus=0.1)
    for bad in ({"tau_plus": 1.0}, {"tau_plus": 0.1, "false_negatives": "attract"}, {"false_negative_top_k": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MoCoConfig(backbone="test_resnet", **bad)
    with pytest.raises(ValueError, match="false_negatives"):
        MoCoConfig(backbone="test_resnet", false_negatives="drop")
