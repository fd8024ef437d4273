"""Per-sample view parameters and the batched, branch-free kernels that apply them.

A view of a batch is described by one float tensor ``(B, P)`` (:func:`draw_params`): crop box,
flip, colour jitter (applied flag, brightness, contrast, saturation, hue), grayscale flag, blur
sigma, solarize flag. It is drawn on the CPU from a seeded ``torch.Generator`` where the batch is made (a
DataLoader worker), travels with the batch, and is applied by kernels whose number of launches
does not depend on the batch size: every op runs on every image with identity parameters where it
does not apply (factor 1, hue 0, a delta blur kernel) and ``torch.where`` on the flags. No
``nonzero``, no subset indexing, no scalar read of a tensor, no host-to-device copy of parameters.

Each op follows torchvision's definition (``RandomResizedCrop.get_params``, ``ColorJitter``,
``RandomGrayscale``, ``GaussianBlur``, ``RandomSolarize``, ``RandomHorizontalFlip``); differences are noted where
they exist. Constants (luma weights, the HSV sector table, tap offsets, mean/std) are made once per device.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

_GRAY = (0.2989, 0.587, 0.114)  # ITU-R 601-2 luma, torchvision's rgb_to_grayscale weights
_HSV_PHASE = (5.0, 3.0, 1.0)  # HSV -> RGB: channel c = v - (v - min) * clamp(min(k, 4 - k), 0, 1), k = (n_c + 6h) mod 6

# columns of a view's parameters (B, NUM_PARAMS); new columns are appended, so existing indices stay
X1, Y1, X2, Y2, FLIP, JITTER, BRIGHTNESS, CONTRAST, SATURATION, HUE, GRAY, SIGMA, SOLARIZE = range(13)
NUM_PARAMS = 13
PARAM_NAMES = ("x1", "y1", "x2", "y2", "flip", "jitter", "brightness", "contrast", "saturation", "hue", "gray", "sigma",
               "solarize")
SOLARIZE_THRESHOLD = 0.5  # on the 0-1 scale: torchvision's RandomSolarize(0.5) on floats, 128 of 255 on uint8/PIL
BLUR_SIGMA = (0.1, 2.0)  # MoCo v2 / SimCLR


def _uniform(n: int, low: float, high: float, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(n, generator=generator) * (high - low) + low


def crop_boxes(n: int, height, width, scale: tuple[float, float], generator=None,
               ratio: tuple[float, float] = (3 / 4, 4 / 3), tries: int = 10) -> torch.Tensor:
    """``RandomResizedCrop.get_params`` for ``n`` images at once -> boxes ``(n, 4)`` as x1, y1, x2, y2.

    ``height`` and ``width`` are ints (one size for all) or ``(n,)`` sizes per image. Like
    torchvision: up to ``tries`` draws of area and log-uniform aspect ratio, the first that fits
    wins; if none fits, a central crop clamped to the allowed ratios.
    """
    height = torch.as_tensor(height, dtype=torch.float32).expand(n)  # (n,)
    width = torch.as_tensor(width, dtype=torch.float32).expand(n)
    area = (height * width).unsqueeze(1)  # (n, 1)
    target = area * _uniform(n * tries, *scale, generator).view(n, tries)  # (n, tries)
    log_r = _uniform(n * tries, math.log(ratio[0]), math.log(ratio[1]), generator).view(n, tries)
    aspect = log_r.exp()
    w = (target * aspect).sqrt().round()  # (n, tries)
    h = (target / aspect).sqrt().round()
    ok = (w > 0) & (h > 0) & (w <= width.unsqueeze(1)) & (h <= height.unsqueeze(1))
    first = torch.where(ok.any(1), ok.float().argmax(1), torch.full((n,), -1))  # (n,)
    in_ratio = width / height  # (n,) torchvision's fallback: the whole image clamped to the ratios
    fallback_w = torch.where(in_ratio > ratio[1], torch.minimum(width, (height * ratio[1]).round()), width)
    fallback_h = torch.where(in_ratio < ratio[0], torch.minimum(height, (width / ratio[0]).round()), height)
    idx = first.clamp(min=0).unsqueeze(1)
    w = torch.where(first >= 0, w.gather(1, idx).squeeze(1), fallback_w)  # (n,)
    h = torch.where(first >= 0, h.gather(1, idx).squeeze(1), fallback_h)
    x1 = torch.floor(torch.rand(n, generator=generator) * (width - w + 1))  # integer offsets, as randint
    y1 = torch.floor(torch.rand(n, generator=generator) * (height - h + 1))
    return torch.stack([x1, y1, x1 + w, y1 + h], dim=1)


def draw_params(n: int, height, width, generator: torch.Generator | None = None, *,
                crop_scale: tuple[float, float] = (0.2, 1.0), jitter_strength: float = 0.4, jitter_p: float = 0.8,
                grayscale_p: float = 0.2, blur_p: float = 0.5, flip_p: float = 0.5,
                blur_sigma: tuple[float, float] = BLUR_SIGMA, jitter: tuple[float, float, float, float] | None = None,
                solarize_p: float = 0.0) -> torch.Tensor:
    """The parameters of one view of ``n`` images: float32 ``(n, NUM_PARAMS)``, columns ``PARAM_NAMES``.

    Crop boxes as :func:`crop_boxes` (images of ``height`` x ``width``, ints or ``(n,)``), then one
    ``(n, 9)`` uniform draw per view: jitter applied with probability ``jitter_p`` (brightness,
    contrast, saturation factors in ``[max(0, 1 - j), 1 + j]``, hue factor in ``[-h, h]`` turns, as
    ``ColorJitter(*jitter)``, ``jitter = (b, c, s, h)``, by default ``(s, s, s, s/4)`` from
    ``jitter_strength``; factors 1 and hue 0 where it does not apply), grayscale with ``grayscale_p``,
    blur with ``blur_p`` (sigma uniform in ``blur_sigma``; 0 where it does not apply), flip with
    ``flip_p``. Then, only when ``solarize_p > 0``, one ``(n,)`` draw for the solarize flag (0
    otherwise): settings without solarize draw exactly the stream they drew before the column existed.
    Everything is drawn for every image, so the draws never depend on the outcomes, and a seeded
    ``generator`` gives the same parameters on any machine.
    """
    boxes = crop_boxes(n, height, width, crop_scale, generator)  # (n, 4)
    u = torch.rand(n, 9, generator=generator)  # (n, 9)
    s = jitter_strength
    strengths = tuple(jitter) if jitter is not None else (s, s, s, s / 4)  # b, c, sat, hue
    jitter_on = (u[:, 0] < jitter_p) & (max(strengths) > 0)  # (n,)
    low = torch.tensor([max(0.0, 1 - j) for j in strengths[:3]])  # (3,) torchvision's ranges
    span = torch.tensor([1 + j - max(0.0, 1 - j) for j in strengths[:3]])  # (3,)
    factors = torch.where(jitter_on.unsqueeze(1), u[:, 1:4] * span + low, 1.0)  # (n, 3) b, c, sat
    h = strengths[3]
    hue = torch.where(jitter_on, u[:, 4] * (2 * h) - h, 0.0)  # (n,) fraction of a turn, torchvision's hue_factor
    gray = u[:, 5] < grayscale_p
    blur = u[:, 6] < blur_p
    sigma = torch.where(blur, u[:, 7] * (blur_sigma[1] - blur_sigma[0]) + blur_sigma[0], 0.0)  # (n,)
    flip = u[:, 8] < flip_p
    solarize = torch.rand(n, generator=generator) < solarize_p if solarize_p > 0 else torch.zeros(n, dtype=torch.bool)
    columns = [flip, jitter_on, factors, hue, gray, sigma, solarize]
    return torch.cat([boxes] + [c.float().view(n, -1) for c in columns], dim=1)  # (n, NUM_PARAMS)


@functools.cache
def _constants(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Luma weights and the HSV phases on ``device``, made once."""
    return {"gray": torch.tensor(_GRAY, device=device, dtype=dtype).view(1, 3),
            "phase": torch.tensor(_HSV_PHASE, device=device, dtype=dtype).view(1, 3, 1, 1)}


