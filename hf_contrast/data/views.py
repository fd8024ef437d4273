"""The two-view augmentation: :class:`TwoViewAugmentation` (its recipes, the PIL pipelines of the worker path,
the per-sample parameters and batched views of the tensor path) and the image helpers it shares with the
datasets and the stream."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T

from . import augment

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# mean/std of the embedded MNIST digits as RGB, measured on its train split

# The named recipes' augmentation settings (image size and mean/std are the data's, not the recipe's).
# blur_p and solarize_p are (view 1, view 2); jitter is (brightness, contrast, saturation, hue).
RECIPES = {
    # MoCo v2 --aug-plus (facebookresearch/moco main_moco.py), symmetric
    "mocov2": dict(crop_scale=(0.2, 1.0), jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8, grayscale_p=0.2,
                   blur_p=(0.5, 0.5), solarize_p=(0.0, 0.0), flip_p=0.5),
    # the CIFAR variant of MoCo v2: no blur
    "small_images": dict(crop_scale=(0.2, 1.0), jitter=(0.4, 0.4, 0.4, 0.1), jitter_p=0.8, grayscale_p=0.2,
                         blur_p=(0.0, 0.0), solarize_p=(0.0, 0.0), flip_p=0.5),
    # MoCo v3 (facebookresearch/moco-v3 main_moco.py augmentation1 / augmentation2) = BYOL: asymmetric
    "mocov3": dict(crop_scale=(0.08, 1.0), jitter=(0.4, 0.4, 0.2, 0.1), jitter_p=0.8, grayscale_p=0.2,
                   blur_p=(1.0, 0.1), solarize_p=(0.0, 0.2), flip_p=0.5),
}
RECIPE_NAMES = (*RECIPES, "custom")


def _per_view(name: str, value) -> tuple[float, float]:
    """A probability, or a (view 1, view 2) pair of them -> the pair; a ValueError naming ``name``."""
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    ok = len(pair) == 2 and all(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1
                                for p in pair)
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: it must be a probability in [0, 1] or a (view 1, view 2) "
                         "pair of probabilities")
    return float(pair[0]), float(pair[1])


@dataclass
class TwoViewAugmentation:
    """Two random views of one image, as in SimCLR / MoCo v2, or asymmetric as in MoCo v3 / BYOL.

    The defaults are MoCo v2's ``--aug-plus`` ImageNet pipeline (recipe ``"mocov2"``): random resized
    crop (scale 0.2-1), colour jitter (0.4, 0.4, 0.4, 0.1) with p=0.8, grayscale p=0.2, Gaussian blur
    (sigma 0.1-2) p=0.5, horizontal flip, the same for both views. :meth:`small_images` is the CIFAR
    variant (no blur), :meth:`mocov3` the official MoCo v3 / BYOL recipe, whose two views differ: blur
    p=1.0 and no solarize on view 1, blur p=0.1 and solarize p=0.2 on view 2. Per view the ops run in
    the order crop, jitter, grayscale, blur, solarize, flip (the official code's), then normalisation.

    Args:
        image_size: side of the square output crops.
        crop_scale: range of the crop's area as a fraction of the image.
        jitter_strength: colour jitter strength s: ``ColorJitter(s, s, s, s / 4)`` (0.4 is MoCo v2's
            setting). ``jitter`` overrides it.
        jitter_p: probability of applying colour jitter.
        grayscale_p: probability of converting the view to grayscale.
        blur_p: probability of Gaussian blur (kernel about 10% of the image side): one for both views,
            or a ``(view 1, view 2)`` pair.
        flip_p: probability of a horizontal flip.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.
        solarize_p: probability of solarizing (pixels >= 0.5 of the range become 1 - x, torchvision's
            ``solarize``, PIL's ``ImageOps.solarize`` at 128 of 255): one for both views or a pair.
        jitter: ``(brightness, contrast, saturation, hue)`` strengths, as ``ColorJitter``'s arguments
            (each >= 0, hue <= 0.5); None: ``(s, s, s, s / 4)`` from ``jitter_strength``.
        recipe: the name of the recipe the settings come from (one of ``RECIPE_NAMES``), for logs and
            the model card; the named constructors set it. None: ``"mocov2"`` when every setting is MoCo
            v2's, else ``"custom"``. :attr:`overrides` lists the settings that depart from it.
    """

    image_size: int = 224
    crop_scale: tuple[float, float] = (0.2, 1.0)
    jitter_strength: float = 0.4
    jitter_p: float = 0.8
    grayscale_p: float = 0.2
    blur_p: float | tuple[float, float] = 0.5
    flip_p: float = 0.5
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    solarize_p: float | tuple[float, float] = 0.0
    jitter: tuple[float, float, float, float] | None = None
    recipe: str | None = None
    _pipelines: tuple[Callable, Callable] = field(init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.image_size, bool) or not isinstance(self.image_size, int) or self.image_size < 1:
            raise ValueError(f"image_size={self.image_size!r} is invalid: it must be an integer >= 1 (pixels)")
        if not (0 < self.crop_scale[0] <= self.crop_scale[1] <= 1):
            raise ValueError(f"crop_scale={self.crop_scale!r} is invalid: it must be (min, max) with 0 < min <= max <= 1")
        for name in ("jitter_p", "grayscale_p", "flip_p"):
            p = getattr(self, name)
            if not 0 <= p <= 1:
                raise ValueError(f"{name}={p!r} is invalid: it must be a probability in [0, 1]")
        self.view_blur_p = _per_view("blur_p", self.blur_p)  # (view 1, view 2)
        self.view_solarize_p = _per_view("solarize_p", self.solarize_p)
        if self.jitter is None:
            if not 0 <= self.jitter_strength <= 2:
                raise ValueError(f"jitter_strength={self.jitter_strength!r} is invalid: it must be in [0, 2] "
                                 "(the hue strength s / 4 is at most 0.5)")
        else:
            j = tuple(self.jitter)
            if len(j) != 4 or not all(isinstance(v, (int, float)) and v >= 0 for v in j) or j[3] > 0.5:
                raise ValueError(f"jitter={self.jitter!r} is invalid: it must be (brightness, contrast, saturation, "
                                 "hue) strengths, each >= 0 and hue <= 0.5, as torchvision's ColorJitter, or None "
                                 "for (s, s, s, s / 4) from jitter_strength")
            self.jitter = j
        if self.recipe is None:  # the first named recipe whose settings these are, else "custom"
            self.recipe = next((name for name, r in RECIPES.items() if self._settings() == r), "custom")
        elif self.recipe not in RECIPE_NAMES:
            raise ValueError(f"recipe={self.recipe!r} is invalid: it must be one of {list(RECIPE_NAMES)} or None")
        self._pipelines = (self._pil_pipeline(0), self._pil_pipeline(1))

    @property
    def jitter_strengths(self) -> tuple[float, float, float, float]:
        """``(brightness, contrast, saturation, hue)`` strengths of the colour jitter."""
        s = self.jitter_strength
        return self.jitter if self.jitter is not None else (s, s, s, s / 4)

    def _jitter_on(self) -> bool:
        return self.jitter_p > 0 and max(self.jitter_strengths) > 0

    def _settings(self) -> dict:
        """The recipe-level settings, in :data:`RECIPES`' form."""
        return dict(crop_scale=tuple(self.crop_scale), jitter=tuple(self.jitter_strengths), jitter_p=self.jitter_p,
                    grayscale_p=self.grayscale_p, blur_p=self.view_blur_p, solarize_p=self.view_solarize_p,
                    flip_p=self.flip_p)

    @property
    def overrides(self) -> dict:
        """The settings that depart from :attr:`recipe`'s (from MoCo v2's for ``"custom"``)."""
        base = RECIPES.get(self.recipe, RECIPES["mocov2"])
        return {k: v for k, v in self._settings().items() if v != base[k]}

    def _pil_pipeline(self, view: int) -> Callable:
        """The torchvision (PIL) pipeline of view ``view`` (0 or 1), ops in the official order."""
        ops = [T.RandomResizedCrop(self.image_size, scale=tuple(self.crop_scale), antialias=True)]
        if self._jitter_on():
            ops.append(T.RandomApply([T.ColorJitter(*self.jitter_strengths)], p=self.jitter_p))
        if self.grayscale_p > 0:
            ops.append(T.RandomGrayscale(p=self.grayscale_p))
        if self.view_blur_p[view] > 0:
            ops.append(T.RandomApply([T.GaussianBlur(self._blur_kernel(), sigma=augment.BLUR_SIGMA)],
                                     p=self.view_blur_p[view]))
        if self.view_solarize_p[view] > 0:  # on a PIL image: 128 of 255 (ImageOps.solarize's, the official one)
            ops.append(T.RandomSolarize(threshold=128, p=self.view_solarize_p[view]))
        if self.flip_p > 0:
            ops.append(T.RandomHorizontalFlip(p=self.flip_p))
        ops += [T.ToTensor(), T.Normalize(self.mean, self.std)]
        return T.Compose(ops)

    @property
    def pipelines(self) -> tuple[Callable, Callable]:
        """The torchvision ``Compose`` of each view (PIL in, normalised tensor out), used by ``__call__``."""
        return self._pipelines

    @classmethod
    def small_images(cls, image_size: int = 32, **overrides) -> TwoViewAugmentation:
        """The CIFAR-style variant used for 32 px data (no blur: it erases small images)."""
        return cls(image_size=image_size, **{"blur_p": 0.0, "recipe": "small_images", **overrides})

    @classmethod
    def mocov3(cls, image_size: int = 224, **overrides) -> TwoViewAugmentation:
        """The official MoCo v3 recipe (facebookresearch/moco-v3 ``main_moco.py``, ``augmentation1`` and
        ``augmentation2``; the same as BYOL's): both views random resized crop scale 0.08-1, colour
        jitter (0.4, 0.4, 0.2, 0.1) with p=0.8, grayscale p=0.2, horizontal flip p=0.5; view 1 Gaussian
        blur (sigma 0.1-2) p=1.0 and no solarize, view 2 blur p=0.1 and solarize p=0.2. ``overrides``
        replace any field (e.g. ``blur_p=0.0`` for tiny images); :attr:`overrides` then lists them."""
        settings = dict(RECIPES["mocov3"])
        return cls(image_size=image_size, **{**settings, "recipe": "mocov3", **overrides})

    def describe(self) -> str:
        """One line naming the recipe and every op with its probabilities (logs, the model card)."""
        b, c, s, h = self.jitter_strengths
        parts = [f"random resized crop to {self.image_size} px, scale {tuple(self.crop_scale)}"]
        parts.append(f"colour jitter ({b:g}, {c:g}, {s:g}, {h:g}) p={self.jitter_p}" if self._jitter_on()
                     else "no colour jitter")
        parts.append(f"grayscale p={self.grayscale_p}" if self.grayscale_p else "no grayscale")
        for name, (p1, p2) in (("Gaussian blur", self.view_blur_p), ("solarize", self.view_solarize_p)):
            if p1 == p2:
                parts.append(f"{name} p={p1:g}" if p1 else f"no {name.split()[-1]}")
            else:
                parts.append(f"{name} p={p1:g} (view 1) / {p2:g} (view 2)")
        parts.append(f"horizontal flip p={self.flip_p}" if self.flip_p else "no flip")
        return f"{self.recipe} recipe: " + ", ".join(parts)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """Two views of one image through the torchvision (PIL) pipelines of view 1 and view 2."""
        image = to_rgb(image)
        return self._pipelines[0](image), self._pipelines[1](image)

    def view_params(self, n: int, height, width, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample parameters of both views of ``n`` images of ``height`` x ``width`` (ints, or
        ``(n,)`` sizes per image): float32 ``(n, 2, P)``, view 1 drawn before view 2, each with its own
        blur and solarize probabilities (see :func:`hf_contrast.data.augment.draw_params` for the columns).
        All randomness comes from ``generator`` (the global RNG when None)."""
        draw = functools.partial(
            augment.draw_params, crop_scale=tuple(self.crop_scale), jitter=self.jitter_strengths,
            jitter_p=self.jitter_p, grayscale_p=self.grayscale_p, flip_p=self.flip_p)
        views = [draw(n, height, width, generator, blur_p=self.view_blur_p[v], solarize_p=self.view_solarize_p[v])
                 for v in (0, 1)]  # (n, P) each, in this order
        return torch.stack(views, 1)  # (n, 2, P)

    def views(self, images, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two views ``(B, 3, S, S)`` of ``uint8`` images with the parameters ``params``
        ``(B, 2, P)`` (on the images' device). ``images`` is a ``(B, 3, H, W)`` tensor on any device,
        or a list of ``(3, H_i, W_i)`` tensors of different sizes.

        A tensor of at most ``augment.ANTIALIAS_FREE_RATIO`` (1.5) x ``image_size`` a side (the
        device path's ``source_size`` is 8/7 of it) is cropped and flipped by one ``grid_sample`` per
        view, without antialiasing (a downscale of at most 1.5x); larger images and lists are cropped
        one by one with antialiasing (CPU workers). The rest is batched and branch-free: its kernel
        launches do not depend on the batch size.
        """
        return self._view(images, params[:, 0], 0), self._view(images, params[:, 1], 1)

    def batch(self, images: list, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Two views ``(B, 3, S, S)`` each of a list of images (PIL or arrays, of any sizes):
        :meth:`view_params` drawn from ``generator``, then :meth:`views`."""
        rgb = [torch.from_numpy(np.array(to_rgb(im))).permute(2, 0, 1) for im in images]  # (3, H, W) uint8 each
        if len({im.shape for im in rgb}) == 1:
            rgb = torch.stack(rgb)  # (B, 3, H, W)
        sizes = torch.tensor([im.shape[-2:] for im in rgb], dtype=torch.float32)  # (B, 2) as (H, W)
        return self.views(rgb, self.view_params(len(rgb), sizes[:, 0], sizes[:, 1], generator))

    def _view(self, images, params: torch.Tensor, view: int) -> torch.Tensor:
        """View ``view`` (0 or 1) ``(B, 3, S, S)`` of ``uint8`` images with its parameters ``(B, P)``.
        Which ops run depends only on the settings (an op with probability 0 for this view is skipped),
        never on the drawn values."""
        size = self.image_size
        batched = isinstance(images, torch.Tensor) and max(images.shape[-2:]) <= augment.ANTIALIAS_FREE_RATIO * size
        if batched:
            y = augment.resized_crop(images, params, size)  # (B, 3, S, S) in [0, 1], flipped where drawn
        else:
            y = augment.resized_crops(images, params[:, :4], size).div_(255)
            y = augment.random_flip(y, params)  # flips commute with the ops below
        if self._jitter_on():
            y = augment.color_jitter(y, params)
        if self.grayscale_p > 0:
            y = augment.random_grayscale(y, params)
        if self.view_blur_p[view] > 0:
            y = augment.gaussian_blur(y, params, self._blur_kernel())
        if self.view_solarize_p[view] > 0:
            y = augment.random_solarize(y, params)
        return augment.normalize(y, self.mean, self.std)

    def _blur_kernel(self) -> int:
        return max(3, int(0.1 * self.image_size) // 2 * 2 + 1)  # odd, about 10% of the side

    def eval_transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """Deterministic transform for evaluation: resize to ``image_size``, normalise."""
        pipeline = T.Compose([
            T.Resize(self.image_size, antialias=True), T.CenterCrop(self.image_size),
            T.ToTensor(), T.Normalize(self.mean, self.std),
        ])
        return lambda image: pipeline(to_rgb(image))


def to_rgb(image) -> Image.Image:
    """PIL RGB image from a PIL image of any mode (grayscale, RGBA, palette...) or an array."""
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "P"):
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def square_resized(image: Image.Image, size: int) -> np.ndarray:
    """A PIL image -> ``(size, size, 3)`` uint8: its centre square resized to ``size`` (as the
    shorter side resized to ``size`` then a centre crop, but resampling only the square)."""
    image = to_rgb(image)
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) / 2, (h - side) / 2  # the centre square, in source pixels
    box = (left, top, left + side, top + side)
    image = image.resize((size, size), Image.BILINEAR, box=box, reducing_gap=None if size / side > 0.5 else 2.0)
    return np.asarray(image)
