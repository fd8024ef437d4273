"""MoCo v3: the model's loss against the official ``ctr`` written from the pseudocode, the heads against
the official ``_build_mlp``, the EMA, the negatives, the frozen patch projection."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_contrast import MoCoConfig, MoCoModel, MoCoV3Config, MoCoV3Model, mocov3_loss, negatives_per_anchor

HEADS = dict(projection_hidden_dim=32, projection_dim=16, predictor_hidden_dim=24, image_size=32)


def build(backbone="test_resnet", seed=0, **kw) -> MoCoV3Model:
    torch.manual_seed(seed)
    return MoCoV3Model(MoCoV3Config.for_backbone(backbone, **{**HEADS, **kw}))


def views(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randn(n, 3, 32, 32, generator=g)


def official_ctr(q, k, T):
    """``ctr(q, k)`` of the MoCo v3 pseudocode, one process: normalise, logits = q k^T / T, the
    positive of row i in column i, cross-entropy (log-softmax written out) times 2T. In float64."""
    q, k = q.double(), k.double()
    q = q / q.norm(dim=1, keepdim=True)
    k = k / k.norm(dim=1, keepdim=True)
    logits = q @ k.T / T  # (N, N)
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    return -log_prob.diagonal().mean() * 2 * T


@pytest.mark.parametrize("backbone", ["test_resnet", "test_vit"])
@pytest.mark.parametrize("temperature", [1.0, 0.2])
@pytest.mark.parametrize("n", [2, 5, 8])
def test_loss_is_the_official_symmetric_ctr(backbone, temperature, n):
    model = build(backbone, temperature=temperature)
    x1, x2 = views(n)
    with torch.no_grad():
        model.momentum_update(0.5)  # momentum side differs from the query side (after one perturbation)
        for p in model.encoder.parameters():
            p.add_(0.01 * torch.randn_like(p))
        model.momentum_update(0.5)
        loss = model(x1, x2).loss
        q1 = model.predictor(model.projector(model.encoder(x1)))  # the model's own modules, train mode
        q2 = model.predictor(model.projector(model.encoder(x2)))
        k1 = model.momentum_projector(model.momentum_encoder(x1))
        k2 = model.momentum_projector(model.momentum_encoder(x2))
    expected = official_ctr(q1, k2, temperature) + official_ctr(q2, k1, temperature)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(k1, model.projector(model.encoder(x1)).detach())  # keys really are the momentum side's
    assert mocov3_loss(q1, k2, temperature).item() == pytest.approx(official_ctr(q1, k2, temperature).item(), rel=1e-6)


def test_output_shapes_and_negatives():
    model = build()
    out = model(*views(6))
    assert out.logits.shape == (12, 6) and out.labels.tolist() == [*range(6), *range(6)]
    assert out.num_negatives == 5 == negatives_per_anchor(model.config, 6, 1)
    assert negatives_per_anchor(model.config, 6, 4) == 23  # N * W - 1
    off = MoCoV3Config(backbone="test_resnet", gather_distributed=False, **HEADS)
    assert negatives_per_anchor(off, 6, 4) == 5  # per-device: N - 1
    assert negatives_per_anchor(model.config, None, 4) is None


def official_mlp(num_layers, input_dim, mlp_dim, output_dim, last_bn=True):
    """The layer list of facebookresearch/moco-v3 ``_build_mlp``, written from its description."""
    layers = []
    for i in range(num_layers):
        d1 = input_dim if i == 0 else mlp_dim
        d2 = output_dim if i == num_layers - 1 else mlp_dim
        layers.append(("Linear", d1, d2, False))
        if i < num_layers - 1:
            layers += [("BatchNorm1d", d2, True), ("ReLU",)]
        elif last_bn:
            layers.append(("BatchNorm1d", d2, False))
    return layers


def describe(head: nn.Sequential):
    out = []
    for m in head:
        if isinstance(m, nn.Linear):
            out.append(("Linear", m.in_features, m.out_features, m.bias is not None))
        elif isinstance(m, nn.BatchNorm1d):
            out.append(("BatchNorm1d", m.num_features, m.affine))
        else:
            out.append((type(m).__name__,))
    return out


def test_heads_are_the_official_mlps():
    resnet = build("test_resnet")
    d = resnet.encoder.num_features
    assert describe(resnet.projector) == official_mlp(2, d, 32, 16)  # MoCo_ResNet projector
    assert describe(resnet.predictor) == official_mlp(2, 16, 24, 16, last_bn=False)  # no output BN
    vit = build("test_vit")
    assert describe(vit.projector) == official_mlp(3, vit.encoder.num_features, 32, 16)  # MoCo_ViT: 3 layers
    assert describe(vit.predictor) == official_mlp(2, 16, 24, 16)  # non-affine output BN
    assert vit.config.temperature == 0.2 and resnet.config.temperature == 1.0
    assert describe(resnet.momentum_projector) == describe(resnet.projector)
    assert not hasattr(resnet, "momentum_predictor")  # only encoder + projector have a momentum copy


def test_momentum_side_is_frozen_copy_and_ema_is_exact():
    model = build()
    sd = model.state_dict()
    for name, p in model.momentum_encoder.state_dict().items():
        assert torch.equal(p, sd[f"encoder.{name}"])  # starts as a copy
    assert all(not p.requires_grad for p in model.key_parameters())
    assert all(p.requires_grad for p in [*model.encoder.parameters(), *model.predictor.parameters()])
    with torch.no_grad():
        for p in model.query_parameters():
            p.add_(torch.randn_like(p))
    old_k = [p.detach().clone() for p in model.key_parameters()]
    q = [p.detach().clone() for p in model.query_parameters()]
    m = 0.9
    model.momentum_update(m)
    for new, k, qq in zip(model.key_parameters(), old_k, q, strict=True):
        # the official update param_m * m + param_b * (1 - m), in float64; fp32 only rounds
        torch.testing.assert_close(new.double(), k.double() * m + qq.double() * (1 - m), rtol=2.5e-7, atol=1e-7)
    assert len(model.key_parameters()) == len(model.query_parameters())
    assert sum(p.numel() for p in model.predictor.parameters()) > 0  # predictor trained, not averaged


def test_momentum_update_matches_moco_v2():
    """``momentum_update`` is MoCoModel's: the same EMA on the same parameter layout."""
    v3 = build(projection_batch_norm=False, projection_output_batch_norm=False, projection_layers=2)
    torch.manual_seed(0)
    v2 = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=8, projection_hidden_dim=32, projection_dim=16,
                              image_size=32))
    for model in (v2, v3):
        with torch.no_grad():
            for i, p in enumerate(model.query_parameters()):
                p.fill_(0.1 * i)
        model.momentum_update(0.7)
    v3k, v2k = v3.key_parameters(), v2.key_parameters()
    enc = len(list(v3.momentum_encoder.parameters()))
    for a, b in zip(v3k[:enc], v2k[:enc], strict=True):
        assert torch.equal(a, b)


