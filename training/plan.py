#!/usr/bin/env python
"""Queue or batch? Memory per device and negatives per anchor of SimCLR (plain, gathered, gradient-cached)
and MoCo for one backbone on one cluster, from a short measured probe of the real backbone.

    python training/plan.py --backbone resnet50 --image_size 224 --device_memory_gb 80 --num_devices 8 \\
        --target_negatives 65536
    python training/plan.py --backbone vit_small_patch16_224 --image_size 224 --device_memory_gb 24 \\
        --num_devices 4 --target_negatives 8190 --amp

The activation memory per view is measured (``hf_contrast.memory_probe``: timm model, pretrained=False,
plus the SimCLR head, fp32, forward + backward at two small batches on this machine's CPU or GPU) and
scaled linearly to the batch each method needs. Parameters, gradients and optimizer state are counted
in fp32 (SGD/LARS momentum: 12 bytes per parameter; AdamW: 16), and so are the input images of a
step. ``--amp`` halves the activations (an approximation, not measured). Memory per device is what
the allocator holds at the peak of a step; leave room for the framework (``--usable_fraction``, 0.9).
The formulas are :mod:`hf_contrast.planner`'s; this script parses the flags and prints the table.
"""

from __future__ import annotations

import argparse

from hf_contrast.memory_probe import ActivationProbe, probe_activation_memory
from hf_contrast.models.corpus import false_negative_estimate
from hf_contrast.planner import (  # noqa: F401 - the formulas re-exported (tests, benchmarks/gpu_check.py)
    GIB,
    MethodPlan,
    input_bytes,
    plan,
    predict_step,
    simclr_activation_bytes,
)


