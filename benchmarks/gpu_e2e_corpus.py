"""The corpus of ``benchmarks/gpu_e2e.py``: photo-like JPEGs (the size of a photo's, 250-500 px sides), written
as webdataset shards with ``sizes.json`` by the library's :func:`hf_contrast.write_shards`."""

from __future__ import annotations

import io
import math
import shutil
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np


def photo_like_jpeg(seed: int, quality: int = 90) -> bytes:
    """A JPEG of a photo-like image: 250-500 px sides (random aspect), a smooth two-colour gradient,
    a few low-frequency colour blobs, soft-edged shapes and sensor noise (so its size is a photo's)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    w, h = (int(v) for v in rng.integers(250, 501, size=2))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)  # (H, W) each
    angle = rng.uniform(0, 2 * np.pi)
    t = (np.cos(angle) * xx / w + np.sin(angle) * yy / h + 1) / 2  # (H, W) in [0, 1]
    c0, c1 = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
    img = c0 + t[..., None] * (c1 - c0)  # (H, W, 3)
    for _ in range(int(rng.integers(2, 5))):  # soft blobs: illumination, out-of-focus objects
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.1, 0.4) * min(w, h)
        weight = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]  # (H, W, 1)
        img += weight * rng.uniform(-80, 80, size=3).astype(np.float32)
    image = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    shapes = Image.new("RGBA", (w, h), (0, 0, 0, 0))
    draw = ImageDraw.Draw(shapes)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = rng.uniform(-0.2, 1.0) * w, rng.uniform(-0.2, 1.0) * h
        x1, y1 = x0 + rng.uniform(0.05, 0.5) * w, y0 + rng.uniform(0.05, 0.5) * h
        colour = (*(int(v) for v in rng.integers(0, 256, size=3)), int(rng.integers(120, 256)))
        kind = rng.integers(3)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.polygon([tuple(p) for p in rng.uniform((x0, y0), (x1, y1), size=(5, 2))], fill=colour)
    shapes = shapes.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 2.5))))  # soft edges, as a lens
    image = Image.alpha_composite(image.convert("RGBA"), shapes).convert("RGB")
    noisy = np.asarray(image, dtype=np.float32) + rng.normal(0, rng.uniform(2, 8), size=(h, w, 3))  # (H, W, 3)
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def write_corpus(directory: Path, images: int, shards: int, seed: int = 0, processes: int = 1) -> dict:
    """``images`` photo-like JPEGs as ``shards`` webdataset tars (+ ``sizes.json``) with the library's
    :func:`hf_contrast.write_shards`; returns figures of the corpus."""
    import datasets

    import hf_contrast

    t = time.perf_counter()
    shutil.rmtree(directory, ignore_errors=True)  # no shard of an earlier, larger corpus stays in the glob
    seeds = [seed * 1_000_003 + i for i in range(images)]
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            jpegs = list(pool.map(photo_like_jpeg, seeds, chunksize=16))
    else:
        jpegs = [photo_like_jpeg(s) for s in seeds]
    dataset = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in jpegs]},
                                         features=datasets.Features({"image": datasets.Image()}))
    paths = hf_contrast.write_shards(dataset, str(directory), images_per_shard=math.ceil(images / shards),
                                     label_column=None)
    kib = [len(b) / 1024 for b in jpegs]
    return dict(directory=str(directory), images=images, shards=len(paths), mean_jpeg_kib=round(statistics.mean(kib), 1),
                median_jpeg_kib=round(statistics.median(kib), 1), seconds=round(time.perf_counter() - t, 1))