def test_freeze_patch_embed():
    vit = build("test_vit")
    assert vit.config.freeze_patch_embed
    proj = vit.encoder.patch_embed.proj
    assert all(not p.requires_grad for p in proj.parameters())
    before = proj.weight.detach().clone()
    out = vit(*views(4))
    out.loss.backward()
    assert proj.weight.grad is None and torch.equal(proj.weight, before)
    assert vit.encoder.blocks[0].attn.qkv.weight.grad is not None
    trainable = build("test_vit", freeze_patch_embed=False)
    assert trainable.encoder.patch_embed.proj.weight.requires_grad
    with pytest.raises(ValueError, match="freeze_patch_embed"):
        build("test_resnet", freeze_patch_embed=True)


def test_save_and_load_keeps_everything_frozen_where_it_was(tmp_path):
    vit = build("test_vit")
    vit.momentum_update(0.0)
    vit.save_pretrained(tmp_path)
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, MoCoV3Model)
    assert loaded.state_dict().keys() == vit.state_dict().keys()
    for k, v in vit.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert all(not p.requires_grad for p in loaded.key_parameters())
    assert not loaded.encoder.patch_embed.proj.weight.requires_grad


def test_config_validation():
    with pytest.raises(ValueError, match="momentum"):
        MoCoV3Config(backbone="test_resnet", momentum=1.5)
    with pytest.raises(ValueError, match="momentum_schedule"):
        MoCoV3Config(backbone="test_resnet", momentum_schedule="linear")
    with pytest.raises(ValueError, match="predictor_layers"):
        MoCoV3Config(backbone="test_resnet", predictor_layers=0)
    cfg = MoCoV3Config()  # the official ResNet-50 recipe
    assert (cfg.projection_dim, cfg.projection_hidden_dim, cfg.momentum, cfg.momentum_schedule) == (256, 4096, 0.99,
                                                                                                    "cosine")
    assert math.isclose(build().loss_scale, 4.0)


