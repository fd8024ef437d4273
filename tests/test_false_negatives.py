"""False-negative cancellation (Huynh et al. 2022) against references written as loops from the
paper's procedure: score each candidate by its best cosine to the anchor's support views (here the
anchor's two views), take the top k, then drop them from the denominator (eliminate) or also count
them as positives (attract)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

from hf_contrast import MoCoConfig, MoCoModel, MoCoV3Config, MoCoV3Model, SimCLRConfig, SimCLRModel


def cos(a, b):
    return float(F.cosine_similarity(a, b, dim=0))


def reference(anchor, support, positive, candidates, top_k, mode, t, threshold=None):
    """One anchor's FNC loss. candidates: list of embeddings that are negatives before cancellation."""
    score = [max(cos(s, c) for s in support) for c in candidates]
    order = sorted(range(len(candidates)), key=lambda j: -score[j])[:top_k]
    fn = [j for j in order if threshold is None or score[j] > threshold]
    pos = cos(anchor, positive) / t
    neg = [cos(anchor, c) / t for c in candidates]
    if mode == "eliminate":
        denom = math.exp(pos) + sum(math.exp(v) for j, v in enumerate(neg) if j not in fn)
        return -(pos - math.log(denom)), len(candidates) - len(fn)
    denom = math.exp(pos) + sum(math.exp(v) for v in neg)
    picked = [pos] + [neg[j] for j in fn]
    return -sum(v - math.log(denom) for v in picked) / len(picked), len(candidates) - len(fn)


def moco(**kw):
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=16, key_bn_splits=1, **TINY, **kw)).eval()


@pytest.mark.parametrize("mode,threshold", [("eliminate", None), ("attract", None), ("eliminate", 0.3)])
def test_moco_cancellation_matches_the_loop(mode, threshold):
    m = moco(false_negatives=mode, false_negative_top_k=3, false_negative_threshold=threshold)
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(4, 3, 32, 32, generator=g), torch.randn(4, 3, 32, 32, generator=g)
    with torch.no_grad():
        q, k = m.projector(m.encoder(x1)), m.key_projector(m.key_encoder(x2))
    rows = F.normalize(torch.cat([q[[1, 2]] + 0.1 * torch.randn(2, 16, generator=g), torch.randn(8, 16, generator=g)]), dim=1)
    ids = torch.tensor([10, 11, 12, 0, 14, 15, 16, 17, 18, 19])  # row 3 is query 0's own image
    m.enqueue(rows, ids)
    out = m(x1, x2, instance_ids=torch.arange(4))
    want, counts = [], []
    for i in range(4):
        cands = [r for r, j in zip(rows, ids.tolist(), strict=True) if j != i]
        loss, n = reference(q[i], [q[i], k[i]], k[i], cands, 3, mode, 0.2, threshold)
        want.append(loss)
        counts.append(n)
    assert out.loss.item() == pytest.approx(sum(want) / 4, rel=1e-5)
    assert float(out.num_negatives) == pytest.approx(sum(counts) / 4)
    plain = moco()
    plain.load_state_dict(m.state_dict())
    assert plain(x1, x2, instance_ids=torch.arange(4)).loss.item() != pytest.approx(out.loss.item(), rel=1e-3)
    if threshold is None:
        assert out.false_negatives_removed.tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("mode", ["eliminate", "attract"])
def test_simclr_cancellation_matches_the_loop(mode):
    torch.manual_seed(0)
    m = SimCLRModel(SimCLRConfig(backbone="test_resnet", false_negatives=mode, false_negative_top_k=2,
                                 projection_batch_norm=False, **TINY)).eval()
    x1, x2 = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    out = m(x1, x2)
    with torch.no_grad():
        z = m.projector(m.encoder(torch.cat([x1, x2])))  # (8, D): [views a; views b]
    n, want = 4, []
    for i in range(2 * n):
        img = i % n
        cands = [z[j] for j in range(2 * n) if j not in (i, (i + n) % (2 * n))]
        want.append(reference(z[i], [z[img], z[img + n]], z[(i + n) % (2 * n)], cands, 2, mode, 0.1)[0])
    assert out.loss.item() == pytest.approx(sum(want) / (2 * n), rel=1e-5)
    assert float(out.num_negatives) == 2 * n - 2 - 2


