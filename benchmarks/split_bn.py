#!/usr/bin/env python
"""Split-BN's cost in MoCo's key forward, side by side in one run: plain BatchNorm (``key_bn_splits=1``),
the old split (``(N, C, ...)`` reshaped to ``(N / S, S * C, ...)`` with repeated weight, bias and running
statistics: a copy in channels_last) and the new one (``var_mean`` over ``x.unflatten(0, (S, N / S))``, one
broadcast ``addcmul``: a view in both layouts), in NCHW and channels_last. Prints the aten op count of one
key forward (all ops, nested ones included, and top-level ones), the largest activation any copy took, and
the best time, with ratios to ``key_bn_splits=1``. ``--compile`` adds eager vs inductor for one MoCo
training step (forward + backward + enqueue; minutes of compilation on a CPU).

    python benchmarks/split_bn.py                                  # test_resnet and resnet18, batch 64 at 32 px
    python benchmarks/split_bn.py --backbones resnet50 --image_size 64 --batch_size 32
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hf_contrast import MoCoConfig, MoCoModel
from hf_contrast.models.split_batch_norm import SplitBatchNorm1d, SplitBatchNorm2d, split_batch_norm


class _LegacySplit:
    """The split-BN forward before issue 21 (interleaved sub-batches through a merged reshape), for comparison."""

    num_splits: int = 1

    def forward(self, x):
        s = self.num_splits
        if s == 1 or not self.training:
            return super().forward(x)
        n, c = x.shape[0], x.shape[1]
        split_mean, split_var = self.running_mean.repeat(s), self.running_var.repeat(s)
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        weight = self.weight.repeat(s) if self.weight is not None else None
        bias = self.bias.repeat(s) if self.bias is not None else None
        y = F.batch_norm(x.reshape(n // s, s * c, *x.shape[2:]), split_mean, split_var, weight, bias, True,
                         momentum, self.eps).reshape(x.shape)
        with torch.no_grad():
            self.running_mean.copy_(split_mean.view(s, c).mean(0))
            self.running_var.copy_(split_var.view(s, c).mean(0))
        return y


class LegacySplitBatchNorm1d(_LegacySplit, SplitBatchNorm1d):
    pass


class LegacySplitBatchNorm2d(_LegacySplit, SplitBatchNorm2d):
    pass


def use_legacy(model: MoCoModel) -> MoCoModel:
    for m in [*model.key_encoder.modules(), *model.key_projector.modules()]:
        if type(m) is SplitBatchNorm2d:
            m.__class__ = LegacySplitBatchNorm2d
        elif type(m) is SplitBatchNorm1d:
            m.__class__ = LegacySplitBatchNorm1d
    return model


def key_forward(model, x, splits):
    with torch.no_grad(), split_batch_norm([model.key_encoder, model.key_projector], splits):
        return model.key_projector(model.key_encoder(x))


def count_ops(model, x, splits):
    key_forward(model, x, splits)  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        key_forward(model, x, splits)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    copies = [math.prod(s) for e in events if e.name in ("aten::copy_", "aten::clone") for s in e.input_shapes if s]
    return len(events), top, max(copies, default=0)


def best_times(runs, repeats):
    """Fastest seconds of each ``(fn, *args)`` (the least disturbed by other load on a shared machine), run in
    interleaved rounds so that load drift hits all alike."""
    times = [[] for _ in runs]
    for _ in range(repeats):
        for i, (fn, *args) in enumerate(runs):
            t = time.perf_counter()
            fn(*args)
            times[i].append(time.perf_counter() - t)
    return [min(t) for t in times]


def compiled_step(backbone, x, steps=6):
    import torch._dynamo

    results = {}
    for name in ("eager", "inductor"):
        torch.manual_seed(0)
        model = MoCoModel(MoCoConfig(backbone=backbone, image_size=x.shape[-1], queue_size=4096)).train()
        run = model if name == "eager" else torch.compile(model)
        torch._dynamo.reset()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            out = run(x, x)
            model.enqueue(out.queue_keys, check_finite=False)
            out.loss.backward()
            times.append(time.perf_counter() - t)
        results[name] = (times[0], statistics.median(times[2:]))
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbones", nargs="+", default=["test_resnet", "resnet18"])
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--splits", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compile", action="store_true", help="also eager vs inductor for one MoCo step (slow on CPU)")
    a = p.parse_args()
    print(f"batch {a.batch_size} at {a.image_size}x{a.image_size}, key_bn_splits={a.splits}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, best of {a.repeats}")
    print(f"{'backbone':<12}{'layout':<15}{'variant':<12}{'aten ops':>9}{'top-level':>10}{'largest copy':>13}"
          f"{'ms':>8}{'ops/1':>7}{'time/1':>8}")
    for backbone in a.backbones:
        torch.manual_seed(0)
        x = torch.randn(a.batch_size, 3, a.image_size, a.image_size)
        base = MoCoModel(MoCoConfig(backbone=backbone, image_size=a.image_size, queue_size=16,
                                    key_bn_splits=a.splits)).train()
        for layout in (torch.contiguous_format, torch.channels_last):
            xl = x.contiguous(memory_format=layout)
            plain, new = copy.deepcopy(base).to(memory_format=layout), copy.deepcopy(base).to(memory_format=layout)
            old = use_legacy(copy.deepcopy(new))
            variants = {"splits=1": (plain, 1), "old": (old, a.splits), "new": (new, a.splits)}
            counts = {name: count_ops(m, xl, s) for name, (m, s) in variants.items()}
            times = best_times([(key_forward, m, xl, s) for m, s in variants.values()], a.repeats)
            (ref_ops, _, _), ref_time = counts["splits=1"], times[0]
            for (name, (ops, top, largest)), med in zip(counts.items(), times, strict=True):
                print(f"{backbone:<12}{str(layout).split('.')[-1]:<15}{name:<12}{ops:>9}{top:>10}{largest:>13}"
                      f"{med * 1e3:>8.2f}{ops / ref_ops:>7.2f}{med / ref_time:>8.2f}")
        if a.compile:
            res = compiled_step(backbone, x)
            (_, e), (c0, c) = res["eager"], res["inductor"]
            print(f"{backbone}: MoCo step eager {e * 1e3:.1f} ms, inductor {c * 1e3:.1f} ms (first call {c0:.1f} s): "
                  f"compiled / eager = {c / e:.2f}")


if __name__ == "__main__":
    main()
