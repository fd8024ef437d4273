import pytest
import torch
import torch.nn.functional as F
from conftest import TINY
from transformers import AutoConfig, AutoModel

from hf_contrast import MoCoConfig, MoCoModel, SimCLRConfig, SimCLRModel


def moco(**kw):
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=kw.pop("queue_size", 10), **TINY, **kw))


def views(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randn(n, 3, 32, 32, generator=g)


def test_moco_attributes_and_key_side_frozen():
    m = moco()
    assert m.queue.keys.shape == (10, 16) and m.queue.ptr.dtype == torch.long and m.queue_ptr == 0
    torch.testing.assert_close(m.queue.keys.norm(dim=1), torch.ones(10))
    assert all(not p.requires_grad for p in m.key_parameters())
    assert all(p.requires_grad for p in m.query_parameters())
    for a, b in zip(m.key_parameters(), m.query_parameters(), strict=False):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # deep copy, not shared


def test_moco_forward_matches_paper_pseudocode_and_does_not_touch_queue():
    m = moco(key_bn_splits=1)  # one key batch: the same BatchNorm statistics as the reference
    m.enqueue(F.normalize(torch.randn(6, 16), dim=1))
    x1, x2 = views()
    queue_before = m.queue.keys.clone()
    out = m(x1, x2)
    assert torch.equal(m.queue.keys, queue_before) and int(m.queue_ptr) == 6  # forward never mutates the queue
    assert out.num_negatives == 6 and out.queue_keys.shape == (4, 16)
    # the whole buffer: 1 + 10 columns, the 4 unused slots at -inf (static shapes while the queue fills)
    assert out.logits.shape == (4, 11) and torch.isneginf(out.logits[:, 7:]).all()
    assert torch.isfinite(out.logits[:, :7]).all() and out.negative_counts.tolist() == [6] * 4
    # MoCo Algorithm 1 on the same weights (BN in train mode on both sides)
    q = F.normalize(m.projector(m.encoder(x1)), dim=1)
    with torch.no_grad():
        k = F.normalize(m.key_projector(m.key_encoder(x2)), dim=1)
    l_pos = (q * k).sum(1, keepdim=True)
    l_neg = q @ m.queue.keys[:6].T
    ref = F.cross_entropy(torch.cat([l_pos, l_neg], 1) / 0.2, torch.zeros(4, dtype=torch.long))
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    out.loss.backward()
    assert all(p.grad is None for p in m.key_parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.encoder.parameters())


def test_moco_enqueue_after_loss_is_safe_without_a_copy_and_fifo():
    m = moco(queue_size=5, key_bn_splits=1)
    x1, x2 = views(3)
    m.enqueue(F.normalize(torch.randn(5, 16), dim=1))
    # the hazard: a loss over the live queue cannot back-propagate once the queue is written in place
    hazard = (m.projector(m.encoder(x1)) @ m.queue.keys.T).sum()
    m.enqueue(F.normalize(torch.randn(2, 16), dim=1))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hazard.backward()
    # the model's negatives are the live queue, not a 32 MiB copy, and yet safe: the loss normalises
    # them into a new tensor, which is what autograd saves
    assert m.negatives().data_ptr() == m.queue.keys.data_ptr()
    for _step in range(3):
        out = m(x1, x2)
        m.enqueue(out.queue_keys)  # in place write after the loss used the queue
        out.loss.backward()
    assert int(m.queue_filled) == 5 and int(m.queue_ptr) == (2 + 9) % 5


def test_moco_symmetric_loss_uses_both_views():
    """Loss = mean of InfoNCE(q1, k2) and InfoNCE(q2, k1), both against the SAME pre-step queue;
    keys to enqueue are [k2; k1]; the forward enqueues nothing (lightly #564 is this bug in a peer)."""
    m = moco(symmetric_loss=True, key_bn_splits=1)  # deterministic keys: one BN batch per view
    m.enqueue(F.normalize(torch.randn(7, 16), dim=1))
    negatives = m.queue.keys[:7].clone()
    x1, x2 = views()
    out = m(x1, x2)
    with torch.no_grad():
        k1 = F.normalize(m.key_projector(m.key_encoder(x1)), dim=1)
        k2 = F.normalize(m.key_projector(m.key_encoder(x2)), dim=1)
        q1 = F.normalize(m.projector(m.encoder(x1)), dim=1)
        q2 = F.normalize(m.projector(m.encoder(x2)), dim=1)

    def info_nce(q, k):  # paper pseudocode: l_pos = q.k, l_neg = q.queue, CE with label 0
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ negatives.T], 1) / 0.2
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long), reduction="none")

    want = torch.cat([info_nce(q1, k2), info_nce(q2, k1)]).mean()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.loss.item() != pytest.approx(info_nce(q1, k2).mean().item(), rel=1e-3)  # not one half only
    torch.testing.assert_close(out.queue_keys, torch.cat([k2, k1]), rtol=1e-5, atol=1e-5)
    assert int(m.queue_filled) == 7 and torch.equal(m.queue.keys[:7], negatives)


