"""The training step for the GPU: no host read of a device value (profiled ``aten::_local_scalar_dense``),
one graph under ``torch.compile`` from the first step on, also while the queue fills, no graph break
(``fullgraph=True``), and a model compiled as Trainer's ``torch_compile=True`` does it (accelerate wraps
the whole model) keeps its parameter names for the EMA and for checkpoints."""

import copy

import pytest
import torch
from conftest import TINY
from torch.profiler import ProfilerActivity, profile

from hf_contrast import MoCoConfig, MoCoModel, MoCoV3Config, MoCoV3Model, SimCLRConfig, SimCLRModel

BATCH, QUEUE = 8, 40  # MoCo v2 fills the queue in 5 steps, MoCo v3 (2 keys per image) in 3


def build(kind):
    torch.manual_seed(0)
    if kind == "moco":  # the default MoCoConfig: split-BN in 4, exclude_same_instance
        return MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=QUEUE, **TINY)).train()
    if kind == "mocov3":
        return MoCoV3Model(MoCoV3Config(backbone="test_resnet", queue_size=QUEUE, **TINY)).train()
    return SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY)).train()


def batch(step):
    g = torch.Generator().manual_seed(step)
    x1, x2 = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randn(BATCH, 3, 32, 32, generator=g)
    return x1, x2, torch.arange(BATCH) + BATCH * (step % 3)  # images come back: same-instance keys get masked


def train_step(model, owner, step):
    """Forward, enqueue (as the trainer: check_finite=False, accept on the device), backward."""
    x1, x2, ids = batch(step)
    kwargs = {} if isinstance(owner, SimCLRModel) else {"instance_ids": ids}
    torch.manual_seed(100 + step)  # the split-BN shuffle
    out = model(x1, x2, **kwargs)
    if out.queue_keys is not None:
        owner.enqueue(out.queue_keys, out.queue_instance_ids, step=step, check_finite=False,
                      accept=torch.isfinite(out.loss))
    out.loss.backward()
    return out


@pytest.mark.parametrize("kind", ["moco", "mocov3", "simclr"])
def test_training_step_reads_nothing_on_the_host(kind):
    model = build(kind)
    train_step(model, model, 0)  # a partly filled queue
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = train_step(model, model, 1)
    reads = [e.cpu_parent.name if e.cpu_parent else None for e in prof.events()
             if e.name == "aten::_local_scalar_dense"]
    assert reads == []
    assert kind == "simclr" or isinstance(out.num_negatives, torch.Tensor)


@pytest.mark.parametrize("kind", ["moco", "mocov3", "simclr"])
def test_compiled_model_makes_no_new_graph_while_the_queue_fills(kind):
    """``fullgraph=True``: a graph break raises. The queue fills and wraps during the 8 steps; the compiled
    model gives the eager model's losses step for step."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    model, eager = build(kind), build(kind)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    graphs = []
    for step in range(8):
        got = train_step(compiled, model, step)
        want = train_step(eager, eager, step)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.as_tensor(got.num_negatives), torch.as_tensor(want.num_negatives))
        graphs.append((counter.frame_count, counter.op_count))
    assert graphs[1:] == [graphs[1]] * 7, graphs  # nothing compiled after the first step
    assert counter.frame_count == 1
    if kind != "simclr":
        assert model.queue.num_filled == QUEUE and int(model.queue.filled) == QUEUE  # filled (and wrapped)
        torch.testing.assert_close(model.queue.keys, eager.queue.keys)


def test_compiled_as_trainer_does_keeps_names_for_ema_and_checkpoints():
    """Trainer's ``torch_compile=True`` hands a ``TorchDynamoPlugin`` to accelerate, whose ``prepare_model``
    wraps the whole model in ``torch.compile``; Trainer keeps the plain model as ``self.model`` (the
    momentum callback's and ``save_pretrained``'s) and ``unwrap_model`` reaches it."""
    from accelerate.utils import TorchDynamoPlugin, extract_model_from_parallel

    model = build("moco")
    names = list(model.state_dict())
    # what Accelerator.prepare_model does with the plugin (the Accelerator itself is a process-wide singleton)
    compiled = torch.compile(model, **TorchDynamoPlugin(backend="eager", fullgraph=True).to_kwargs())
    assert compiled is not model and compiled._orig_mod is model
    unwrap = extract_model_from_parallel  # Accelerator.unwrap_model
    for step in range(2):
        train_step(compiled, unwrap(compiled), step)  # the trainer enqueues on unwrap_model(model)
    plain = unwrap(compiled, keep_torch_compile=False)
    assert plain is model and list(plain.state_dict()) == names  # no "_orig_mod." prefix
    assert all(not n.startswith("_orig_mod.") for n in plain.state_dict())
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.query_parameters():
            p.add_(0.5)
        for p in reference.query_parameters():
            p.add_(0.5)
    unwrap(compiled).momentum_update(0.9)  # through the compiled wrapper's attribute lookup
    reference.momentum_update(0.9)
    for got, want in zip(model.key_parameters(), reference.key_parameters(), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(model.queue.keys, unwrap(compiled).queue.keys)


def test_non_finite_flags_are_read_on_the_device_only():
    from hf_contrast import distributed

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ok = distributed.non_finite_flags(torch.tensor(1.5))
        bad = distributed.non_finite_flags(torch.tensor([1.0, float("nan")]))
        accept = ok.sum() == 0  # what the trainer can pass to enqueue(accept=)
    assert not any(e.name == "aten::_local_scalar_dense" for e in prof.events())
    assert ok.tolist() == [0.0] and bad.tolist() == [1.0] and accept.item() is True
    assert distributed.non_finite_ranks(torch.tensor(float("inf"))) == [0]
