"""LARS: MoCo v3's update, checked step by step against the formula computed by hand in float64."""

import pytest
import torch

from hf_contrast.trainer.optim import LARS


def reference_steps(w0, grads, lr, wd, momentum, eta):
    """MoCo v3's LARS on one tensor, written out: decay and trust ratio for ndim > 1 only."""
    w, mu = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64)
    for g in grads:
        d = g.double()
        if w.ndim > 1:
            d = d + wd * w
            wn, dn = w.norm().item(), d.norm().item()
            d = d * (eta * wn / dn if wn > 0 and dn > 0 else 1.0)
        mu = momentum * mu + d
        w = w - lr * mu
    return w


@pytest.mark.parametrize("shape", [(4, 3), (5,), (2, 3, 2, 2)])
def test_lars_matches_the_formula(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(*shape, generator=g))
    grads = [torch.randn(*shape, generator=g) for _ in range(3)]
    expected = reference_steps(w.detach(), grads, lr=0.6, wd=0.01, momentum=0.9, eta=0.001)
    opt = LARS([w], lr=0.6, weight_decay=0.01, momentum=0.9)
    for grad in grads:
        w.grad = grad.clone()
        opt.step()
    torch.testing.assert_close(w.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_biases_get_plain_momentum_sgd():
    b = torch.nn.Parameter(torch.ones(4))
    opt = LARS([b], lr=0.5, weight_decay=0.1, momentum=0.9)
    for _ in range(2):
        b.grad = torch.full((4,), 2.0)
        opt.step()
    torch.testing.assert_close(b.detach(), torch.full((4,), 1 - 0.5 * 2 - 0.5 * (0.9 * 2 + 2)))  # no decay, no ratio


def test_trust_ratio_scales_the_step_to_eta_times_the_weight_norm():
    w = torch.nn.Parameter(torch.full((10, 10), 2.0))  # ||w|| = 20
    w.grad = torch.full((10, 10), 1000.0)
    opt = LARS([w], lr=1.0, momentum=0.0, trust_coefficient=0.001)
    before = w.detach().clone()
    opt.step()
    assert torch.linalg.vector_norm(w.detach() - before).item() == pytest.approx(0.001 * 20, rel=1e-4)  # not 1000x


def test_zero_weights_fall_back_to_ratio_one_and_bad_args_are_refused():
    w = torch.nn.Parameter(torch.zeros(3, 3))
    w.grad = torch.ones(3, 3)
    LARS([w], lr=0.1, momentum=0.0).step()
    torch.testing.assert_close(w.detach(), torch.full((3, 3), -0.1))
    with pytest.raises(ValueError, match="lr"):
        LARS([w], lr=-1.0)
