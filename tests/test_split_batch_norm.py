"""Split-BN in one key forward: keys row for row equal to running the key encoder on each
sub-batch separately; one layer equal to MoCo's per-chunk F.batch_norm in NCHW and channels_last;
no copy of the activation, no graph break under torch.compile; equal sub-batches or a clear error;
checkpoint names and EMA unchanged."""

import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hf_contrast import ContrastiveTrainer, ContrastiveTrainingArguments, MoCoConfig, MoCoModel
from hf_contrast.models import split_batch_norm as split_batch_norm_module
from hf_contrast.models.split_batch_norm import SplitBatchNorm1d, SplitBatchNorm2d, split_batch_norm


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
    size = batch // splits
    for k in range(splits):
        rows = perm[k * size : (k + 1) * size]  # contiguous sub-batches of the shuffled batch
        enc, proj = copy.deepcopy(m.key_encoder), copy.deepcopy(m.key_projector)  # plain BN (num_splits 1)
        with torch.no_grad():
            reference[rows] = F.normalize(proj(enc(x[rows])), dim=1)
        stats.append(enc.bn1.running_mean.clone())
    torch.manual_seed(123)
    keys = m.encode_keys(x)
    torch.testing.assert_close(keys, reference, rtol=1e-5, atol=2e-5)  # fp32 summation order (4-image sub-batches)
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


class ReferenceSplitBatchNorm(nn.BatchNorm2d):
    """MoCo's ``SplitBatchNorm`` (facebookresearch/moco colab demo) as plain ``F.batch_norm`` per contiguous
    chunk: each chunk starts from the same running statistics, which then become the mean over chunks."""

    def __init__(self, num_features, num_splits, **kw):
        super().__init__(num_features, **kw)
        self.num_splits = num_splits

    def forward(self, x):
        chunks, means, variances = [], [], []
        momentum = self.momentum
        if self.track_running_stats:
            self.num_batches_tracked += 1
            if momentum is None:
                momentum = 1.0 / self.num_batches_tracked.item()
        for chunk in x.chunk(self.num_splits):
            rm = self.running_mean.clone() if self.track_running_stats else None
            rv = self.running_var.clone() if self.track_running_stats else None
            chunks.append(F.batch_norm(chunk, rm, rv, self.weight, self.bias, True, momentum or 0.0, self.eps))
            means.append(rm)
            variances.append(rv)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.copy_(torch.stack(means).mean(0))
                self.running_var.copy_(torch.stack(variances).mean(0))
        return torch.cat(chunks)


