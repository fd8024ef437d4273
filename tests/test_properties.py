"""Property tests (hypothesis): the NegativeQueue is FIFO for any size and batch sequence; the losses do not
depend on the order of the batch and scale with temperature as the formulas say."""

import math
from collections import deque

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_contrast import info_nce_logits, info_nce_loss, nt_xent_logits, nt_xent_loss

FAST = settings(max_examples=60, deadline=None)


def embeddings(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)


@FAST
@given(seed=st.integers(0, 10_000), n=st.integers(2, 9), d=st.integers(2, 8), t=st.floats(0.05, 2.0))
def test_nt_xent_is_invariant_to_permuting_the_batch(seed, n, d, t):
    z_a, z_b = embeddings(seed, n, d)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    a, b = nt_xent_loss(z_a, z_b, t), nt_xent_loss(z_a[perm], z_b[perm], t)
    assert math.isclose(a.item(), b.item(), rel_tol=1e-5, abs_tol=1e-6)
    swapped = nt_xent_loss(z_b, z_a, t)  # the two views play symmetric roles
    assert math.isclose(a.item(), swapped.item(), rel_tol=1e-5, abs_tol=1e-6)


@FAST
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), k=st.integers(1, 20), t=st.floats(0.05, 2.0))
def test_info_nce_is_invariant_to_permuting_batch_and_queue(seed, n, k, t):
    q, key = embeddings(seed, n, 8)
    queue = torch.randn(k, 8, generator=torch.Generator().manual_seed(seed + 2))
    pb = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 3))
    pk = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 4))
    a, b = info_nce_loss(q, key, queue, t), info_nce_loss(q[pb], key[pb], queue[pk], t)
    assert math.isclose(a.item(), b.item(), rel_tol=1e-5, abs_tol=1e-6)


@FAST
@given(seed=st.integers(0, 10_000), t1=st.floats(0.05, 2.0), t2=st.floats(0.05, 2.0))
def test_logits_scale_as_one_over_temperature(seed, t1, t2):
    z_a, z_b = embeddings(seed, 5, 6)
    l1, pos1 = nt_xent_logits(z_a, z_b, t1)
    l2, pos2 = nt_xent_logits(z_a, z_b, t2)
    assert torch.equal(pos1, pos2)
    finite = torch.isfinite(l1)
    torch.testing.assert_close(l1[finite] * t1, l2[finite] * t2, rtol=1e-5, atol=1e-6)  # cosines, unchanged
    m1, _ = info_nce_logits(z_a, z_b, z_a, t1)
    m2, _ = info_nce_logits(z_a, z_b, z_a, t2)
    torch.testing.assert_close(m1 * t1, m2 * t2, rtol=1e-5, atol=1e-6)


@FAST
@given(seed=st.integers(0, 10_000), k=st.integers(1, 50))
def test_high_temperature_tends_to_no_signal(seed, k):
    """As t grows every logit tends to 0, so the loss tends to ln(K + 1) (ln(2N - 1) for NT-Xent)."""
    q, key = embeddings(seed, 4, 8)
    queue = torch.randn(k, 8, generator=torch.Generator().manual_seed(seed))
    assert math.isclose(info_nce_loss(q, key, queue, 1e4).item(), math.log(k + 1), rel_tol=1e-3)
    assert math.isclose(nt_xent_loss(q, key, 1e4).item(), math.log(2 * 4 - 1), rel_tol=1e-3)


@FAST
@given(size=st.integers(1, 17),
       pushes=st.lists(st.tuples(st.integers(1, 25), st.sampled_from([None, True, False])), min_size=1, max_size=12))
def test_negative_queue_is_a_bounded_deque_that_skips_rejected_pushes(size, pushes):
    """NegativeQueue.push (device pointer, index_copy_) against a deque: oldest first from the pointer, the
    valid slots are the deque's length, and a push with accept=False leaves everything as it was."""
    from hf_contrast.models.queue import NegativeQueue

    queue = NegativeQueue(size, 1)
    reference = deque(maxlen=size)
    counter = 0
    for b, accept in pushes:
        keys = torch.arange(counter, counter + b, dtype=torch.float).unsqueeze(1)  # (b, 1) unique values
        counter += b
        queue.push(keys, keys.squeeze(1).long(), step=counter,
                   accept=None if accept is None else torch.tensor(accept))
        if accept is not False:
            reference.extend(keys.squeeze(1).tolist())
        ptr, filled = int(queue.ptr), int(queue.filled)
        assert filled == len(reference) and int(queue.valid().sum()) == filled and 0 <= ptr < size
        rows = torch.cat([queue.keys[ptr:], queue.keys[:ptr]]) if filled == size else queue.keys[:filled]
        assert rows.squeeze(1).tolist() == list(reference)
        assert torch.equal(queue.instance_ids[:filled], queue.keys[:filled, 0].long())
