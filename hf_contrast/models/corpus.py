"""Know your corpus: how many of a pool of negatives are expected to be false negatives.

With epochs reshuffled, an anchor's key from the previous epoch entered the queue at a uniformly
random position of that epoch, and the anchor comes back at a uniformly random position of this
one: its own earlier key is still among the K newest keys with probability

    P(own key queued) = K^2 / (2 N^2)     for K <= N  (N images; 1 once K >= 2N)

(the gap between the two positions is ``N - v + u`` with u, v uniform on [0, N]). So about
``K^2 / 2N^2`` of a queue's keys per anchor are the anchor's own image: 0.13% of anchors for
ImageNet at K = 65,536, 21% for CIFAR at 32,768, 100% for 65,536 on 20k images. With C balanced
classes about ``K / C`` of the K negatives share the anchor's class, on any corpus.

A suggested pool size follows from a budget on the first: the largest queue whose own-image
probability stays under ``own_image_budget`` (1% by default) is ``K = keys_per_image * N *
sqrt(2 * budget)``, about ``0.14 N`` at 1%. The same-class share, ``1 / C`` of the negatives, does not
shrink with a smaller queue (only the count does), so it sets no size; false-negative cancellation
(``false_negatives="eliminate"``) is the remedy for it. Measured on the 4,000 digits (two seeds):
kNN 0.806 at K = 256, 0.768 at K = 4,096; the suggestion there is 565.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FalseNegativeEstimate:
    """Expected false negatives in one anchor's pool.

    Attributes:
        pool: negatives per anchor (MoCo: the queue size; SimCLR: 2·N·W − 2).
        dataset_size: images in the training set.
        fraction: ``pool / dataset_size``.
        own_image_probability: chance that the anchor's own earlier key is in the pool (MoCo;
            ``K^2 / 2N^2`` for K <= N, 0 for in-batch negatives).
        own_image_keys: expected queued keys of the anchor's own image.
        same_class: expected negatives of the anchor's class, ``pool / num_classes`` (None when the
            number of classes is unknown).
        keys_per_image: keys one image enqueues per epoch (2 when both views are queued).
        suggested_pool: the largest queue whose own-image probability stays under the budget
            (``keys_per_image * N * sqrt(2 * budget)``); for in-batch negatives, the pool itself (they
            never hold the anchor's own image).
        own_image_budget: the budget on the own-image probability used for ``suggested_pool``.
    """

    pool: int
    dataset_size: int
    fraction: float
    own_image_probability: float
    own_image_keys: float
    same_class: float | None
    keys_per_image: int = 1
    suggested_pool: int | None = None
    own_image_budget: float = 0.01

    def describe(self) -> str:
        formula = "K^2/2N^2" if self.keys_per_image == 1 else "(K/2)^2/2N^2: both views are queued"
        text = (f"the pool of {self.pool:,} negatives is {self.fraction:.1%} of the {self.dataset_size:,} images; "
                f"an anchor's own earlier key is a negative with probability {self.own_image_probability:.1%} "
                f"({formula}; about {self.own_image_keys:.2f} such keys per anchor)")
        if self.same_class is not None:
            text += f", and about {self.same_class:,.0f} negatives ({self.same_class / max(self.pool, 1):.0%}) share its class"
        return text


def false_negative_estimate(pool: int, dataset_size: int, num_classes: int | None = None,
                            queued: bool = True, keys_per_image: int = 1,
                            own_image_budget: float = 0.01) -> FalseNegativeEstimate:
    """The expected false negatives of a pool of ``pool`` negatives over ``dataset_size`` images.

    Args:
        pool: negatives per anchor.
        dataset_size: training images N (>= 1).
        num_classes: C, for the ``pool / C`` same-class estimate (balanced classes assumed).
        queued: MoCo's queue (keys of earlier steps). False for SimCLR's in-batch negatives, which
            never hold the anchor's own image.
        keys_per_image: keys each image puts into the queue per epoch: 1 for MoCo, 2 when both views
            are enqueued (``symmetric_loss``, MoCo v3's queue). The queue then spans ``K / 2`` images
            and holds two keys of each: the probability is that of ``K / 2``, the key count twice it.
        own_image_budget: the own-image probability the suggested queue size stays under (0 < b <= 0.5).
    """
    if dataset_size < 1:
        raise ValueError(f"dataset_size={dataset_size!r} is invalid: it must be an integer >= 1")
    if keys_per_image < 1:
        raise ValueError(f"keys_per_image={keys_per_image!r} is invalid: it must be an integer >= 1")
    if not 0 < own_image_budget <= 0.5:
        raise ValueError(f"own_image_budget={own_image_budget!r} is invalid: it must be a probability in (0, 0.5]")
    k, n = pool / keys_per_image, dataset_size  # k: the images the queue spans
    if not queued:
        prob = keys = 0.0
    elif k <= n:
        prob = keys = k * k / (2.0 * n * n)
    else:  # the gap is uniform-triangular on [0, 2N]: P(gap <= K) = 1 - (2N - K)^2 / 2N^2, and older epochs add keys
        prob = 1.0 - max(2 * n - k, 0) ** 2 / (2.0 * n * n)
        keys = k / n - 0.5
    keys *= keys_per_image
    k = pool
    same = k / num_classes if num_classes else None
    suggested = max(1, math.floor(keys_per_image * n * math.sqrt(2 * own_image_budget))) if queued else pool
    return FalseNegativeEstimate(k, n, k / n, prob, keys, same, keys_per_image, suggested, own_image_budget)
