"""LARS (You et al. 2017) as MoCo v3 trains ResNets with it (facebookresearch/moco-v3 ``moco/optimizer.py``).

timm ships a ``Lars`` too, but its trust ratio is ``eta * ||w|| / (||g|| + wd * ||w||)`` (the paper's),
where MoCo v3 uses ``eta * ||w|| / ||g + wd * w||``; this one is MoCo v3's, so the official recipe
(lr 0.6 x batch / 256, weight decay 1e-6, momentum 0.9) means the same here.
"""

from __future__ import annotations

import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio, for matrices and kernels only.

    For every parameter with ``ndim > 1``: ``d = g + weight_decay * w``, then
    ``d <- d * trust_coefficient * ||w|| / ||d||`` (ratio 1 where ``||w||`` or ``||d||`` is 0). Parameters
    with ``ndim <= 1`` (biases, normalisation gains) get neither weight decay nor the ratio. Then
    ``mu <- momentum * mu + d`` and ``w <- w - lr * mu``.

    Args:
        params: parameters or parameter groups; ``lr`` and ``weight_decay`` may be set per group (the
            Trainer's groups set ``weight_decay=0`` for biases and norms, which this optimizer already
            exempts).
        lr: learning rate (MoCo v3 ResNet-50: 0.6 x batch / 256 at 100 epochs).
        weight_decay: decay added to the gradient of ``ndim > 1`` parameters (1e-6).
        momentum: SGD momentum (0.9).
        trust_coefficient: ``eta`` of the trust ratio (0.001).
    """

    def __init__(self, params, lr: float = 0.0, weight_decay: float = 0.0, momentum: float = 0.9,
                 trust_coefficient: float = 0.001):
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum),
                            ("trust_coefficient", trust_coefficient)):
            if not value >= 0:
                raise ValueError(f"{name}={value!r} is invalid: {name} must be >= 0")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad
                if p.ndim > 1:  # not a bias or a normalisation gain
                    d = d.add(p, alpha=group["weight_decay"])
                    w_norm, d_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(d)
                    ratio = torch.where((w_norm > 0) & (d_norm > 0),
                                        group["trust_coefficient"] * w_norm / d_norm, torch.ones_like(w_norm))
                    d = d.mul(ratio)
                state = self.state[p]
                if "mu" not in state:
                    state["mu"] = torch.zeros_like(p)
                state["mu"].mul_(group["momentum"]).add_(d)
                p.add_(state["mu"], alpha=-group["lr"])
        return loss