def test_card_counts_gathered_and_per_device_negatives():
    from hf_contrast import EncoderCardData

    card = EncoderCardData.from_model(build(), per_device_batch_size=32, world_size=4)
    assert card.method == "MoCo v3" and card.negatives == 127  # 32 * 4 - 1
    assert "in-batch keys of the momentum encoder, gathered over W processes: N*W - 1 negatives" in \
        card.negatives_explanation and "W = 4" in card.negatives_explanation
    per_device = EncoderCardData.from_model(build(gather_distributed=False), per_device_batch_size=32, world_size=4)
    assert per_device.negatives == 31 and "other 3 process(es) were not used" in per_device.negatives_explanation


# --- the optional queue (queue_size > 0): not in the official code, MoCo v2's queue added to ctr ---

def official_ctr_with_queue(q, k, queue, T, drop=None):
    """``ctr(q, k)`` of the pseudocode with the queued keys appended as extra negative columns:
    logits ``[q k^T | q queue^T] / T`` ``(N, N + K)``, positive of row i in column i, cross-entropy
    times 2T. ``drop[i]``: queue rows left out of row i's denominator. Float64, row by row."""
    q, k, queue = (F.normalize(x.double(), dim=1) for x in (q, k, queue))
    losses = []
    for i in range(q.shape[0]):
        rows = [r for j, r in enumerate(queue) if drop is None or j not in drop.get(i, ())]
        logits = torch.cat([k @ q[i], torch.stack(rows) @ q[i] if rows else q.new_zeros(0)]) / T  # (N + K_i,)
        losses.append(-(logits[i] - torch.logsumexp(logits, 0)))
    return torch.stack(losses).mean() * 2 * T


def queued_model(backbone="test_resnet", size=12, **kw):
    model = build(backbone, queue_size=size, **kw)
    with torch.no_grad():  # a momentum side that differs from the query side
        for p in model.key_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def model_views(model, x1, x2):
    """The model's own queries and (raw) keys of both views, under no_grad, train mode."""
    with torch.no_grad():
        return model._query(x1), model._query(x2), model.encode_keys(x1), model.encode_keys(x2)


@pytest.mark.parametrize("backbone", ["test_resnet", "test_vit"])
def test_queue_loss_is_the_official_ctr_with_queued_columns(backbone):
    """Pre-filled with 7 known keys (of 12 slots: the unfilled rows must not enter), each half is
    ``ctr`` with the queued keys as extra columns, both halves against the same pre-step queue."""
    model = queued_model(backbone)
    known = torch.randn(7, 16, generator=torch.Generator().manual_seed(5))
    model.enqueue(known, torch.arange(7) + 100, step=0)
    before = model.queue.keys.clone()
    x1, x2 = views(5)
    with torch.no_grad():
        out = model(x1, x2)  # no instance ids: nothing masked
    q1, q2, k1, k2 = model_views(model, x1, x2)
    t = model.config.temperature
    expected = official_ctr_with_queue(q1, k2, known, t) + official_ctr_with_queue(q2, k1, known, t)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)
    # the whole 12-slot buffer, its 5 unused slots at -inf (static shapes while the queue fills)
    assert out.logits.shape == (10, 5 + 12) and out.labels.tolist() == [*range(5), *range(5)]
    assert torch.isneginf(out.logits[:, 5 + 7 :]).all() and torch.isfinite(out.logits[:, : 5 + 7]).all()
    assert out.num_negatives == 5 - 1 + 7 and out.negative_counts.tolist() == [5 - 1 + 7] * 10
    torch.testing.assert_close(out.queue_keys, F.normalize(torch.cat([k2, k1]), dim=1))  # view 2, then view 1
    assert torch.equal(model.queue.keys, before) and model.queue_filled == 7  # the forward never enqueues
    without = official_ctr_with_queue(q1, k2, known[:0], t) + official_ctr_with_queue(q2, k1, known[:0], t)
    assert abs(without.item() - expected.item()) > 1e-3  # the queue really entered the loss


