"""Lean loss memory (issue 23 item 5): masks written into the logits in place, one logits buffer, one
gradient buffer. Values and gradients against the papers' pseudocode (logits = cat([l_pos, l_neg]) / T,
masked entries -inf, cross-entropy); memory from the allocator events torch.profiler records (what
``hf_contrast.peak_memory_bytes`` replays on CPU), bounds the earlier implementation broke."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY
from torch.profiler import ProfilerActivity, profile

from hf_contrast import (
    MoCoConfig,
    MoCoModel,
    info_nce_logits,
    mocov3_logits,
    nt_xent_logits,
    peak_memory_bytes,
)
from hf_contrast.models.losses import contrastive_loss, cross_entropy

NEG_INF = float("-inf")


def grads_of(loss_fn, *leaves):
    """(loss, gradients of ``leaves``) of ``loss_fn(*copies)`` with fresh leaf copies."""
    copies = [x.detach().clone().requires_grad_() for x in leaves]
    loss = loss_fn(*copies)
    return loss.detach(), torch.autograd.grad(loss, copies)


def reference_moco(q, k, queue, valid, q_ids, queue_ids, t):
    """MoCo Algorithm 1: l_pos = q.k, l_neg = q @ queue.T, logits = cat([l_pos, l_neg]) / T, then the
    unused slots and the queued keys of the query's own image (known ids) at -inf; CE with label 0."""
    q, k, queue = F.normalize(q, dim=1), F.normalize(k, dim=1), F.normalize(queue, dim=1)
    l_pos = (q * k).sum(1, keepdim=True)
    logits = torch.cat([l_pos, q @ queue.T], dim=1) / t  # (N, 1 + K)
    masked = ~valid | ((q_ids[:, None] == queue_ids[None, :]) & (q_ids[:, None] != -1))  # (N, K)
    logits = logits.masked_fill(F.pad(masked, (1, 0), value=False), NEG_INF)
    return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


def test_cross_entropy_equals_torch_and_gives_masked_entries_no_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 12, generator=g) * 5
    logits[:, 3] = NEG_INF
    logits[2, 7:] = NEG_INF
    labels = torch.tensor([0, 1, 2, 4, 5, 11, 0])
    weight = torch.tensor(2.5)  # a non-unit upstream gradient
    got_loss, (got,) = grads_of(lambda x: cross_entropy(x, labels) * weight, logits)
    want_loss, (want,) = grads_of(lambda x: F.cross_entropy(x, labels) * weight, logits)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert (got[:, 3] == 0).all() and (got[2, 7:] == 0).all()