@pytest.mark.parametrize("mode", ["eliminate", "attract"])
def test_mocov3_cancellation_matches_the_loop(mode):
    """MoCo v3: per half ctr(q, k) times 2T; a query's candidates are the other images' keys of the
    other view, its support set the query and its own key."""
    torch.manual_seed(0)
    t = 0.2
    m = MoCoV3Model(MoCoV3Config(backbone="test_resnet", false_negatives=mode, false_negative_top_k=2,
                                 temperature=t, projection_hidden_dim=32, projection_dim=16,
                                 predictor_hidden_dim=24, image_size=32)).eval()
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(5, 3, 32, 32, generator=g), torch.randn(5, 3, 32, 32, generator=g)
    out = m(x1, x2)
    with torch.no_grad():
        q1, q2 = m.predictor(m.projector(m.encoder(x1))), m.predictor(m.projector(m.encoder(x2)))
        k1, k2 = m.encode_keys(x1), m.encode_keys(x2)
    want = 0.0
    for q, k in ((q1, k2), (q2, k1)):
        losses = [reference(q[i], [q[i], k[i]], k[i], [k[j] for j in range(5) if j != i], 2, mode, t)[0]
                  for i in range(5)]
        want += sum(losses) / 5 * 2 * t
    assert out.loss.item() == pytest.approx(want, rel=1e-5)
    assert float(out.num_negatives) == 5 - 1 - 2
    assert out.false_negatives_removed.tolist() == [2] * 10 and out.negative_counts.shape == (10,)
    plain = MoCoV3Model(MoCoV3Config(backbone="test_resnet", temperature=t, projection_hidden_dim=32,
                                     projection_dim=16, predictor_hidden_dim=24, image_size=32)).eval()
    plain.load_state_dict(m.state_dict())
    assert plain(x1, x2).loss.item() != pytest.approx(out.loss.item(), rel=1e-3)


def test_threshold_limits_the_top_k():
    m = moco(false_negatives="eliminate", false_negative_top_k=3, false_negative_threshold=0.3)
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(4, 3, 32, 32, generator=g), torch.randn(4, 3, 32, 32, generator=g)
    m.enqueue(F.normalize(torch.randn(10, 16, generator=g), dim=1), torch.arange(10, 20))
    removed = m(x1, x2, instance_ids=torch.arange(4)).false_negatives_removed
    m.config.false_negative_threshold = None
    assert m(x1, x2, instance_ids=torch.arange(4)).false_negatives_removed.tolist() == [3] * 4
    assert removed.sum() < 12  # random keys: few are above a cosine of 0.3


def test_card_and_count_show_cancellation_and_the_measured_mean():
    from hf_contrast import EncoderCardData
    from hf_contrast.models.negatives import negatives_per_anchor

    m = moco(false_negatives="eliminate", false_negative_top_k=10)
    card = EncoderCardData.from_model(m, per_device_batch_size=8, log_history=[{"loss": 1.0, "num_negatives": 5.25}])
    text = str(card.to_model_card())
    assert card.negatives == negatives_per_anchor(m.config, 8) == 16 - 10
    assert "| negatives per anchor, measured after masking (mean, last log) | 5.25 |" in text
    assert "own image were masked; false-negative cancellation (eliminate, top 10" in text
    s = SimCLRModel(SimCLRConfig(backbone="test_resnet", false_negatives="attract", false_negative_top_k=2, **TINY))
    assert negatives_per_anchor(s.config, 8, world_size=2) == 2 * 8 * 2 - 2 - 2


def test_false_negative_monitor_measures_the_queue_share_and_what_fnc_takes():
    from hf_contrast import FalseNegativeMonitor

    m = moco(false_negative_top_k=2)
    train_labels = [i % 3 for i in range(30)]  # instance id -> class
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 12, 15])  # classes 0,1,2,0,1,2,0,0,0,0
    m.enqueue(F.normalize(torch.randn(10, 16, generator=g), dim=1), ids)
    held_out = [{"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": c} for c in (0, 1, 2, 0)]
    values = FalseNegativeMonitor(train_labels, held_out, num_samples=4).measure(m.train(), None)
    assert m.training  # mode restored
    assert values["queue_same_class"] == pytest.approx((6 + 2 + 2 + 6) / 40)
    with torch.no_grad():
        m.eval()
        x = torch.stack([h["pixel_values"] for h in held_out])
        q, k = m.projector(m.encoder(x)), m.key_projector(m.key_encoder(x))
    rows = m.queue.keys[:10]
    same = 0
    for i, h in enumerate(held_out):
        score = [max(cos(q[i], r), cos(k[i], r)) for r in rows]
        top = sorted(range(10), key=lambda j: -score[j])[:2]
        same += sum(train_labels[int(ids[j])] == h["labels"] for j in top)
    assert values["fnc_taken"] == 2 and values["fnc_same_class_taken"] == pytest.approx(same / 4)
