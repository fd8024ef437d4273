"""training/pretrain.py with the views made by the augmentation kernels of 7338a63 (roi_align crop).

    git worktree add /tmp/old 7338a63
    OLD_AUGMENT=/tmp/old/hf_contrast/augment.py python results/bisect/head_with_old_crop.py --seed 1 \
        --output_dir /tmp/bisect/head_oldaug_s1 --precise_bn_batches 0

Only the small-image MoCo v2 recipe without blur, flips or solarize (the default job's before blur was
added back: pass --blur_p 0) is supported; the script asserts it.
"""
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch

spec = importlib.util.spec_from_file_location("old_augment", os.environ["OLD_AUGMENT"])
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training"))
import pretrain  # noqa: E402

from hf_contrast.data import views  # noqa: E402


def old_batch(self, images, generator=None):
    rgb = [views.to_rgb(im) for im in images]
    x = torch.from_numpy(np.stack([np.asarray(im) for im in rgb])).permute(0, 3, 1, 2).float() / 255
    return old_view(self, x, generator), old_view(self, x, generator)


def old_view(self, x, g):
    n, _, h, w = x.shape
    y = old.resized_crops(x, old.crop_boxes(n, h, w, tuple(self.crop_scale), generator=g), self.image_size)
    s = self.jitter_strengths[0]
    assert self.jitter_strengths == (s, s, s, s / 4), self.jitter_strengths
    if self.jitter_p > 0 and s > 0:
        y = old.color_jitter(y, s, self.jitter_p, generator=g)
    if self.grayscale_p > 0:
        y = old.random_grayscale(y, self.grayscale_p, generator=g)
    assert max(self.view_blur_p) == 0 and self.flip_p == 0 and max(self.view_solarize_p) == 0
    mean = torch.tensor(self.mean).view(1, -1, 1, 1)
    std = torch.tensor(self.std).view(1, -1, 1, 1)
    return (y - mean) / std


views.TwoViewAugmentation.batch = old_batch
if __name__ == "__main__":
    pretrain.main()
    pretrain.hf_contrast.distributed.shutdown()
