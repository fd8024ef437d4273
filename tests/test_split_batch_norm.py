"""Split-BN in one key forward: keys row for row equal to running the key encoder on each
sub-batch separately; equal sub-batches or a clear error; checkpoint names and EMA unchanged."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

from hf_contrast import ContrastiveTrainer, ContrastiveTrainingArguments, MoCoConfig, MoCoModel


def moco(splits, **kw):
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=64, key_bn_splits=splits, projection_batch_norm=True,
                                projection_output_batch_norm=True, **TINY, **kw))


@pytest.mark.parametrize("batch,splits", [(16, 4), (12, 2), (12, 3)])
def test_keys_match_a_per_sub_batch_reference(batch, splits):
    m = moco(splits).train()
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    perm = torch.randperm(batch)  # the permutation encode_keys will draw
    reference = torch.empty(batch, 16)
    stats = []
    for k in range(splits):
        rows = perm[k::splits]
        enc, proj = copy.deepcopy(m.key_encoder), copy.deepcopy(m.key_projector)  # plain BN (num_splits 1)
        with torch.no_grad():
            reference[rows] = F.normalize(proj(enc(x[rows])), dim=1)
        stats.append(enc.bn1.running_mean.clone())
    torch.manual_seed(123)
    keys = m.encode_keys(x)
    torch.testing.assert_close(keys, reference, rtol=1e-5, atol=1e-5)
    # running statistics: the mean over the sub-batches (MoCo's SplitBatchNorm)
    torch.testing.assert_close(m.key_encoder.bn1.running_mean, torch.stack(stats).mean(0), rtol=1e-5, atol=1e-6)
    # and not what one full-batch BatchNorm gives
    plain = copy.deepcopy(m)
    plain.config.key_bn_splits = 1
    assert not torch.allclose(plain.encode_keys(x), keys, atol=1e-3)


@pytest.mark.parametrize("batch", [10, 9, 4])
def test_unequal_or_single_image_sub_batches_are_refused_clearly(batch):
    m = moco(4).train()
    with pytest.raises(ValueError, match=r"key_bn_splits=4 .* batch of " + str(batch)):
        m(torch.randn(batch, 3, 32, 32), torch.randn(batch, 3, 32, 32))


def test_trainer_refuses_a_batch_split_bn_cannot_divide(tmp_path, digits):
    from hf_contrast import TwoViewAugmentation, two_view_dataset

    train = two_view_dataset(digits["train"].select(range(40)), TwoViewAugmentation.small_images(32))
    args = ContrastiveTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=10, use_cpu=True,
                                        report_to="none")
    with pytest.raises(ValueError, match="per_device_train_batch_size=10 .* key_bn_splits=4"):
        ContrastiveTrainer(model=moco(4), args=args, train_dataset=train)


def test_same_state_dict_names_and_ema_as_plain_batch_norm():
    split, plain = moco(4), moco(1)
    assert list(split.state_dict()) == list(plain.state_dict())
    for a, b in zip(split.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    x = torch.randn(6, 3, 32, 32)  # eval: running statistics, the split changes nothing
    torch.testing.assert_close(split.eval().encode_keys(x), plain.eval().encode_keys(x))
    with torch.no_grad():
        for p in split.query_parameters():
            p.add_(1.0)
    before = [p.clone() for p in split.key_parameters()]
    split.momentum_update(0.9)
    for k, k0, q in zip(split.key_parameters(), before, split.query_parameters(), strict=True):
        torch.testing.assert_close(k, 0.9 * k0 + 0.1 * q, rtol=0, atol=1e-6)
