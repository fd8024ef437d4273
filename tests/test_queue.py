"""The instance-aware queue: ids beside keys, same-instance masking, checkpoints, and no host sync."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY
from safetensors.torch import load_file, save_file

from hf_contrast import MoCoConfig, MoCoModel
from hf_contrast.models.queue import NegativeQueue


def moco(**kw):
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=kw.pop("queue_size", 12),
                                key_bn_splits=kw.pop("key_bn_splits", 1),
                                **TINY, **kw))


def views(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randn(n, 3, 32, 32, generator=g)


def naive_loss(q, k, rows, t=0.2):
    """MoCo's InfoNCE for one query against the given queue rows, as a loop."""
    q, k = F.normalize(q, dim=0), F.normalize(k, dim=0)
    logits = torch.stack([q @ k] + [q @ r for r in rows]) / t
    return -torch.log_softmax(logits, 0)[0]


def test_push_wraps_keeps_ids_and_steps_and_host_ints():
    queue = NegativeQueue(5, 2)
    queue.push(F.normalize(torch.randn(3, 2), dim=1), torch.tensor([10, 11, 12]), step=0)
    queue.push(F.normalize(torch.randn(4, 2), dim=1), torch.tensor([13, 14, 15, 16]), step=1)
    assert queue.instance_ids.tolist() == [15, 16, 12, 13, 14] and queue.entry_steps.tolist() == [1, 1, 0, 1, 1]
    assert (queue.pointer, queue.num_filled) == (2, 5) and (int(queue.ptr), int(queue.filled)) == (2, 5)
    queue.push(torch.eye(2).repeat(4, 1), torch.arange(8))  # B > K: only the newest 5 survive
    assert queue.instance_ids.tolist() == [3, 4, 5, 6, 7] and queue.pointer == 0  # as 8 sequential writes
    queue.push(torch.eye(2))  # no ids: unknown (-1)
    assert queue.instance_ids.tolist() == [-1, -1, 5, 6, 7]


def test_own_earlier_key_is_masked_exactly():
    """A queue holding a query's own earlier key gives exactly the loss of the queue without that row."""
    m = moco().eval()
    rows = F.normalize(torch.randn(8, 16), dim=1)
    ids = torch.tensor([20, 2, 21, 22, 0, 23, 2, 24])  # query 2's image twice, query 0's once
    m.enqueue(rows, ids)
    x1, x2 = views()
    instance = torch.tensor([0, 1, 2, 3])
    out = m(x1, x2, instance_ids=instance)
    with torch.no_grad():
        q, k = m.projector(m.encoder(x1)), m.key_projector(m.key_encoder(x2))
    want = torch.stack([naive_loss(q[i], k[i], [r for r, j in zip(rows, ids, strict=True) if j != instance[i]]) for i in range(4)])
    assert out.loss.item() == pytest.approx(want.mean().item(), rel=1e-5)
    assert float(out.num_negatives) == pytest.approx((7 + 8 + 6 + 8) / 4)  # the true count after masking
    unmasked = m(x1, x2)  # without ids nothing is masked: a different loss
    assert unmasked.num_negatives == 8 and unmasked.loss.item() != pytest.approx(out.loss.item(), rel=1e-4)
    off = copy.deepcopy(m)
    off.config.exclude_same_instance = False
    assert off(x1, x2, instance_ids=instance).loss.item() == pytest.approx(unmasked.loss.item(), rel=1e-6)


def test_symmetric_loss_masks_both_halves_against_one_pre_step_queue_and_enqueues_once():
    m = moco(symmetric_loss=True).eval()
    rows = F.normalize(torch.randn(6, 16), dim=1)
    ids = torch.tensor([1, 9, 9, 3, 9, 9])
    m.enqueue(rows, ids)
    x1, x2 = views()
    instance = torch.tensor([0, 1, 2, 3])
    out = m(x1, x2, instance_ids=instance)
    with torch.no_grad():
        q1, q2 = m.projector(m.encoder(x1)), m.projector(m.encoder(x2))
        k1, k2 = m.key_projector(m.key_encoder(x1)), m.key_projector(m.key_encoder(x2))
    want = [naive_loss(q[i], k[i], [r for r, j in zip(rows, ids, strict=True) if j != instance[i]])
            for q, k in ((q1, k2), (q2, k1)) for i in range(4)]
    assert out.loss.item() == pytest.approx(torch.stack(want).mean().item(), rel=1e-5)
    assert out.queue_instance_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and m.queue_filled == 6  # forward: no write
    m.enqueue(out.queue_keys, out.queue_instance_ids, step=7)
    assert m.queue.instance_ids[6:12].tolist() == [0, 1, 2, 3, 0, 1] and m.queue.instance_ids[:2].tolist() == [2, 3]
    assert m.queue.entry_steps[6:].tolist() == [7] * 6 and m.queue_ptr == 2 and m.queue_filled == 12


