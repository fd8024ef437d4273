"""``benchmarks/gpu_check.py``'s ``lightly`` section: our MoCo v2 step against the same step assembled from
lightly's parts (installed with ``pip install --no-deps --target`` into a folder of its own; never a
dependency)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from gpu_check_common import (
    Method,
    Run,
    time_methods,
)

from hf_contrast import (
    MoCoConfig,
    MoCoModel,
)


def import_lightly(run: Run, target: Path, wheels: str | None, timeout: float):
    """lightly's modules, importable already, from ``target``, or installed there (no dependencies)."""
    with contextlib.suppress(ImportError):
        import lightly  # noqa: F401

        return "already importable"
    if not (target / "lightly").is_dir():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--retries", "0", "--timeout", "10", "--target", str(target), "lightly"]
        if wheels:
            cmd[-1:-1] = ["--no-index", "--find-links", wheels]
        run.log(f"  installing lightly into {target} (its own folder, no dependencies)")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"pip install lightly timed out after {timeout:.0f} s"
        if p.returncode:
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"pip install lightly failed (rc {p.returncode}): {tail[0][:300]}"
    sys.path.insert(0, str(target))
    import lightly  # noqa: F401

    return f"installed in {target}"


class LightlyMoCo(torch.nn.Module):
    """MoCo v2 assembled from lightly's parts, as lightly's own MoCo example does."""

    def __init__(self, backbone: str, queue_size: int, temperature: float):
        super().__init__()
        import copy

        from lightly.loss import NTXentLoss
        from lightly.models.modules import MoCoProjectionHead
        from lightly.models.utils import deactivate_requires_grad

        self.backbone = timm.create_model(backbone, pretrained=False, num_classes=0)
        self.projection_head = MoCoProjectionHead(self.backbone.num_features, 2048, 128)
        self.backbone_momentum = copy.deepcopy(self.backbone)
        self.projection_head_momentum = copy.deepcopy(self.projection_head)
        deactivate_requires_grad(self.backbone_momentum)
        deactivate_requires_grad(self.projection_head_momentum)
        self.criterion = NTXentLoss(temperature=temperature, memory_bank_size=(queue_size, 128))

    def forward(self, x1, x2):
        q = self.projection_head(self.backbone(x1))  # (B, 128)
        with torch.no_grad():
            k = self.projection_head_momentum(self.backbone_momentum(x2))  # (B, 128)
        return self.criterion(q, k)  # negatives: the memory bank, which it updates with k

    @torch.no_grad()
    def momentum_update(self, m: float) -> None:
        from lightly.models.utils import update_momentum

        update_momentum(self.backbone, self.backbone_momentum, m)
        update_momentum(self.projection_head, self.projection_head_momentum, m)


def section_lightly(run: Run, record: dict, deadline: float):
    how = import_lightly(run, run.lightly_target, run.lightly_wheels, max(deadline - time.perf_counter() - 10, 5))
    if isinstance(how, tuple):
        return how[1]
    import lightly

    record["lightly"] = f"{getattr(lightly, '__version__', '?')} ({how})"
    s = run.s
    torch.manual_seed(0)
    ours = MoCoModel(MoCoConfig(backbone=s.backbone, image_size=s.image_size, queue_size=s.queue_size, key_bn_splits=1))
    ours.enqueue(F.normalize(torch.randn(s.queue_size, ours.config.projection_dim), dim=1))  # full, as lightly's bank
    m_ours = Method("ours (hf_contrast MoCoModel)", ours, ours.query_parameters(), None, run.device)

    def ours_step(x1, x2, y):
        out = ours(x1, x2)
        m_ours._keys = out.queue_keys
        return out.loss

    m_ours.step_fn = ours_step
    theirs = LightlyMoCo(s.backbone, s.queue_size, ours.config.temperature)
    params = [*theirs.backbone.parameters(), *theirs.projection_head.parameters()]
    m_theirs = Method("supervised", theirs, params, lambda x1, x2, y: theirs(x1, x2), run.device)  # the base
    b = min(s.lightly_batch, getattr(run, "batch", None) or s.lightly_batch)
    record["setup"] = (f"{s.backbone} at {s.image_size} px, batch {b}, queue {s.queue_size}, T=0.2, m=0.999, head "
                       "2048-ReLU-128, bf16 autocast, channels_last, SGD; ours with key_bn_splits=1 (lightly has no "
                       "split-BN); both steps: forward, backward, enqueue, SGD step, EMA. Each library's own numerics: "
                       "ours computes the (B, 1 + K) logits in fp32 with autocast off, lightly's loss in bf16")
    res = time_methods(run, [m_theirs, m_ours], b, deadline - 2)
    record["results"] = {"lightly": res["supervised"], "ours": res[m_ours.name]}
    record["ours_over_lightly"] = res[m_ours.name]["ratio_to_supervised"]