@functools.cache
def _taps(kernel_size: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(kernel_size, device=device, dtype=dtype) - (kernel_size - 1) / 2  # (k,)


@functools.cache
def _mean_std(mean: tuple, std: tuple, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(mean, device=device, dtype=dtype).view(1, -1, 1, 1),
            torch.tensor(std, device=device, dtype=dtype).view(1, -1, 1, 1))


def _column(params: torch.Tensor, index: int, x: torch.Tensor) -> torch.Tensor:
    return params[:, index].to(x.dtype).view(-1, 1, 1, 1)  # (B, 1, 1, 1)


def resized_crop(images: torch.Tensor, params: torch.Tensor, size: int) -> torch.Tensor:
    """Crop the boxes of ``params`` out of ``images`` ``(B, C, H, W)`` (any dtype), resize to
    ``size`` x ``size`` and flip where ``params`` say so: ONE ``grid_sample`` for the batch.

    Float ``(B, C, S, S)`` on the 0-1 scale for ``uint8`` (0-255 divided by 255). Bilinear with
    torchvision's pixel mapping (``align_corners=False``: output pixel j samples
    ``x1 + (j + 0.5) * w / S - 0.5``), so a box of the output's size is copied exactly; the flip is
    the mirrored sampling grid. Differences from ``TF.resized_crop``: no antialiasing, and samples
    within half a pixel of the box's edge blend in the image pixels beyond it (torchvision clamps
    to the box; ``border`` padding at the image's edge). Without antialiasing a downscale by ``f``
    aliases; :meth:`~hf_contrast.TwoViewAugmentation.views` uses this kernel only for inputs at most
    ``ANTIALIAS_FREE_RATIO`` x the crop size (the device path's ``source_size = 8/7 x image_size``
    downscales by at most 1.14), and per-image antialiased :func:`resized_crops` beyond.
    """
    n, c, h, w = images.shape
    p = params.to(torch.float32)
    x1, y1, x2, y2 = p[:, X1], p[:, Y1], p[:, X2], p[:, Y2]  # (B,) each
    sign = 1 - 2 * p[:, FLIP]  # -1: mirrored grid
    zero = torch.zeros_like(x1)
    theta = torch.stack([torch.stack([sign * (x2 - x1) / w, zero, (x1 + x2) / w - 1], 1),
                         torch.stack([zero, (y2 - y1) / h, (y1 + y2) / h - 1], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, [n, c, size, size], align_corners=False)  # (B, S, S, 2)
    x = images.float()
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)  # (B, C, S, S)
    return out.div_(255) if images.dtype == torch.uint8 else out


ANTIALIAS_FREE_RATIO = 1.5  # inputs up to this multiple of the crop size are resampled without antialiasing


def resized_crops(images, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Crop integer ``boxes`` ``(B, 4)`` out of ``images`` and resize each to ``size`` x ``size``,
    one image at a time (the CPU path for images of different or large sizes).

    ``images`` is a ``(B, C, H, W)`` tensor or a list of ``(C, H_i, W_i)`` tensors (any sizes), of
    any dtype; the result is float ``(B, C, size, size)`` on the images' scale (0-255 for
    ``uint8``). As torchvision's ``resized_crop`` on tensors: crop, then bilinear ``interpolate``
    with antialiasing (``align_corners=False``). Only the crop region is converted to float.
    """
    first = images[0]
    out = torch.empty(len(boxes), first.shape[0], size, size, device=first.device)  # (B, C, S, S)
    for i, (x1, y1, x2, y2) in enumerate(boxes.to(torch.long).tolist()):
        crop = images[i][:, y1:y2, x1:x2].unsqueeze(0).float()  # (1, C, h, w)
        out[i] = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return out


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """``(B, 3, H, W)`` -> luma ``(B, 1, H, W)``."""
    n, c, h, w = x.shape  # a (1, 3) x (3, H * W) product per image: no copy (a 1x1 convolution costs 8x more here)
    return torch.matmul(_constants(x.device, x.dtype)["gray"], x.reshape(n, c, h * w)).view(n, 1, h, w)


def adjust_hue(images: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """torchvision's ``adjust_hue`` with one factor per image, for the whole batch at once.

    The same function as torchvision's tensor kernel (RGB -> HSV, ``h = (h + factor) mod 1``,
    HSV -> RGB; equal to 1e-5, tested against torchvision itself) in a closed form of 20 ops
    instead of its ~60 (the device path's launch budget): the hue is read off the first channel
    holding the maximum (r before g before b, as torchvision's masks), gray pixels (max == min)
    get hue 0 and stay exactly gray, and HSV -> RGB is the sector-free form
    ``c = v - (v - min) * clamp(min(k, 4 - k), 0, 1)``, ``k = (n_c + 6h) mod 6``, ``n = (5, 3, 1)``,
    which equals torchvision's ``(v, p, q, t)`` table per sector. No branch, no scalar read,
    shapes independent of the data.

    Args:
        images: ``(B, 3, H, W)`` float in [0, 1] (computed in float32, returned in its dtype).
        factors: ``(B,)`` hue shifts in [-0.5, 0.5] turns (0: the image, to float32 rounding).

    Returns:
        ``(B, 3, H, W)``, ``images``' dtype.
    """
    x = images if images.dtype == torch.float32 else images.float()
    low, high = torch.aminmax(x, dim=1, keepdim=True)  # (B, 1, H, W) each
    span = high - low  # v * s
    first_max = x.argmax(1, keepdim=True)  # (B, 1, H, W): 0, 1, 2 = r, g, b (first maximum)
    diff = x.roll(-1, 1) - x.roll(-2, 1)  # (B, 3, H, W): g - b, b - r, r - g
    # hue in sixths of a turn: (g - b) / span, (b - r) / span + 2 or (r - g) / span + 4 (0 where gray:
    # diff is 0 there, and a span below 1e-12 moves the output by less than the span)
    sixths = torch.addcdiv(first_max * 2.0, diff.gather(1, first_max), span.clamp(min=1e-12))  # (B, 1, H, W)
    shift = factors.to(torch.float32).view(-1, 1, 1, 1) * 6  # (B, 1, 1, 1)
    k = (sixths + shift).add(_constants(x.device, x.dtype)["phase"]).remainder(6)  # (B, 3, H, W)
    weight = torch.minimum(k, 4 - k).clamp(0, 1)  # (B, 3, H, W)
    out = torch.addcmul(high, span, weight, value=-1)  # (B, 3, H, W): v - v * s * weight
    return out if images.dtype == torch.float32 else out.to(images.dtype)


def color_jitter(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Brightness, contrast, saturation and hue of ``params`` on images ``(B, 3, H, W)`` in [0, 1],
    where the jitter flag is set (the others are returned unchanged, bit for bit).

    Each op is torchvision's (``adjust_brightness``, ``adjust_contrast``, ``adjust_saturation``,
    ``adjust_hue`` via :func:`adjust_hue`) with the image's drawn factor. The order is fixed: b, c,
    s, h. torchvision's ``ColorJitter`` draws a random order per call; per-image random orders in a
    branch-free batched kernel would mean computing all 24 orders (or 4 rounds of all 4 ops
    selected by ``torch.where``) for every image, at 4x the cost or more, so we keep one order.
    """
    b, c, s = (_column(params, i, x) for i in (BRIGHTNESS, CONTRAST, SATURATION))  # (B, 1, 1, 1) each
    y = (x * b).clamp_(0, 1)
    mean = grayscale(y).mean(dim=(1, 2, 3), keepdim=True)  # (B, 1, 1, 1)
    y = y.mul_(c).add_(mean * (1 - c)).clamp_(0, 1)  # (y - mean) * c + mean
    gray = grayscale(y).mul_(1 - s)
    y = y.mul_(s).add_(gray).clamp_(0, 1)  # (y - gray) * s + gray
    y = adjust_hue(y, params[:, HUE])  # (B, 3, H, W)
    return torch.where(_column(params, JITTER, x) > 0, y, x)


def random_grayscale(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Luma in all three channels where the grayscale flag is set."""
    return torch.where(_column(params, GRAY, x) > 0, grayscale(x).expand_as(x), x)


def random_flip(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Horizontal flip where the flag is set (the fixed-size path folds it into :func:`resized_crop`)."""
    return torch.where(_column(params, FLIP, x) > 0, x.flip(-1), x)


def gaussian_blur(x: torch.Tensor, params: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Separable Gaussian blur with each image's sigma, reflect padding: a grouped convolution over
    the ``B * C`` channels with per-image kernels of ``kernel_size`` taps. Sigma 0 (no blur) gives
    a delta kernel, which returns the image bit for bit."""
    n, c, h, w = x.shape
    r = _taps(kernel_size, x.device, x.dtype)  # (k,)
    sigma = params[:, SIGMA].to(x.dtype).clamp(min=1e-3).view(n, 1)  # (B, 1): 1e-3 gives exp(-5e5) = 0 off centre
    k = torch.exp(-(r**2) / (2 * sigma**2))  # (B, k)
    k = (k / k.sum(1, keepdim=True)).unsqueeze(1).expand(n, c, kernel_size).reshape(n * c, kernel_size)  # (B * C, k)
    pad = kernel_size // 2
    y = x.reshape(1, n * c, h, w)
    y = F.conv2d(F.pad(y, (pad, pad, 0, 0), mode="reflect"), k.view(n * c, 1, 1, kernel_size), groups=n * c)
    y = F.conv2d(F.pad(y, (0, 0, pad, pad), mode="reflect"), k.view(n * c, 1, kernel_size, 1), groups=n * c)
    return y.view(n, c, h, w)


def random_solarize(x: torch.Tensor, params: torch.Tensor, threshold: float = SOLARIZE_THRESHOLD) -> torch.Tensor:
    """torchvision's ``solarize`` (``x >= threshold`` becomes ``1 - x``, on images in [0, 1]) where the
    solarize flag is set: one ``torch.where`` for the batch, no branch on the data."""
    return torch.where((_column(params, SOLARIZE, x) > 0) & (x >= threshold), 1 - x, x)  # (B, 3, H, W)


def normalize(x: torch.Tensor, mean: tuple, std: tuple) -> torch.Tensor:
    """``(x - mean) / std`` per channel, in place, with the constants cached per device."""
    m, s = _mean_std(tuple(mean), tuple(std), x.device, x.dtype)
    return x.sub_(m).div_(s)