def test_queued_keys_of_the_query_own_image_are_masked_exactly():
    """A queued key of the query's own image: that query's rows (both halves) get exactly the loss of the
    queue without that key; the other queries still contrast with it (it is another image to them);
    ``num_negatives`` is the mean count after masking; with the masking off the loss differs."""
    x1, x2 = views(4)
    ids = torch.tensor([10, 11, 12, 13])
    others = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    model = queued_model()
    _, _, k1, _ = model_views(model, x1, x2)
    own = k1[[1, 3]] + 0.01 * torch.randn(2, 16)  # near-copies of images 11 and 13's keys: strong negatives
    rows = torch.cat([others[:2], own[:1], others[2:], own[1:]])  # (7, D): image 11's key at row 2, 13's at 6
    row_ids = torch.tensor([50, 51, 11, 52, 53, 54, 13])
    model.enqueue(rows, row_ids)
    with torch.no_grad():
        out = model(x1, x2, instance_ids=ids)
    per_query = F.cross_entropy(out.logits, out.labels, reduction="none")  # (8,) view-1 queries, then view-2
    for query, row in ((1, 2), (3, 6)):
        keep = [j for j in range(7) if j != row]
        without = queued_model()  # same weights; the queue without the own-image key
        without.enqueue(rows[keep], row_ids[keep])
        with torch.no_grad():
            ref = without(x1, x2, instance_ids=ids)
        ref_rows = F.cross_entropy(ref.logits, ref.labels, reduction="none")
        torch.testing.assert_close(per_query[[query, query + 4]], ref_rows[[query, query + 4]], rtol=1e-6, atol=1e-6)
    plain = queued_model(exclude_same_instance=False)
    plain.enqueue(rows, row_ids)
    with torch.no_grad():
        unmasked = plain(x1, x2, instance_ids=ids)
    plain_rows = F.cross_entropy(unmasked.logits, unmasked.labels, reduction="none")
    torch.testing.assert_close(per_query[[0, 2, 4, 6]], plain_rows[[0, 2, 4, 6]])  # other images: not masked
    assert (plain_rows[[1, 3, 5, 7]] > per_query[[1, 3, 5, 7]] + 1e-3).all()  # own keys as negatives hurt
    assert float(out.num_negatives) == pytest.approx(3 + 7 - 2 / 4)  # queries 1 and 3 lose one column per half
    assert out.negative_counts.tolist() == [10, 9, 10, 9] * 2 and unmasked.num_negatives == 3 + 7
    assert out.queue_instance_ids.tolist() == [10, 11, 12, 13] * 2
    q1, q2, k1, k2 = model_views(model, x1, x2)
    drop = {1: {2}, 3: {6}}
    t = model.config.temperature
    expected = official_ctr_with_queue(q1, k2, rows, t, drop) + official_ctr_with_queue(q2, k1, rows, t, drop)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)


def test_false_negative_candidates_include_the_queue():
    """With the keys of view 2 queued (no ids: not masked as same-instance), each first-view query's
    top candidate is its own key in the queue (similarity 1 to its support key): eliminate takes it."""
    model = queued_model(false_negatives="eliminate", false_negative_top_k=1)
    x1, x2 = views(4)
    _, _, _, k2 = model_views(model, x1, x2)
    model.enqueue(k2)
    with torch.no_grad():
        out = model(x1, x2)
    first = out.logits[:4]  # (4, 4 + 12): queries of view 1 against k2, then the queue (4 filled slots)
    assert torch.equal(torch.isinf(first[:, 4:8]), torch.eye(4, dtype=torch.bool))
    assert torch.isneginf(first[:, 8:]).all()  # unused slots
    assert torch.isfinite(first[:, :4]).all()
    assert out.false_negatives_removed.tolist() == [1] * 8 and float(out.num_negatives) == 4 - 1 + 4 - 1


def test_queue_size_zero_is_the_official_model_and_validation():
    plain, explicit = build(), build(queue_size=0, exclude_same_instance=False)
    assert not hasattr(plain, "queue") and not plain.has_queue and plain.queue_filled == 0
    assert not any(k.startswith("queue") for k in plain.state_dict())
    x1, x2 = views(4)
    with torch.no_grad():
        a, b = plain(x1, x2, instance_ids=torch.arange(4)), explicit(x1, x2)
    assert torch.equal(a.loss, b.loss) and a.queue_keys is None and a.num_negatives == 3
    with pytest.raises(ValueError, match="enqueue needs a queue"):
        plain.enqueue(torch.randn(2, 16))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"queue_size=.* is invalid: queue_size must be an integer >= 0"):
            MoCoV3Config(backbone="test_resnet", queue_size=bad)
    queued = queued_model(size=32)
    assert queued.queue.keys.shape == (32, 16)
    assert {k for k in queued.state_dict() if k.startswith("queue.")} == {
        "queue.keys", "queue.instance_ids", "queue.entry_steps", "queue.ptr", "queue.filled"}  # MoCo v2's layout


def test_queue_saves_and_loads_with_its_pointer(tmp_path):
    model = queued_model(size=8)
    model.enqueue(torch.randn(11, 16), torch.arange(11), step=3)  # wraps: pointer 3, full
    model.save_pretrained(tmp_path)
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(tmp_path)
    assert (loaded.queue.pointer, loaded.queue_filled) == (3, 8)
    for name in ("keys", "instance_ids", "entry_steps"):
        assert torch.equal(getattr(loaded.queue, name), getattr(model.queue, name)), name


