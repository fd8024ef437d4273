import math

import pytest
import torch

from hf_contrast import alignment, key_consistency, parameter_drift, uniformity


def unit(x):
    return torch.nn.functional.normalize(x, dim=1)


def test_key_consistency_is_the_mean_rowwise_cosine():
    old = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    new = torch.tensor([[1.0, 0.0], [0.0, -1.0], [1.0, 1.0]])  # cosines 1, -1, 1/sqrt(2)
    assert key_consistency(old, new) == pytest.approx((1 - 1 + 1 / math.sqrt(2)) / 3, abs=1e-6)
    assert key_consistency(old, old * 5) == pytest.approx(1.0, abs=1e-6)  # scale does not matter
    with pytest.raises(ValueError, match="stored_keys and fresh_keys"):
        key_consistency(old, new[:2])


def test_parameter_drift_of_a_known_perturbation():
    g = torch.Generator().manual_seed(0)
    query = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    assert parameter_drift([q.clone() for q in query], query) == 0.0
    assert parameter_drift([1.1 * q for q in query], query) == pytest.approx(0.1, rel=1e-5)
    delta = [torch.randn_like(q) for q in query]  # ||d|| / ||q|| over the concatenation of all tensors
    expected = torch.cat([d.flatten() for d in delta]).norm() / torch.cat([q.flatten() for q in query]).norm()
    perturbed = [q + d for q, d in zip(query, delta, strict=True)]
    assert parameter_drift(perturbed, query) == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match="key_params and query_params"):
        parameter_drift(query[:1], query)


def test_alignment_constructed_cases_and_direct_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 8, generator=g)
    assert alignment(x, 3 * x) == pytest.approx(0.0, abs=1e-6)  # identical positives (after normalisation)
    assert alignment(x, -x) == pytest.approx(4.0, abs=1e-5)  # antipodal: ||2u||^2
    y = torch.randn(50, 8, generator=g)
    direct = sum(float(((a - b) ** 2).sum()) for a, b in zip(unit(x), unit(y), strict=True)) / 50
    assert alignment(x, y) == pytest.approx(direct, rel=1e-5)
    direct_a1 = sum(float((a - b).norm()) for a, b in zip(unit(x), unit(y), strict=True)) / 50
    assert alignment(x, y, alpha=1) == pytest.approx(direct_a1, rel=1e-5)
    with pytest.raises(ValueError, match="alpha"):
        alignment(x, y, alpha=0)


def test_uniformity_constructed_cases_and_direct_formula():
    same = torch.ones(6, 4)
    assert uniformity(same) == pytest.approx(0.0, abs=1e-6)  # collapse: every distance 0
    antipodal = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert uniformity(antipodal) == pytest.approx(-8.0, abs=1e-5)  # one pair at squared distance 4, t = 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 5, generator=g)
    z = unit(x)
    terms = [math.exp(-2 * float(((z[i] - z[j]) ** 2).sum())) for i in range(30) for j in range(i + 1, 30)]
    assert uniformity(x) == pytest.approx(math.log(sum(terms) / len(terms)), rel=1e-5)
    assert uniformity(x) < uniformity(x + 5.0)  # a clump is less uniform
    with pytest.raises(ValueError, match="N >= 2"):
        uniformity(x[:1])
    with pytest.raises(ValueError, match="t=0"):
        uniformity(x, t=0)