def test_ids_survive_save_and_load(tmp_path):
    m = moco()
    m.enqueue(F.normalize(torch.randn(5, 16), dim=1), torch.tensor([4, 8, 15, 16, 23]), step=3)
    m.save_pretrained(tmp_path)
    loaded = MoCoModel.from_pretrained(tmp_path)
    assert loaded.queue.instance_ids.tolist() == m.queue.instance_ids.tolist()
    assert (loaded.queue_ptr, loaded.queue_filled) == (5, 5) and torch.equal(loaded.queue.keys, m.queue.keys)
    assert torch.equal(loaded.queue.slots, torch.arange(12))  # not in the checkpoint: rebuilt after loading
    assert loaded.queue.valid().tolist() == [True] * 5 + [False] * 7
    x1, x2 = views()
    torch.testing.assert_close(loaded.eval()(x1, x2).loss, m.eval()(x1, x2).loss)
    fresh = moco()
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"))  # the host ints follow the buffers
    assert (fresh.queue_ptr, fresh.queue_filled) == (5, 5) and fresh.queue.entry_steps[:5].tolist() == [3] * 5


def test_legacy_queue_layout_loads_by_state_dict_and_fails_clearly_by_from_pretrained(tmp_path):
    m = moco()
    m.enqueue(F.normalize(torch.randn(5, 16), dim=1), torch.arange(5))
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if not k.startswith("queue.")}
    sd.update(queue=m.queue.keys.clone(), queue_ptr=torch.tensor(5), queue_filled=torch.tensor(5))  # pre-ids layout
    fresh = moco()
    fresh.load_state_dict(sd)
    assert fresh.queue_filled == 5 and torch.equal(fresh.queue.keys, m.queue.keys)
    assert fresh.queue.instance_ids.tolist() == [-1] * 12  # unknown ids: never masked
    m.config.save_pretrained(tmp_path)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks the queue state"):
        MoCoModel.from_pretrained(tmp_path)


def test_training_step_needs_no_host_sync():
    """On the meta device every ``int()`` / ``.item()`` of a tensor raises: forward with masking and
    FNC, backward and enqueue (check_finite=False, as the trainer calls it) run there, so they never
    read a device value on the host. The remaining syncs are documented: ``enqueue(check_finite=True)``
    (drops NaN keys: a data-dependent shape) and ``sync_from_buffers`` (once, after loading)."""
    for mode in ("eliminate", "attract"):
        m = moco(symmetric_loss=True, false_negatives=mode, false_negative_top_k=2, key_bn_splits=2)
        m.enqueue(F.normalize(torch.randn(6, 16), dim=1), torch.arange(6))
        m.to("meta")
        x = torch.empty(8, 3, 32, 32, device="meta")
        out = m(x, x, instance_ids=torch.arange(8, device="meta"))
        out.loss.backward()
        m.enqueue(out.queue_keys, out.queue_instance_ids, step=1, check_finite=False)
        assert (m.queue_ptr, m.queue_filled) == (10, 12)  # host ints: 6 + 16 keys wrap around 12 slots
        with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):  # the documented sync
            m.enqueue(out.queue_keys, out.queue_instance_ids, check_finite=True)