def test_card_and_count_with_a_queue(tmp_path):
    from pathlib import Path

    from hf_contrast import EncoderCardData

    model = build(queue_size=4096)
    assert negatives_per_anchor(model.config, 32, 4) == 32 * 4 - 1 + 4096
    assert negatives_per_anchor(build(queue_size=4096, gather_distributed=False).config, 32, 4) == 31 + 4096
    card = EncoderCardData.from_model(model, per_device_batch_size=32, world_size=4)
    assert card.negatives == 4223 and card.queue_size == 4096 and card.exclude_same_instance
    text = card.negatives_explanation
    assert "N*W - 1 + K negatives, with K = 4096 queued keys, N = 32 images per device and W = 4" in text
    assert "256 entering per micro-batch" in text and "last 16 micro-batches" in text
    template = Path(__file__).parents[1] / "model_cards" / "encoder_card.md.jinja"
    rendered = str(card.to_model_card(template_path=template))
    assert "| queue | 4096 keys of earlier batches, on top of the in-batch keys" in rendered
    assert "| negatives per anchor | 4223 |" in rendered
    plain = str(EncoderCardData.from_model(build(), per_device_batch_size=32).to_model_card(template_path=template))
    assert "| queue | none: in-batch keys of the momentum encoder |" in plain


def batch_norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def test_sync_batch_norm_converts_both_sides_and_keeps_names_and_the_ema():
    """``sync_batch_norm=True``: every BatchNorm of encoders, projectors and predictor is SyncBatchNorm
    (query and momentum side), the checkpoint keys and the EMA pairs are those of the plain model,
    and on one process (no process group: SyncBatchNorm falls back to BatchNorm) the loss is the same."""
    plain, synced = build(sync_batch_norm=False), build(sync_batch_norm=True)
    assert synced.sync_batch_norm and not plain.sync_batch_norm
    for name in ("encoder", "projector", "predictor", "momentum_encoder", "momentum_projector"):
        norms = batch_norms(getattr(synced, name))
        assert norms and all(isinstance(m, nn.SyncBatchNorm) for m in norms), name
        assert not any(isinstance(m, nn.SyncBatchNorm) for m in getattr(plain, name).modules())
    assert plain.state_dict().keys() == synced.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), synced.state_dict().values(),
                                                 strict=True))
    names = lambda *ms: [n for m in ms for n, _ in m.named_parameters()]  # noqa: E731
    assert names(synced.encoder, synced.projector) == names(synced.momentum_encoder, synced.momentum_projector)
    assert all(not p.requires_grad for p in synced.key_parameters())
    with torch.no_grad():
        for p in synced.query_parameters():
            p.add_(torch.randn_like(p))
    old_k = [p.detach().clone() for p in synced.key_parameters()]
    q = [p.detach().clone() for p in synced.query_parameters()]
    synced.momentum_update(0.9)
    for new, k, qq in zip(synced.key_parameters(), old_k, q, strict=True):
        torch.testing.assert_close(new.double(), k.double() * 0.9 + qq.double() * 0.1, rtol=2.5e-7, atol=1e-7)
    plain, synced = build(sync_batch_norm=False), build(sync_batch_norm=True)
    x1, x2 = views(6)
    assert synced(x1, x2).loss.item() == pytest.approx(plain(x1, x2).loss.item(), rel=1e-6)


def test_sync_batch_norm_none_is_on_only_with_more_than_one_process_on_an_accelerator(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert MoCoV3Config().sync_batch_norm is None  # the default: decided when the model is built
    model = build()  # one process, no process group
    assert not model.sync_batch_norm and not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for every process
    model = build()
    assert model.sync_batch_norm and all(isinstance(m, nn.SyncBatchNorm) for m in batch_norms(model))
    assert model.config.sync_batch_norm is None  # the saved config stays portable
    assert not build(sync_batch_norm=False).sync_batch_norm  # False forces it off
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert not build().sync_batch_norm  # CPU-only processes (gloo): SyncBatchNorm could not run
    assert build(sync_batch_norm=True).sync_batch_norm  # True forces it on


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_sync_batch_norm_validation(bad):
    with pytest.raises(ValueError, match=r"sync_batch_norm.*None \(on with more than one process"):
        MoCoV3Config(backbone="test_resnet", sync_batch_norm=bad)
