"""The training-curve plot of an exported encoder's model card: loss, contrastive top-1 and kNN top-1
against the optimizer step, from the Trainer's ``log_history`` (matplotlib, when installed)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CURVES_FILENAME = "training_curves.png"
_CURVE_KEYS = (("loss", "contrastive loss"), ("contrastive_top1", "contrastive top-1"), ("knn_top1", "kNN top-1"))


def plot_training_curves(log_history: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Plot loss, contrastive top-1 and (if logged) kNN top-1 against the optimizer step into ``path``.

    Returns:
        ``path``, or ``None`` when nothing was logged or matplotlib is not installed.
    """
    panels = []
    for key, label in _CURVE_KEYS:
        points = [(h["step"], h[key]) for h in log_history if key in h and "step" in h]
        if points:
            panels.append((label, points))
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: the model card has no training-curve plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3), squeeze=False)
    for ax, (label, points) in zip(axes[0], panels, strict=True):
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="." if len(points) < 30 else None)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
