"""The momentum (EMA) key encoder update and its schedules (the queue is hf_contrast.models.queue.NegativeQueue)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def momentum_at(step: int, total_steps: int, base: float, schedule: str = "constant") -> float:
    """The EMA coefficient for optimizer step ``step`` (0-based) of ``total_steps``.

    ``constant`` returns ``base`` (MoCo v1/v2). ``cosine`` rises from ``base`` at step 0 to 1.0 at
    the end: ``1 - (1 - base) * (cos(pi * step / total_steps) + 1) / 2`` (BYOL, MoCo v3).
    """
    if schedule == "constant":
        return base
    if schedule == "cosine":
        progress = min(max(step / max(total_steps, 1), 0.0), 1.0)
        return 1.0 - (1.0 - base) * (math.cos(math.pi * progress) + 1.0) / 2.0
    raise ValueError(f"momentum_schedule={schedule!r} is invalid: it must be one of ('constant', 'cosine').")


_registrations = [0]  # how many parameters any nn.Module has registered: a new tensor behind a name


def _count_registration(module, name, param) -> None:
    _registrations[0] += 1


# from_pretrained, load_state_dict(assign=True) and a new submodule all set parameters through
# register_parameter; in-place loads, .to() and the optimizer keep the same tensors
torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def _check_pairs(target: list[torch.Tensor], source: list[torch.Tensor]) -> None:
    if len(target) != len(source):
        raise ValueError(f"EMA needs matching parameter lists, got {len(target)} and {len(source)} tensors")
    low = sorted({str(t.dtype) for t in target if t.dtype not in (torch.float32, torch.float64)})
    if low:
        raise ValueError(
            f"The EMA target holds {', '.join(low)} parameters; it must be float32 (or float64). In bfloat16, "
            f"theta_k <- m * theta_k + (1 - m) * theta_q rounds back to theta_k for m close to 1 (at m = 0.999 "
            "the key encoder never moves). Keep the weights in float32 and train in mixed precision "
            "(TrainingArguments(bf16=True) autocasts the forward), instead of casting the model."
        )


@torch.no_grad()
def ema_update_(target: Iterable[torch.Tensor], source: Iterable[torch.Tensor], momentum: float) -> None:
    """In place, for every pair: ``target <- momentum * target + (1 - momentum) * source``.

    One fused multi-tensor (foreach) multiply and one fused add over all parameters.
    """
    target, source = list(target), list(source)
    _check_pairs(target, source)
    torch._foreach_mul_(target, momentum)
    torch._foreach_add_(target, source, alpha=1.0 - momentum)


@torch.no_grad()
def model_ema_update_(model, momentum: float) -> None:
    """:func:`ema_update_` of ``model.key_parameters()`` towards ``model.query_parameters()``, with the two
    lists built once per model and rebuilt only after some module registered a new parameter tensor
    (``from_pretrained``, ``load_state_dict(assign=True)``): no per-step walk over the modules."""
    cache = model.__dict__.get("_ema_pairs")
    if cache is None or cache[0] != _registrations[0] or cache[1][0].dtype not in (torch.float32, torch.float64):
        target, source = list(model.key_parameters()), list(model.query_parameters())
        _check_pairs(target, source)
        cache = model.__dict__["_ema_pairs"] = (_registrations[0], target, source)
    _, target, source = cache
    torch._foreach_mul_(target, momentum)
    torch._foreach_add_(target, source, alpha=1.0 - momentum)