def test_momentum_update_on_model_is_exact_and_skips_buffers():
    m = moco()
    with torch.no_grad():
        for p in m.query_parameters():
            p.add_(1.0)
    k0 = [p.clone() for p in m.key_parameters()]
    bn_before = m.key_encoder.bn1.running_mean.clone()
    m.momentum_update(0.9)
    for k, k_before, q in zip(m.key_parameters(), k0, m.query_parameters(), strict=False):
        torch.testing.assert_close(k, 0.9 * k_before + 0.1 * q, rtol=0, atol=1e-6)
    assert torch.equal(m.key_encoder.bn1.running_mean, bn_before)


def test_simclr_forward_counts_negatives():
    torch.manual_seed(0)
    m = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    out = m(*views(5))
    assert out.num_negatives == 8 and out.logits.shape == (10, 10)
    out.loss.backward()


def test_save_load_round_trip_every_tensor(tmp_path):
    m = moco()
    out = m(*views(8))  # split-BN: 4 sub-batches of 2
    m.enqueue(out.queue_keys)
    m.momentum_update(0.5)
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    for loader in (MoCoModel.from_pretrained, AutoModel.from_pretrained):
        loaded = loader(tmp_path)
        assert isinstance(loaded, MoCoModel)
        sd, sd2 = m.state_dict(), loaded.state_dict()
        assert set(sd) == set(sd2)
        assert {"queue.keys", "queue.instance_ids", "queue.entry_steps", "queue.ptr", "queue.filled"} <= set(sd)
        assert any(k.startswith("key_encoder.") for k in sd)
        for key in sd:
            assert torch.equal(sd[key], sd2[key]), key
        assert all(not p.requires_grad for p in loaded.key_parameters())
    assert isinstance(AutoConfig.from_pretrained(tmp_path), MoCoConfig)


def test_simclr_auto_model_round_trip(tmp_path):
    torch.manual_seed(0)
    m = SimCLRModel(SimCLRConfig(backbone="test_vit", **TINY))
    m.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, SimCLRModel)
    x = views()[0]
    m.eval()
    loaded.eval()
    torch.testing.assert_close(m.encode(x), loaded.encode(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(momentum=1.2), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(queue_size=0), "queue_size"),
        (dict(queue_size=2.5), "queue_size"),
        (dict(backbone="resnet181"), "backbone"),
        (dict(momentum_schedule="linear"), "momentum_schedule"),
        (dict(projection_dim=0), "projection_dim"),
        (dict(backbone_kwargs={"num_classes": 10}), "backbone_kwargs"),
    ],
)
def test_bad_config_raises_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        MoCoConfig(**kwargs)
    assert "must" in str(err.value) or "Did you mean" in str(err.value)


def test_unknown_backbone_suggests_close_names():
    with pytest.raises(ValueError, match="resnet18"):
        SimCLRConfig(backbone="resnet81")


def test_simclr_sync_batch_norm_keeps_checkpoint_names():
    torch.manual_seed(0)
    plain = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    torch.manual_seed(0)
    synced = SimCLRModel(SimCLRConfig(backbone="test_resnet", sync_batch_norm=True, **TINY))
    assert any(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules())
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in plain.modules())
    assert plain.state_dict().keys() == synced.state_dict().keys()
    x1, x2 = views()
    # one process: SyncBatchNorm is plain BatchNorm, so the loss is the same
    assert synced(x1, x2).loss.item() == pytest.approx(plain(x1, x2).loss.item(), rel=1e-6)