def format_plan(
    probe: ActivationProbe,
    plans: list[MethodPlan],
    choice: str,
    reason: str,
    *,
    num_devices: int,
    device_memory_bytes: float,
    target_negatives: int,
    optimizer: str,
    amp: bool,
    usable_fraction: float,
) -> str:
    """The plan as a printable table with the recommendation under it."""
    usable = usable_fraction * device_memory_bytes
    scaled = ", scaled by pixels" if probe.probe_image_size != probe.image_size else ""
    activations = "x0.5 for autocast (assumed)" if amp else "fp32"
    lines = [
        f"{probe.backbone} at {probe.image_size} px, {num_devices} devices x "
        f"{device_memory_bytes / 1e9:.0f} GB ({usable / GIB:.1f} GiB usable), "
        f"target {target_negatives:,} negatives per anchor",
        f"probe: {probe.per_view_bytes / 2**20:.1f} MiB of fp32 activations per view (measured at "
        f"{probe.probe_image_size} px, {probe.probe_views[0]} and {probe.probe_views[1]} views{scaled}), "
        f"{probe.num_params / 1e6:.1f} M parameters with the head; {optimizer} state; "
        f"activations {activations}",
        "",
        f"{'method':<34}{'batch/dev':>13}{'negatives':>11}{'inputs':>9}{'activations':>13}{'params+opt':>12}"
        f"{'queue+key':>11}{'total/dev':>11}  fits",
    ]
    for p in plans:
        batch = f"{p.batch_per_device:,}" + (f" ({p.chunk})" if p.chunk else "")
        sizes = (p.input_bytes, p.activation_bytes, p.state_bytes, p.extra_bytes, p.total_bytes)
        gib = [f"{x / GIB:.{2 if x < 10 * GIB else 1}f} G" for x in sizes]
        fits = "yes" if p.total_bytes <= usable else "no"
        lines.append(
            f"{p.name:<34}{batch:>13}{p.negatives:>11,}{gib[0]:>9}{gib[1]:>13}{gib[2]:>12}{gib[3]:>11}"
            f"{gib[4]:>11}  {fits}"
        )
    lines += ["", "GiB per device; batch/dev in images (the cached row: per step (per chunk))"]
    lines += [f"  {p.name}: {p.note}" for p in plans if p.note]
    lines += ["", f"Recommendation: {choice}", f"Reason: {reason}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # --num_dev 2 is an error naming the flag, not --num_devices
    p.add_argument("--backbone", default="resnet50", help="timm architecture name")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument(
        "--device_memory_gb", type=float, default=80.0, help="memory of one device, GB (1e9 bytes)"
    )
    p.add_argument("--num_devices", type=int, default=8)
    p.add_argument("--target_negatives", type=int, default=65536, help="negatives per anchor wanted")
    p.add_argument("--queue_size", type=int, default=None, help="MoCo queue length (default: the target)")
    p.add_argument("--embedding_dim", type=int, default=128)
    p.add_argument("--moco_batch_size", type=int, default=256, help="MoCo global batch (MoCo v2: 256)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "lars", "adamw"])
    p.add_argument("--amp", action="store_true", help="bf16/fp16 autocast: halve the activations (assumed)")
    p.add_argument("--usable_fraction", type=float, default=0.9, help="share of device memory a plan may use")
    p.add_argument(
        "--max_global_batch", type=int, default=8192, help="largest global SimCLR batch considered"
    )
    p.add_argument("--probe_image_size", type=int, default=None, help="probe smaller images, scale by pixels")
    p.add_argument("--probe_views", type=int, default=2, help="first probe batch (views)")
    p.add_argument("--dataset_size", type=int, default=None, help="training images: adds the false-negative estimate")
    p.add_argument("--num_classes", type=int, default=None, help="classes of the corpus, for the same-class estimate")
    a = p.parse_args(argv)
    for name in (
        "image_size",
        "num_devices",
        "target_negatives",
        "embedding_dim",
        "moco_batch_size",
        "probe_views",
    ):
        if getattr(a, name) < 1:
            p.error(f"--{name}={getattr(a, name)} is invalid: --{name} must be an integer >= 1")
    if not 0 < a.usable_fraction <= 1:
        p.error(f"--usable_fraction={a.usable_fraction} is invalid: --usable_fraction must be in (0, 1]")
    probe = probe_activation_memory(
        a.backbone, a.image_size, views=max(a.probe_views, 2), probe_image_size=a.probe_image_size
    )
    memory = a.device_memory_gb * 1e9
    plans, choice, reason = plan(
        probe,
        num_devices=a.num_devices,
        device_memory_bytes=memory,
        target_negatives=a.target_negatives,
        queue_size=a.queue_size,
        embedding_dim=a.embedding_dim,
        moco_batch_size=a.moco_batch_size,
        optimizer=a.optimizer,
        amp=a.amp,
        usable_fraction=a.usable_fraction,
        max_global_batch=a.max_global_batch,
    )
    text = format_plan(
        probe,
        plans,
        choice,
        reason,
        num_devices=a.num_devices,
        device_memory_bytes=memory,
        target_negatives=a.target_negatives,
        optimizer=a.optimizer,
        amp=a.amp,
        usable_fraction=a.usable_fraction,
    )
    if a.dataset_size is not None:
        if a.dataset_size < 1:
            p.error(f"--dataset_size={a.dataset_size} is invalid: --dataset_size must be an integer >= 1")
        text += "\n\n" + false_negative_lines(a.queue_size or a.target_negatives, a.target_negatives,
                                              a.dataset_size, a.num_classes)
    print(text)
    return text


def false_negative_lines(queue_size: int, simclr_pool: int, dataset_size: int, num_classes: int | None) -> str:
    """The expected false negatives of the MoCo queue and the SimCLR pool on this corpus."""
    moco = false_negative_estimate(queue_size, dataset_size, num_classes, queued=True)
    simclr = false_negative_estimate(simclr_pool, dataset_size, num_classes, queued=False)
    lines = ["False negatives (hf_contrast.models.corpus):", f"  MoCo queue: {moco.describe()}",
             f"  SimCLR in-batch: {simclr.describe()}"]
    lines.append(f"  Suggested queue size: {moco.suggested_pool:,} (own-image probability <= "
                 f"{moco.own_image_budget:.0%}; the same-class share, 1/C of the negatives, does not depend on it)")
    if moco.fraction >= 0.1:
        lines.append("  The queue is a large fraction of the corpus: keep exclude_same_instance=True and consider "
                     f"false_negatives='eliminate' or a smaller queue (queue_size={moco.suggested_pool}).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
