"""How many negatives each anchor is contrasted with: the one formula the trainer, the model card,
the planner and the monitors all call."""

from __future__ import annotations


def negatives_per_anchor(config, per_device_batch_size: int | None, world_size: int = 1) -> int | None:
    """Negatives each anchor is contrasted with (MoCo: once the queue is full).

    MoCo: ``queue_size``, whatever the batch. SimCLR: ``2 * N * W - 2`` when the views of all ``W``
    processes are gathered (``config.gather_distributed``), else ``2 * N - 2``, for a per-device
    batch of ``N`` images. MoCo v3: ``N * W - 1``, the in-batch keys of the momentum encoder gathered
    over the ``W`` processes (``N - 1`` without ``config.gather_distributed``), plus ``queue_size`` queued
    keys when ``config.queue_size > 0`` (once the queue is full). Gradient accumulation does not enter:
    the loss is computed inside each micro-batch. ``None`` when the count depends on a batch size that is unknown.

    False-negative cancellation (``config.false_negatives``) takes ``false_negative_top_k`` of them
    per anchor (at most; fewer when a ``false_negative_threshold`` is set). MoCo's (and a MoCo v3
    queue's) same-instance masking removes a data-dependent number more: the trainer logs the measured mean per anchor as
    ``num_negatives``, and the model card shows it next to this count.
    """
    nominal = config.nominal_negatives(per_device_batch_size, world_size)  # each method states its own
    if nominal is None:
        return None
    if getattr(config, "false_negatives", None) is not None:
        nominal = max(nominal - config.false_negative_top_k, 0)
    return nominal
