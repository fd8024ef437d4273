"""Queue or batch: the planner's formulas. From a backbone's measured activation memory per view
(:func:`hf_contrast.memory_probe.probe_activation_memory`), the memory per device and the negatives per anchor
of SimCLR (plain, gathered over the processes, gradient-cached) and MoCo on a cluster (:func:`plan`, with the
recommendation and its reason), and the prediction for one training step (:func:`predict_step`, what
``torch.cuda.max_memory_allocated`` should report). ``training/plan.py`` prints them.

Parameters, gradients and optimizer state are counted in fp32 (SGD/LARS momentum: 12 bytes per parameter;
AdamW: 16), and so are the input images of a step; ``amp`` halves the activations (an approximation, not
measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .memory_probe import ActivationProbe, training_state_bytes

LOSS_COPIES = 4  # fp32 (2N, 2M) logits matrices the NT-Xent loss holds at its peak (measured: 3.5 to 4.3)
CACHED_STEP_TIME = 4 / 3  # one extra forward without grad, about a third of a forward + backward
GIB = 2**30
MIB = 2**20


def logits_bytes(anchors: int, candidates: int) -> float:
    """One fp32 ``(anchors, candidates)`` logits matrix."""
    return 4.0 * anchors * candidates


def input_bytes(probe: ActivationProbe, views: int) -> float:
    """Input images ``(views, 3, H, W)`` in fp32."""
    return 4.0 * views * 3 * probe.image_size**2


def simclr_activation_bytes(probe: ActivationProbe, images: int, world: int = 1, amp: bool = False) -> float:
    """Activations and NT-Xent buffers of SimCLR with ``images`` per device, gathered over ``world``."""
    per_view = probe.per_view_bytes * (0.5 if amp else 1.0)
    return 2 * images * per_view + LOSS_COPIES * logits_bytes(2 * images, 2 * images * world)


def cached_kept_bytes(images: int, world: int, embedding_dim: int) -> float:
    """What gradient-cached SimCLR keeps alive during pass 2: the fp32 logits and the ``(2N, D)``
    embedding cache with its gradient."""
    embeddings = 2 * 2 * images * embedding_dim * 4.0
    return logits_bytes(2 * images, 2 * images * world) + embeddings


def cached_activation_bytes(
    probe: ActivationProbe, images: int, chunk: int, world: int = 1, embedding_dim: int = 128, amp: bool = False
) -> float:
    """Peak activations of gradient-cached SimCLR: the larger of the loss's buffers and one chunk's
    activations (``2 * chunk`` views), on top of what pass 2 keeps alive."""
    per_view = probe.per_view_bytes * (0.5 if amp else 1.0)
    loss_peak = LOSS_COPIES * logits_bytes(2 * images, 2 * images * world)
    return max(loss_peak, 2 * chunk * per_view) + cached_kept_bytes(images, world, embedding_dim)


def moco_activation_bytes(probe: ActivationProbe, batch: int, queue_size: int, amp: bool = False) -> float:
    """Activations of MoCo's query forward over ``batch`` views and the ``(B, 1 + K)`` loss buffers
    (the key encoder's no-grad forward is not counted)."""
    per_view = probe.per_view_bytes * (0.5 if amp else 1.0)
    return batch * per_view + LOSS_COPIES * logits_bytes(batch, 1 + queue_size)


@dataclass
class MethodPlan:
    """One method's requirement per device.

    Attributes:
        name: the method as printed.
        batch_per_device: images per device per step (one micro-batch).
        negatives: negatives per anchor.
        activation_bytes: activations and loss buffers at the step's peak.
        input_bytes: the step's input images (fp32), resident on the device for the whole step.
        state_bytes: parameters + gradients + optimizer state of the trained encoder and head.
        extra_bytes: MoCo's queue and key encoder; 0 for SimCLR.
        chunk: images per gradient-cache chunk (cached SimCLR only).
        note: what else to know (step time, BatchNorm, global batch).
    """

    name: str
    batch_per_device: int
    negatives: int
    activation_bytes: float
    input_bytes: float
    state_bytes: float
    extra_bytes: float = 0.0
    chunk: int | None = None
    note: str = ""

    @property
    def total_bytes(self) -> float:
        return self.activation_bytes + self.input_bytes + self.state_bytes + self.extra_bytes


def plan(
    probe: ActivationProbe,
    *,
    num_devices: int,
    device_memory_bytes: float,
    target_negatives: int,
    queue_size: int | None = None,
    embedding_dim: int = 128,
    moco_batch_size: int = 256,
    optimizer: str = "sgd",
    amp: bool = False,
    usable_fraction: float = 0.9,
    max_global_batch: int = 8192,
) -> tuple[list[MethodPlan], str, str]:
    """Memory per device of each method and the recommendation.

    Args:
        probe: the backbone's measured activation memory per view.
        num_devices: devices (processes) W.
        device_memory_bytes: memory of one device.
        target_negatives: negatives per anchor wanted (K).
        queue_size: MoCo's queue length; defaults to ``target_negatives``.
        embedding_dim: embedding size D (queue width).
        moco_batch_size: MoCo's global batch (256 in MoCo v2).
        optimizer: ``"sgd"``, ``"lars"`` or ``"adamw"`` (optimizer state per parameter).
        amp: bf16/fp16 autocast: activations taken as half the measured fp32 ones.
        usable_fraction: share of the device memory a plan may use.
        max_global_batch: largest global SimCLR batch considered trainable (8192: SimCLR's largest,
            with LARS).

    Returns:
        ``(plans, recommended method name, reason)``.
    """
    w, k = num_devices, target_negatives
    queue_size = queue_size or k
    usable = usable_fraction * device_memory_bytes
    per_view = probe.per_view_bytes * (0.5 if amp else 1.0)
    state = training_state_bytes(probe.num_params, optimizer)

    n_local = math.ceil((k + 2) / 2)  # per device: 2N - 2 >= K
    n_gathered = math.ceil((k + 2) / (2 * w))  # gathered: 2 N W - 2 >= K
    global_batch = n_gathered * w
    plain = MethodPlan(
        "SimCLR, per device (no gather)",
        n_local,
        2 * n_local - 2,
        simclr_activation_bytes(probe, n_local, 1, amp),
        input_bytes(probe, 2 * n_local),
        state,
        note="negatives from this device only",
    )
    gathered = MethodPlan(
        f"SimCLR, gathered over {w}",
        n_gathered,
        2 * global_batch - 2,
        simclr_activation_bytes(probe, n_gathered, w, amp),
        input_bytes(probe, 2 * n_gathered),
        state,
        note=f"global batch {global_batch:,}",
    )
    kept = cached_kept_bytes(n_gathered, w, embedding_dim)
    room = usable - state - kept - input_bytes(probe, 2 * n_gathered)
    chunk = max(1, min(n_gathered, 2 ** int(math.log2(max(room / (2 * per_view), 1)))))  # a power of 2
    cached = MethodPlan(
        "SimCLR, gathered + grad cache",
        n_gathered,
        2 * global_batch - 2,
        cached_activation_bytes(probe, n_gathered, chunk, w, embedding_dim, amp),
        input_bytes(probe, 2 * n_gathered),
        state,
        chunk=chunk,
        note=f"global batch {global_batch:,}; step ~{CACHED_STEP_TIME:.2f}x gathered; BN sees chunks",
    )
    b = math.ceil(moco_batch_size / w)
    key_encoder = probe.num_params * 4.0
    queue = queue_size * embedding_dim * 4.0
    moco = MethodPlan(
        f"MoCo (queue {queue_size:,}, dim {embedding_dim})",
        b,
        queue_size,
        moco_activation_bytes(probe, b, queue_size, amp),
        input_bytes(probe, 2 * b),
        state,
        key_encoder + queue,
        note=f"global batch {b * w:,}; key encoder {key_encoder / GIB:.2f} GiB; queue {queue / MIB:.0f} MiB",
    )
    plans = [plain, gathered, cached, moco]

    fits = {p.name: p.total_bytes <= usable for p in plans}
    moco_gib, gathered_gib, cached_gib = (p.total_bytes / GIB for p in (moco, gathered, cached))
    if global_batch > max_global_batch and fits[moco.name]:
        reason = (
            f"{k:,} in-batch negatives need a global SimCLR batch of {global_batch:,} images, beyond the "
            f"{max_global_batch:,} of SimCLR's largest (LARS) runs: few optimizer steps per epoch and a hard "
            f"large-batch optimisation, whatever the memory. MoCo's queue gives {queue_size:,} negatives "
            f"at a global batch of {b * w:,} with {moco_gib:.1f} GiB per device, for one extra forward "
            "(the key encoder's)."
        )
        return plans, moco.name, reason
    if fits[gathered.name]:
        reason = (
            f"the global batch of {global_batch:,} images fits ({gathered_gib:.1f} GiB per device): exact, "
            "fresh in-batch negatives with no key encoder, no queue staleness and no extra forward."
        )
        return plans, gathered.name, reason
    if fits[cached.name]:
        reason = (
            f"the gathered batch needs {gathered_gib:.1f} GiB per device; gradient caching with chunks of "
            f"{chunk} images gives the same {gathered.negatives:,} negatives in {cached_gib:.1f} GiB for "
            "about "
            f"{CACHED_STEP_TIME:.2f}x the step time. Exact gradients need a model without BatchNorm."
        )
        return plans, cached.name, reason
    if fits[moco.name]:
        reason = (
            f"even one gradient-cache chunk does not fit beside the {gathered.negatives:,}-view loss; MoCo's "
            f"queue decouples negatives from the batch ({moco_gib:.1f} GiB per device)."
        )
        return plans, moco.name, reason
    return plans, "none", "nothing fits: use a smaller backbone or image size, fewer negatives, or --amp."


STEP_METHODS = ("moco", "simclr", "simclr_cached")


def predict_step(
    probe: ActivationProbe,
    method: str,
    batch: int,
    *,
    chunk: int | None = None,
    queue_size: int = 65536,
    embedding_dim: int = 128,
    optimizer: str = "sgd",
    amp: bool = False,
) -> MethodPlan:
    """The planner's prediction for ONE training step on one device, with the same formulas as
    :func:`plan`: what ``torch.cuda.max_memory_allocated`` should report over it (``.total_bytes``).

    Args:
        probe: the backbone's measured activation memory per view.
        method: ``"moco"``, ``"simclr"`` (plain) or ``"simclr_cached"`` (gradient cache).
        batch: images per step (each gives two views).
        chunk: images per gradient-cache chunk (``"simclr_cached"`` only).
        queue_size: MoCo's queue length.
        embedding_dim: embedding size D.
        optimizer: ``"sgd"``, ``"lars"`` or ``"adamw"``.
        amp: activations taken as half the measured fp32 ones.
    """
    if method not in STEP_METHODS:
        raise ValueError(f"method={method!r} is invalid: method must be one of {STEP_METHODS}")
    if method == "simclr_cached" and not chunk:
        raise ValueError("chunk=None is invalid for method='simclr_cached': chunk must be an integer >= 1")
    state = training_state_bytes(probe.num_params, optimizer)
    inputs = input_bytes(probe, 2 * batch)
    if method == "moco":
        extra = probe.num_params * 4.0 + queue_size * embedding_dim * 4.0  # key encoder + queue
        acts = moco_activation_bytes(probe, batch, queue_size, amp)
        return MethodPlan("MoCo", batch, queue_size, acts, inputs, state, extra)
    if method == "simclr":
        acts = simclr_activation_bytes(probe, batch, 1, amp)
        return MethodPlan("SimCLR", batch, 2 * batch - 2, acts, inputs, state)
    acts = cached_activation_bytes(probe, batch, chunk, 1, embedding_dim, amp)
    return MethodPlan("SimCLR, grad cache", batch, 2 * batch - 2, acts, inputs, state, chunk=chunk)