def test_trainer_passes_instance_ids_from_two_view_dataset(digits, tmp_path):
    from hf_contrast import (
        ContrastiveTrainer,
        ContrastiveTrainingArguments,
        TwoViewAugmentation,
        two_view_dataset,
    )

    m = moco(queue_size=24)
    train = two_view_dataset(digits["train"].select(range(32)), TwoViewAugmentation.small_images(32))
    args = ContrastiveTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4,
                                        logging_steps=4, use_cpu=True, report_to="none", disable_tqdm=True,
                                        save_strategy="no", dataloader_num_workers=0)
    trainer = ContrastiveTrainer(model=m, args=args, train_dataset=train)
    trainer.train()
    ids, steps = m.queue.instance_ids.tolist(), m.queue.entry_steps.tolist()
    assert sorted(ids) == sorted(set(ids)) and set(ids) <= set(range(32)) and len(ids) == 24  # 24 distinct images
    assert sorted(steps) == [1] * 8 + [2] * 8 + [3] * 8  # the oldest 8 of step 0 were overwritten
    log = next(h for h in trainer.state.log_history if "num_negatives" in h)
    assert isinstance(log["num_negatives"], float) and log["num_negatives"] <= 24


def old_slice_terms(config, q, k, keys, ids, instance_ids, in_batch=None, rank=0, own_row=False):
    """Yesterday's forward, written out: logits against the FILLED SLICE ``keys (K_filled, D)`` and its ids,
    then the masks (positive, same-instance, FNC) as ``_contrast`` applied them. MoCo v2 (``in_batch=None``:
    positive in column 0) or MoCo v3 (``in_batch``: the other view's keys ``(M, D)``, then the queue).
    ``own_row``: ``keys`` are the step's own keys (MoCo v2's first step), row i of them is query i's
    positive and no negative. Returns ``(loss, per-row negatives or None)``."""
    from hf_contrast.models.false_negatives import cancel_negatives, same_instance_mask, support_scores
    from hf_contrast.models.losses import contrastive_loss, info_nce_logits, mocov3_logits

    t = config.temperature
    if in_batch is None:
        logits, labels = info_nce_logits(q, k, keys, t)
        offset, candidates = 1, keys
    else:
        logits, labels = mocov3_logits(q, in_batch, t, rank, keys)
        offset, candidates = in_batch.shape[0], torch.cat([in_batch, keys])
    exclude = config.exclude_same_instance and instance_ids is not None
    if not exclude and config.false_negatives is None and not own_row:
        return contrastive_loss(logits, labels, t, config.tau_plus), None
    excluded = torch.zeros_like(logits, dtype=torch.bool)
    excluded[torch.arange(len(labels)), labels] = True
    if exclude:
        excluded[:, offset:] = same_instance_mask(instance_ids, ids)
    if own_row:
        excluded[:, offset:] |= torch.eye(len(labels), dtype=torch.bool)
    scores = None
    if config.false_negatives is not None:
        scores = support_scores(torch.stack([q, k], dim=1), candidates)
        if in_batch is None:
            scores = F.pad(scores, (1, 0), value=float("-inf"))
    logits, positive_mask, negatives, _, _ = cancel_negatives(logits, labels, excluded, scores, config)
    return contrastive_loss(logits, labels, t, config.tau_plus, positive_mask), negatives


VARIANTS = [dict(), dict(exclude_same_instance=False), dict(false_negatives="eliminate", false_negative_top_k=2),
            dict(false_negatives="attract", false_negative_top_k=1), dict(tau_plus=0.1)]


@pytest.mark.parametrize("filled", [0, 7, 12])
@pytest.mark.parametrize("variant", VARIANTS + [dict(symmetric_loss=True, false_negatives="eliminate")])
def test_masked_whole_buffer_equals_the_filled_slice_moco(variant, filled):
    """The whole (K, D) buffer with its unused slots at -inf gives exactly the loss, gradient and negative
    count of yesterday's logits against keys[:filled]. filled=0 (the first step) is no longer "no
    negatives at all" (a loss of 0): the negatives are then the other images' keys of the step."""
    m = moco(**variant).train()
    ids = torch.tensor([0, 1, 30, 2, 31, 32, 3, 33, 34, 35, 36, 37])[:filled]  # queries 0-3's own images queued
    m.enqueue(torch.randn(filled, 16, generator=torch.Generator().manual_seed(3)), ids)
    x1, x2 = views()
    instance = torch.arange(4)
    out = m(x1, x2, instance_ids=instance)
    grad = torch.autograd.grad(out.loss, list(m.projector.parameters()))
    q1, q2 = m._query(x1), m._query(x2)
    k1, k2 = m.encode_keys(x1), m.encode_keys(x2)
    keys, kids = m.queue.keys[:filled], m.queue.instance_ids[:filled]
    pairs = [(q1, k2)] + ([(q2, k1)] if m.config.symmetric_loss else [])
    if filled:
        terms = [old_slice_terms(m.config, q, k, keys, kids, instance) for q, k in pairs]
    else:  # empty queue: the step's keys of the other images
        terms = [old_slice_terms(m.config, q, k, k, instance, instance, own_row=True) for q, k in pairs]
    loss = sum(t[0] for t in terms) / len(terms)
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grad, torch.autograd.grad(loss, list(m.projector.parameters())), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    counts = None if terms[0][1] is None else torch.cat([t[1] for t in terms]).float().mean()
    torch.testing.assert_close(out.num_negatives, torch.tensor(float(filled)) if counts is None else counts)
    assert out.logits.shape[1] == 1 + 12  # always the whole buffer (the first step's in-batch keys in its columns)