@pytest.mark.parametrize("two_pass", [True, False], ids=["two-pass (CPU)", "var_mean (GPU)"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("momentum,affine,track", [(0.1, True, True), (None, True, True), (0.3, False, True),
                                                   (0.1, True, False)])
def test_layer_equals_per_chunk_batch_norm(layout, momentum, affine, track, two_pass, monkeypatch):
    monkeypatch.setattr(split_batch_norm_module, "TWO_PASS_DEVICES", {"cpu"} if two_pass else set())
    kw = dict(momentum=momentum, affine=affine, track_running_stats=track)
    ref, new = ReferenceSplitBatchNorm(6, 4, **kw), SplitBatchNorm2d(6, **kw)
    new.num_splits = 4
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 2.0)
            ref.bias.uniform_(-1.0, 1.0)
    if track:
        ref.running_mean.uniform_(-1, 1)
        ref.running_var.uniform_(0.5, 2.0)
    new.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # the running statistics follow over steps (momentum=None: cumulative average)
        x = (torch.randn(16, 6, 5, 7, generator=g) * 3 + 1).contiguous(memory_format=layout)
        xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, yn = ref(xr), new(xn)
        torch.testing.assert_close(yn, yr, rtol=1e-5, atol=1e-5)
        assert yn.is_contiguous(memory_format=layout)  # the layout is kept
        grad = torch.randn(yr.shape, generator=g)
        yr.backward(grad)
        yn.backward(grad)
        torch.testing.assert_close(xn.grad, xr.grad, rtol=1e-4, atol=1e-5)
        if affine:
            torch.testing.assert_close(new.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(new.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-4)
            ref.zero_grad(), new.zero_grad()
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(dict(new.named_buffers())[name], buf, rtol=1e-5, atol=1e-6)


def test_batch_norm_1d_equals_per_chunk_batch_norm():
    new = SplitBatchNorm1d(5)
    new.num_splits = 3
    ref = copy.deepcopy(new)
    x = torch.randn(12, 5) * 2 + 0.5
    want = torch.cat([F.batch_norm(c, None, None, ref.weight, ref.bias, True, 0.0, ref.eps) for c in x.chunk(3)])
    torch.testing.assert_close(new(x), want, rtol=1e-5, atol=1e-5)
    rm = torch.stack([0.9 * ref.running_mean + 0.1 * c.mean(0) for c in x.chunk(3)]).mean(0)
    rv = torch.stack([0.9 * ref.running_var + 0.1 * c.var(0) for c in x.chunk(3)]).mean(0)  # unbiased
    torch.testing.assert_close(new.running_mean, rm)
    torch.testing.assert_close(new.running_var, rv)


def key_forward_ops(splits):
    """aten ops in test_resnet's key forward (encoder + projector) at 16 images (all, nested too), and the
    largest tensor (numel) any copy-like op took."""
    m = moco(splits).train()
    x = torch.randn(16, 3, 32, 32)
    with (torch.no_grad(), split_batch_norm([m.key_encoder, m.key_projector], splits),
          profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof):
        m.key_projector(m.key_encoder(x))
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    copies = [math.prod(shape) for e in events if e.name in ("aten::copy_", "aten::clone", "aten::contiguous")
              for shape in e.input_shapes if shape]
    return collections.Counter(e.name for e in events), max(copies, default=0)


def test_split_forward_copies_nothing_and_repeats_nothing():
    """The old reshape to (N / S, S * C, ...) copied in channels_last and repeated weight, bias and running
    statistics in every layer; now: no copy, no repeat, no cat, and no scalar read."""
    (ops, largest_copy), (_, plain_copy) = key_forward_ops(4), key_forward_ops(1)
    for name in ("aten::repeat", "aten::cat", "aten::_local_scalar_dense", "aten::native_batch_norm"):
        assert ops[name] == 0, (name, ops[name])
    assert largest_copy <= max(plain_copy, 1)  # only 0-d Python scalars are wrapped: no activation is copied


def test_channels_last_key_encoder_gives_the_keys_of_nchw():
    m = moco(4).train()
    x = torch.randn(16, 3, 32, 32)
    cl = copy.deepcopy(m).to(memory_format=torch.channels_last)
    torch.manual_seed(5)
    want = m.encode_keys(x)
    seen = []
    hook = cl.key_encoder.layer1.register_forward_hook(
        lambda mod, inp, out: seen.append(out.is_contiguous(memory_format=torch.channels_last)))
    torch.manual_seed(5)
    keys = cl.encode_keys(x.contiguous(memory_format=torch.channels_last))
    hook.remove()
    assert seen == [True]  # split-BN kept the layout through the encoder
    torch.testing.assert_close(keys, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cl.key_encoder.bn1.running_var, m.key_encoder.bn1.running_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_key_encoder_with_split_bn_compiles_without_graph_breaks(backend):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    m = moco(4).train()
    reference = copy.deepcopy(m)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(m.encode_keys, backend=counter, fullgraph=True)  # fullgraph: a break raises
    for seed in range(3):
        x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        want = reference.encode_keys(x)
        torch.manual_seed(seed)
        got = compiled(x)
        if backend == "eager":  # inductor draws its own randperm stream: compare the statistics below
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1
    torch.testing.assert_close(m.key_encoder.bn1.num_batches_tracked, reference.key_encoder.bn1.num_batches_tracked)
