import math

import pytest
import torch

from hf_contrast import ema_update_, momentum_at


@pytest.mark.parametrize("m", [0.0, 0.5, 0.99, 0.999, 1.0])
def test_ema_update_is_exact(m):
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    q = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    # reference in float64; fp32 may differ only by rounding (two ulps), a wrong m is off by far more
    expected = [m * a.double() + (1 - m) * b.double() for a, b in zip(k, q, strict=False)]
    ema_update_(k, q, m)
    for got, want in zip(k, expected, strict=False):
        torch.testing.assert_close(got.double(), want, rtol=2.5e-7, atol=1e-7)
    if m == 0.0:
        assert all(torch.equal(a, b) for a, b in zip(k, q, strict=False))  # m = 0 copies the query encoder
    if m == 1.0:
        assert all(torch.equal(a.double(), b) for a, b in zip(k, expected, strict=False))


def test_ema_update_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="matching"):
        ema_update_([torch.zeros(1)], [], 0.9)


def test_momentum_schedules():
    assert momentum_at(0, 100, 0.99, "constant") == 0.99
    assert momentum_at(99, 100, 0.99, "constant") == 0.99
    assert momentum_at(0, 100, 0.99, "cosine") == pytest.approx(0.99)
    assert momentum_at(50, 100, 0.99, "cosine") == pytest.approx(0.995)
    assert momentum_at(100, 100, 0.99, "cosine") == pytest.approx(1.0)
    values = [momentum_at(s, 100, 0.9, "cosine") for s in range(101)]
    assert all(a <= b for a, b in zip(values, values[1:], strict=False))  # rises monotonically
    assert momentum_at(25, 100, 0.9, "cosine") == pytest.approx(1 - 0.1 * (math.cos(math.pi / 4) + 1) / 2)
    with pytest.raises(ValueError, match="momentum_schedule"):
        momentum_at(0, 1, 0.9, "linear")


@pytest.mark.parametrize("size,batches", [(10, [4, 4, 4, 4]), (7, [3, 5, 1, 6]), (5, [12]), (6, [6, 6]), (3, [1] * 8)])
def test_queue_is_fifo_for_any_size(size, batches):
    """The queue the models use (``NegativeQueue.push``), for sizes that are not multiples of the batch and a
    batch larger than the queue: read from the pointer (the oldest), it holds the newest ``size`` keys in order."""
    from hf_contrast.models.queue import NegativeQueue

    queue = NegativeQueue(size, 1)
    written = []
    counter = 0
    for b in batches:
        keys = torch.arange(counter, counter + b, dtype=torch.float).unsqueeze(1)  # (b, 1)
        counter += b
        queue.push(keys)
        written += keys.squeeze(1).tolist()
        ptr, filled = int(queue.ptr), int(queue.filled)
        ring = torch.cat([queue.keys[ptr:], queue.keys[:ptr]]) if filled == size else queue.keys[:filled]
        assert ring.squeeze(1).tolist() == written[-size:]
    assert int(queue.ptr) == sum(batches) % size


def test_ema_refuses_bfloat16_targets_where_it_would_do_nothing():
    k, q = [torch.ones(4, dtype=torch.bfloat16)], [torch.full((4,), 2.0, dtype=torch.bfloat16)]
    assert torch.equal(0.999 * k[0] + 0.001 * q[0], k[0])  # the defect: a bf16 EMA step at m=0.999 is a no-op
    with pytest.raises(ValueError, match="bfloat16 parameters; it must be float32"):
        ema_update_(k, q, 0.999)
    assert torch.equal(k[0], torch.ones(4, dtype=torch.bfloat16))  # refused before touching anything


def test_model_in_bfloat16_refuses_the_momentum_update():
    from conftest import TINY

    from hf_contrast import MoCoConfig, MoCoModel

    model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=8, **TINY)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="TrainingArguments\\(bf16=True\\)"):
        model.momentum_update(0.999)


def tiny_moco():
    from conftest import TINY

    from hf_contrast import MoCoConfig, MoCoModel

    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=8, **TINY))


def expect_ema(model, m):
    """The EMA of ``model`` at momentum ``m``, computed from fresh parameter lists (float64)."""
    return [m * k.double() + (1 - m) * q.double() for k, q in zip(model.key_parameters(), model.query_parameters(),
                                                                     strict=True)]


def check_ema(model, m):
    want = expect_ema(model, m)
    model.momentum_update(m)
    for got, w in zip(model.key_parameters(), want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=2.5e-7, atol=1e-7)


def test_momentum_update_builds_its_parameter_lists_once(monkeypatch):
    model = tiny_moco()
    calls = []
    original = type(model).key_parameters
    monkeypatch.setattr(type(model), "key_parameters", lambda self: calls.append(1) or original(self))
    for _ in range(3):
        model.momentum_update(0.9)
    assert len(calls) == 1  # not one walk over the modules per optimizer step


def test_momentum_update_stays_exact_when_parameters_are_replaced(tmp_path):
    """from_pretrained and load_state_dict(assign=True) put new tensors behind the names: the cached lists
    follow them (a stale cache would average tensors that are no longer the model's)."""
    from hf_contrast import MoCoModel

    model = tiny_moco()
    with torch.no_grad():
        for p in model.query_parameters():
            p.add_(0.5)
    check_ema(model, 0.9)
    model.save_pretrained(tmp_path)
    state = {k: v.clone() + 0.25 for k, v in model.state_dict().items() if v.is_floating_point()}
    model.load_state_dict(state, strict=False, assign=True)  # new tensors in the same model
    check_ema(model, 0.8)
    loaded = MoCoModel.from_pretrained(tmp_path)
    with torch.no_grad():
        for p in loaded.query_parameters():
            p.add_(0.5)
    check_ema(loaded, 0.7)
    check_ema(loaded, 0.7)