@pytest.mark.parametrize("filled", [0, 7])
@pytest.mark.parametrize("variant", VARIANTS)
def test_masked_whole_buffer_equals_the_filled_slice_mocov3(variant, filled):
    from hf_contrast import MoCoV3Config, MoCoV3Model

    torch.manual_seed(0)
    m = MoCoV3Model(MoCoV3Config(backbone="test_resnet", queue_size=12, **TINY, **variant)).train()
    ids = torch.tensor([0, 1, 30, 2, 31, 32, 3])[:filled]
    m.enqueue(torch.randn(filled, 16, generator=torch.Generator().manual_seed(3)), ids)
    x1, x2 = views()
    instance = torch.arange(4)
    out = m(x1, x2, instance_ids=instance)
    q1, q2 = m._query(x1), m._query(x2)
    with torch.no_grad():
        k1, k2 = m.encode_keys(x1), m.encode_keys(x2)
    keys, kids = m.queue.keys[:filled], m.queue.instance_ids[:filled]
    t = m.config.temperature
    terms = [old_slice_terms(m.config, q, k, keys, kids, instance, in_batch=k) for q, k in ((q1, k2), (q2, k1))]
    loss = sum(term[0] for term in terms) * (2 * t)
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    want = (torch.cat([term[1] for term in terms]).float().mean() if terms[0][1] is not None
            else torch.tensor(4.0 - 1 + filled))
    torch.testing.assert_close(out.num_negatives, want)


def test_rejected_push_changes_nothing_and_an_accepted_one_is_a_plain_push():
    queue, plain = NegativeQueue(5, 2), NegativeQueue(5, 2)
    plain.load_state_dict(queue.state_dict())
    first = F.normalize(torch.randn(3, 2), dim=1)
    queue.push(first, torch.tensor([1, 2, 3]), step=0, accept=torch.tensor(True))
    plain.push(first, torch.tensor([1, 2, 3]), step=0)
    before = {k: v.clone() for k, v in queue.state_dict().items()}
    queue.push(torch.full((4, 2), float("nan")), torch.tensor([7, 8, 9, 10]), step=1, accept=torch.tensor(False))
    for name, value in queue.state_dict().items():  # keys, ids, entry steps, pointer and fill count
        assert torch.equal(value, before[name]), name
    assert torch.equal(queue.valid(), torch.tensor([True, True, True, False, False]))
    for q in (queue, plain):
        q.push(F.normalize(torch.ones(4, 2), dim=1), torch.tensor([4, 5, 6, 7]), step=2, accept=None if q is plain
               else torch.tensor(True))
    for name, value in plain.state_dict().items():
        assert torch.equal(queue.state_dict()[name], value), name


def test_model_enqueue_passes_accept_through():
    m = moco()
    m.enqueue(torch.randn(4, 16), torch.arange(4), step=0, check_finite=False, accept=torch.tensor(False))
    assert int(m.queue.filled) == 0 and not m.queue.valid().any() and m.queue.instance_ids.tolist() == [-1] * 12
    m.enqueue(torch.randn(4, 16), torch.arange(4), step=0, check_finite=False, accept=torch.tensor(True))
    assert int(m.queue.filled) == 4 and m.queue.instance_ids[:4].tolist() == [0, 1, 2, 3]