@pytest.mark.parametrize("t", [0.07, 0.2])
def test_moco_logits_with_masks_equal_the_pseudocode(t):
    """Unused slots (some holding stale ids of the batch), the queries' own images queued (one twice,
    one duplicated in the batch), unknown ids on both sides: loss and gradients of q, k to 1e-6."""
    g = torch.Generator().manual_seed(1)
    n, size, d = 6, 40, 8
    q, k, queue = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(size, d, generator=g)
    valid = torch.arange(size) < 33
    queue_ids = torch.randint(100, 200, (size,), generator=g)
    queue_ids[[0, 5, 9, 20]] = torch.tensor([1, 1, 3, -1])  # query 1's image twice, query 3's once, one unknown
    queue_ids[35] = 2  # a stale id in an unused slot: masked as unused, counted once
    q_ids = torch.tensor([0, 1, 2, 3, 1, -1])  # image 1 in the batch twice; an unknown query

    def ours(q, k):
        logits, labels = info_nce_logits(q, k, queue, t, valid, query_ids=q_ids, negative_ids=queue_ids)
        assert logits.shape == (n, 1 + size) and labels.eq(0).all()
        return cross_entropy(logits, labels)

    got_loss, got = grads_of(ours, q, k)
    want_loss, want = grads_of(lambda q, k: reference_moco(q, k, queue, valid, q_ids, queue_ids, t), q, k)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    logits, _ = info_nce_logits(q, k, queue, t, valid, query_ids=q_ids, negative_ids=queue_ids)
    assert torch.isneginf(logits).sum(1).tolist() == [7, 9, 7, 8, 9, 7]  # 7 unused + the own image's keys


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("filled", [0, 30])
def test_moco_model_loss_and_gradient_equal_the_pseudocode(symmetric, filled):
    """The model's training step (both halves in one buffer, the step's other keys standing in while the
    queue is empty) against the pseudocode per half, averaged; gradients of every query-side parameter."""
    torch.manual_seed(0)
    m = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=32, key_bn_splits=1, symmetric_loss=symmetric,
                             **TINY)).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([0, 1, 2, 3, 4, 1])  # image 1 twice: not a negative of itself in the in-batch block
    m.enqueue(torch.randn(filled, 16, generator=g), torch.arange(filled) % 8)  # own images queued
    x1, x2 = torch.randn(6, 3, 32, 32, generator=g), torch.randn(6, 3, 32, 32, generator=g)
    out = m(x1, x2, instance_ids=ids)
    params = m.query_parameters()
    got = torch.autograd.grad(out.loss, params)
    t, queue, queue_ids, valid = m.config.temperature, m.queue.keys, m.queue.instance_ids, m.queue.valid()
    pairs = [(m._query(x1), m.encode_keys(x2))]
    if symmetric:
        pairs.append((m._query(x2), m.encode_keys(x1)))
    if filled:
        terms = [reference_moco(q, k, queue, valid, ids, queue_ids, t) for q, k in pairs]
    else:  # empty queue: the other images' keys of the step (not the image itself, nor its other crop)
        terms = [reference_moco(q, k, k, torch.ones(6, dtype=torch.bool), ids, ids, t) for q, k in pairs]
    want_loss = sum(terms) / len(terms)
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, torch.autograd.grad(want_loss, params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mocov3_queue_logits_mask_the_own_image_in_place():
    g = torch.Generator().manual_seed(3)
    n, m, size, d, t = 4, 8, 12, 8, 0.2
    q, keys, queue = torch.randn(n, d, generator=g), torch.randn(m, d, generator=g), torch.randn(size, d, generator=g)
    valid, queue_ids, q_ids = torch.arange(size) < 10, torch.arange(size) % 6, torch.tensor([0, 1, 7, -1])

    def ours(q):
        logits, labels = mocov3_logits(q, keys, t, 1, queue, valid, query_ids=q_ids, queue_ids=queue_ids)
        return cross_entropy(logits, labels)

    def reference(q):  # ctr(q, k) with the queue as extra columns, masked
        qn = F.normalize(q, dim=1)
        logits = torch.cat([qn @ F.normalize(keys, dim=1).T, qn @ F.normalize(queue, dim=1).T], 1) / t
        masked = ~valid | ((q_ids[:, None] == queue_ids) & (q_ids[:, None] != -1))
        logits = logits.masked_fill(F.pad(masked, (m, 0), value=False), NEG_INF)
        return F.cross_entropy(logits, torch.arange(n) + n)

    (got_loss, got), (want_loss, want) = grads_of(ours, q), grads_of(reference, q)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_nt_xent_self_entries_in_place_equal_the_pseudocode(rank):
    """SimCLR Algorithm 1 on all 2M views: s = z z^T / T with s_ii = -inf; the local rows of ``rank``."""
    g = torch.Generator().manual_seed(4)
    n, world, d, t = 5, 3, 8, 0.1
    z_a, z_b = torch.randn(n * world, d, generator=g), torch.randn(n * world, d, generator=g)
    rows = torch.cat([torch.arange(n) + rank * n, torch.arange(n) + rank * n + n * world])  # this rank's anchors

    def ours(z_a, z_b):
        local = dict(z_a_all=z_a, z_b_all=z_b, rank=rank) if world > 1 else {}
        logits, positives = nt_xent_logits(z_a[rank * n : rank * n + n], z_b[rank * n : rank * n + n], t, **local)
        return cross_entropy(logits, positives)

    def reference(z_a, z_b):
        z = F.normalize(torch.cat([z_a, z_b]), dim=1)
        s = (z @ z.T / t).masked_fill(torch.eye(2 * n * world, dtype=torch.bool), NEG_INF)
        positives = torch.cat([torch.arange(n * world) + n * world, torch.arange(n * world)])
        return F.cross_entropy(s[rows], positives[rows])

    (got_loss, got), (want_loss, want) = grads_of(ours, z_a, z_b), grads_of(reference, z_a, z_b)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def allocations(fn) -> list[int]:
    """Sizes in bytes of every CPU allocator allocation while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.nbytes() for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type().name == "CPU" and e.nbytes() > 0]


def test_moco_step_allocates_no_mask_over_the_logits_and_one_logits_sized_gradient():
    """B = 16 queries, K = 4096 (a full queue with the queries' own images in it), D = 8, exclude_same_instance:
    logits + loss + backward. Before, it made (B, 1 + K) bool masks (excluded, positive, ~positive, masked),
    int64 row sums of them, three (B, 1 + K) float copies, a log-softmax and two gradients: 4.8x the logits at
    its peak. Now: no (B, 1 + K) mask, and the peak is the normalised queue, the logits and one gradient."""
    torch.manual_seed(0)
    b, size, d = 16, 4096, 8
    m = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=size, projection_dim=d, image_size=32,
                             projection_hidden_dim=32)).train()
    m.enqueue(torch.randn(size, d), torch.arange(size) % 64)  # every query's image queued 64 times
    g = torch.Generator().manual_seed(5)
    q, k, ids = torch.randn(b, d, generator=g).requires_grad_(), torch.randn(b, d, generator=g), torch.arange(b)
    queue = (m.queue.keys, m.queue.instance_ids, m.queue.valid())
    stand_in = m.queue.filled == 0

    def step():
        logits, labels, _, counts, _, _ = m._contrast(q, k, *queue, ids, stand_in)
        contrastive_loss(logits, labels, m.config.temperature).backward()
        assert counts.tolist() == [size - 64] * b  # the own image's 64 keys masked

    step()
    logits_bytes, queue_bytes = 4 * b * (1 + size), 4 * size * d
    sizes = allocations(step)
    assert b * (1 + size) not in sizes  # no bool mask over the logits
    assert sizes.count(8 * b * (1 + size)) == 0 and sizes.count(8 * b * size) == 0  # no int64 row sums of one
    assert peak_memory_bytes(step) <= queue_bytes + 2.2 * logits_bytes  # before: about 4.8 * logits_bytes


def test_nt_xent_step_makes_no_self_mask_and_no_copy_of_the_logits():
    """N = 64 images, D = 8: NT-Xent logits (2N, 2N) + loss + backward. Before: a (2N, 2N) bool self-mask,
    the logits, their division by T and their masked copy, a log-softmax copy and two gradients (8 float
    (2N, 2N) buffers); now the matmul's result, the log-sum-exp's temporary and one gradient (3)."""
    n, d = 64, 8
    g = torch.Generator().manual_seed(6)
    z_a, z_b = torch.randn(n, d, generator=g).requires_grad_(), torch.randn(n, d, generator=g).requires_grad_()

    def step():
        logits, positives = nt_xent_logits(z_a, z_b, 0.2)
        contrastive_loss(logits, positives, 0.2).backward()

    step()
    sizes = allocations(step)
    assert (2 * n) * (2 * n) not in sizes  # no bool self-mask
    assert sizes.count(4 * (2 * n) * (2 * n)) == 3
