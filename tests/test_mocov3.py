"""MoCo v3: the model's loss against the official ``ctr`` written from the pseudocode, the heads against
the official ``_build_mlp``, the EMA, the negatives, the frozen patch projection."""

import math

import pytest
import torch
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
