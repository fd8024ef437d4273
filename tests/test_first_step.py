"""MoCo (v2) never trains a step without negatives: while the queue is empty, the other images' keys of
the step stand in (a straightforward per-query loop is the reference); once it holds keys they stop."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

from hf_contrast import MoCoConfig, MoCoModel

B, K = 6, 16


def moco(**kw) -> MoCoModel:
    torch.manual_seed(0)
    return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=K, key_bn_splits=1, **TINY, **kw)).train()


def views(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 3, 32, 32, generator=g), torch.randn(B, 3, 32, 32, generator=g)


def loop_loss(q, k, t):
    """Per query i: InfoNCE with positive k_i and negatives k_j, j != i (in float64)."""
    q, k = F.normalize(q.double(), dim=1), F.normalize(k.double(), dim=1)
    terms = []
    for i in range(len(q)):
        others = [k[j] for j in range(len(k)) if j != i]
        logits = torch.stack([q[i] @ k[i]] + [q[i] @ o for o in others]) / t
        terms.append(-torch.log_softmax(logits, 0)[0])
    return torch.stack(terms).mean()


@pytest.mark.parametrize("variant", [dict(), dict(exclude_same_instance=False), dict(symmetric_loss=True)])
def test_first_step_contrasts_with_the_other_images_of_the_step(variant):
    m = moco(**variant)
    x1, x2 = views()
    out = m(x1, x2, instance_ids=torch.arange(B))
    assert m.queue_filled == 0 and out.loss > 0.1
    grads = torch.autograd.grad(out.loss, list(m.projector.parameters()))
    assert sum(g.abs().sum() for g in grads) > 0  # step 1 trains
    assert out.num_negatives.item() == B - 1 and out.negative_counts.tolist() == [B - 1] * len(out.logits)
    with torch.no_grad():
        q1, k2 = m._query(x1), m.encode_keys(x2)
        want = loop_loss(q1, k2, m.config.temperature)
        if m.config.symmetric_loss:
            want = (want + loop_loss(m._query(x2), m.encode_keys(x1), m.config.temperature)) / 2
    torch.testing.assert_close(out.loss.double(), want, rtol=1e-5, atol=1e-6)


def test_in_batch_negatives_stop_once_the_queue_holds_keys_and_logits_keep_their_shape():
    m = moco()
    x1, x2 = views()
    first = m(x1, x2, instance_ids=torch.arange(B))
    m.enqueue(first.queue_keys, first.queue_instance_ids)  # B keys: the trainer's enqueue after step 1
    second = m(*views(1), instance_ids=torch.arange(B, 2 * B))
    assert first.logits.shape == second.logits.shape == (B, 1 + K)  # one shape: one compiled graph
    assert torch.isfinite(first.logits[:, 1:]).sum() == B * (B - 1)  # the other images' keys, nothing else
    assert torch.isfinite(second.logits[:, 1:]).sum() == B * B  # the B queued keys only
    assert second.num_negatives.item() == B
    one_key = moco()  # a single queued key is enough to switch them off
    one_key.enqueue(torch.randn(1, 16), torch.tensor([100]))
    assert one_key(x1, x2, instance_ids=torch.arange(B)).num_negatives.item() == 1
    with torch.no_grad():  # evaluation measures the contrast against the queue as it is: no in-batch block
        evaluated = moco().eval()(x1, x2, instance_ids=torch.arange(B))
    assert evaluated.logits.shape == (B, 1 + K) and evaluated.num_negatives.item() == 0 and evaluated.loss.item() == 0


def test_a_queue_smaller_than_the_batch_still_gets_the_other_images():
    torch.manual_seed(0)
    m = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=3, key_bn_splits=1, **TINY)).train()
    out = m(*views(), instance_ids=torch.arange(B))
    assert out.logits.shape == (B, 1 + B) and out.num_negatives.item() == B - 1
    m.enqueue(out.queue_keys[:3], out.queue_instance_ids[:3])
    assert m(*views(1), instance_ids=torch.arange(B, 2 * B)).num_negatives.item() == 3


def test_a_duplicate_image_in_the_batch_is_no_negative_of_itself():
    m = moco()
    ids = torch.tensor([0, 1, 2, 3, 0, 5])  # images 0 and 4 are crops of the same picture
    out = m(*views(), instance_ids=ids)
    assert out.negative_counts.tolist() == [B - 2, B - 1, B - 1, B - 1, B - 2, B - 1]
