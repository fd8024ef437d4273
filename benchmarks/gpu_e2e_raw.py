"""The raw step ``benchmarks/gpu_e2e.py`` measures the user's path against: the model ``training/pretrain.py``
builds from the same flags, in ``gpu_check_common``'s timed step of synthetic inputs on the device (eager, or
with the encoders compiled). ``s`` below is the run's ``gpu_e2e.E2ESettings``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
PRETRAIN = HERE.parent / "training" / "pretrain.py"
sys.path.insert(0, str(HERE))
import gpu_check_common  # noqa: E402

METHODS = {"moco": "MoCo v2", "simclr": "SimCLR", "mocov3": "MoCo v3"}


def import_pretrain():
    """``training/pretrain.py`` as the module ``pretrain`` (its ``build_model`` builds the raw step's model)."""
    import importlib.util

    if "pretrain" not in sys.modules:
        spec = importlib.util.spec_from_file_location("pretrain", PRETRAIN)
        module = importlib.util.module_from_spec(spec)
        sys.modules["pretrain"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["pretrain"]


class RawStep(gpu_check_common.Method):
    """``gpu_check``'s timed step on pretrain.py's model: MoCo's keys enter the queue with their
    instance ids, unchecked, as the trainer enqueues them (the loss check covers them there)."""

    def after_backward(self) -> None:
        if self._keys is not None:
            keys, ids = self._keys
            self.model.enqueue(keys, ids, check_finite=False)
            self._keys = None


def raw_step(s, method: str, args: list[str]) -> RawStep:
    """The model pretrain.py builds from the flags ``args``, in a timed step of synthetic inputs on the
    device (the batch's ``y`` serve as instance ids); a queue starts full, as in steady state."""
    from transformers import HfArgumentParser

    pretrain = import_pretrain()
    (model_args, _rest) = HfArgumentParser(pretrain.ModelArguments).parse_args_into_dataclasses(
        args=args[1:], return_remaining_strings=True)
    torch.manual_seed(0)
    model = pretrain.build_model(model_args, s.image_size)
    queue = getattr(model, "queue", None)
    if queue is not None:
        k, d = model.config.queue_size, model.config.projection_dim
        model.enqueue(F.normalize(torch.randn(k, d), dim=1), torch.arange(k) + 10**6)  # ids no batch uses
    params = [p for p in model.parameters() if p.requires_grad]  # what the Trainer's optimizer steps
    step = RawStep(f"{METHODS[method]} raw", model, params, None, torch.device(s.device),
                   dtype=torch.bfloat16 if s.bf16 else None)

    def forward(x1, x2, y):
        out = model(x1, x2, instance_ids=y)
        if out.queue_keys is not None:
            step._keys = (out.queue_keys, out.queue_instance_ids)
        return out.loss

    step.step_fn = forward
    return step


def time_raw(s, method: str, args: list[str], compiled: bool, deadline: float) -> dict:
    """Median images/s of the raw step (``gpu_check_common.time_methods``), eager or with compiled encoders."""
    run = gpu_check_common.Run(gpu_check_common.Settings(smoke=s.smoke, device=s.device, image_size=s.image_size,
                                                         repeats=s.raw_repeats, compile_backend=s.compile_backend),
                               total_budget=max(deadline - time.perf_counter(), 1))
    step = raw_step(s, method, args)
    try:
        t = time.perf_counter()
        if compiled:
            gpu_check_common.compile_encoders(step.model, s.compile_backend)
            step(s.batch, s.image_size)
            step(s.batch, s.image_size)  # a recompile shows here, outside the timed rounds
            gpu_check_common.sync(step.device)
        r = gpu_check_common.time_methods(run, [step], s.batch, deadline, base=None)[step.name]
        r["setup"] = (f"batch {s.batch}, {'bf16 autocast' if s.bf16 else 'fp32'}, channels_last, SGD momentum, "
                      + (f"encoders compiled ({s.compile_backend})" if compiled else "eager"))
        if compiled:
            r["compile_and_first_steps_s"] = round(time.perf_counter() - t, 1)
        return r
    finally:
        del step
        gpu_check_common.free_memory()
        torch._dynamo.reset()
