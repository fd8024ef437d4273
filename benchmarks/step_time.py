#!/usr/bin/env python
"""Median step time of a supervised, a MoCo and a SimCLR training step, side by side in one run.

Same backbone, batch and optimizer for all three; each step is forward + backward + optimizer
step (+ enqueue and EMA for MoCo). Printed as ratios to the supervised step next to their floors:
MoCo 4/3 (one extra forward of the key encoder, a forward costing about 1/3 of forward+backward),
SimCLR 2 (two views forward and backward). Targets: MoCo <= 1.40, SimCLR <= 2.10, and MoCo with
one-process split-BN (``key_bn_splits=4``, MoCoConfig's default) within 3% of MoCo without it: the
split is a view inside each BatchNorm of ONE key forward (statistics over ``x.unflatten(0, (S, N / S))``),
not a forward per sub-batch. ``benchmarks/split_bn.py`` compares that key forward alone, old and new.

    python benchmarks/step_time.py                      # resnet18, 256 images at 32x32
    python benchmarks/step_time.py --backbone resnet50 --image_size 64 --batch_size 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from hf_contrast import MoCoConfig, MoCoModel, SimCLRConfig, SimCLRModel


def supervised_step(model, head, opt, x, y):
    loss = F.cross_entropy(head(model(x)), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def moco_step(model, opt, x1, x2):
    out = model(x1, x2)
    out.loss.backward()
    model.enqueue(out.queue_keys, check_finite=False, accept=torch.isfinite(out.loss))  # as the trainer: no sync
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.momentum_update(0.99)


def simclr_step(model, opt, x1, x2):
    model(x1, x2).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default="resnet18")
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--queue_size", type=int, default=4096,
                   help="4096: MoCo CIFAR setting. At 32 px a 65536-key queue costs a third of the backbone in matmuls")
    p.add_argument("--key_bn_splits", type=int, default=1, help="split-BN of the plain 'moco' row")
    p.add_argument("--split_bn_splits", type=int, default=4, help="split-BN of the 'moco_split' row (the default)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; each round runs the three steps once")
    a = p.parse_args()
    torch.manual_seed(0)
    x1 = torch.randn(a.batch_size, 3, a.image_size, a.image_size)
    x2 = torch.randn_like(x1)
    y = torch.randint(0, 10, (a.batch_size,))
    common = dict(backbone=a.backbone, image_size=a.image_size)

    sup = timm.create_model(a.backbone, pretrained=False, num_classes=0)
    head = torch.nn.Linear(sup.num_features, 10)
    moco = MoCoModel(MoCoConfig(queue_size=a.queue_size, key_bn_splits=a.key_bn_splits, **common))
    moco.enqueue(F.normalize(torch.randn(a.queue_size, moco.config.projection_dim), dim=1))  # a full queue
    torch.manual_seed(0)
    split = MoCoModel(MoCoConfig(queue_size=a.queue_size, key_bn_splits=a.split_bn_splits, **common))
    split.enqueue(moco.queue.keys.clone())
    simclr = SimCLRModel(SimCLRConfig(**common))
    sgd = lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # noqa: E731
    steps = {
        "supervised": (supervised_step, (sup, head, sgd([*sup.parameters(), *head.parameters()]), x1, y)),
        "moco": (moco_step, (moco, sgd(moco.query_parameters()), x1, x2)),
        "moco_split": (moco_step, (split, sgd(split.query_parameters()), x1, x2)),
        "simclr": (simclr_step, (simclr, sgd(simclr.parameters()), x1, x2)),
    }
    times = {name: [] for name in steps}
    for round_ in range(a.repeats + 1):  # round 0 warms up
        for name, (fn, fn_args) in steps.items():  # interleaved, so drift hits all three alike
            t = time.perf_counter()
            fn(*fn_args)
            if round_:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["supervised"])
    floors = {"supervised": 1.0, "moco": 4 / 3, "moco_split": 4 / 3, "simclr": 2.0}
    targets = {"supervised": None, "moco": 1.40, "moco_split": 1.40, "simclr": 2.10}
    print(f"{a.backbone}, batch {a.batch_size} at {a.image_size}x{a.image_size}, queue {a.queue_size}, "
          f"{torch.get_num_threads()} threads, median of {a.repeats}")
    print(f"{'step':<11}{'median s':>10}{'ratio':>8}{'floor':>8}{'target':>8}")
    for name in steps:
        med = statistics.median(times[name])
        target = f"{targets[name]:.2f}" if targets[name] else "-"
        print(f"{name:<11}{med:>10.3f}{med / base:>8.2f}{floors[name]:>8.2f}{target:>8}")
    ratio = statistics.median(times["moco_split"]) / statistics.median(times["moco"])
    print(f"moco_split (key_bn_splits={a.split_bn_splits}) / moco (key_bn_splits={a.key_bn_splits}): {ratio:.3f} "
          "(target <= 1.03)")


if __name__ == "__main__":
    main()
