#!/usr/bin/env python
"""Images/s of the data paths that feed two-view contrastive training, side by side in one run.

On a synthetic JPEG corpus this script writes (mixed sizes, like photos: 200-500 px a side), two
views per image at ``--image_size`` (224: MoCo v2's augmentations), through a DataLoader with 0, 1
and 2 workers:

  (a) pil       per-image torchvision PIL pipeline, as lightly runs it (decode + T.Compose per view)
  (b) map       ours, map-style: TwoViewDataset over a datasets.Dataset (each image cropped at its
                own size, then the batched kernels)
  (b) stream    ours, streamed: StreamingTwoViewDataset over webdataset shards (decode, resize to a
                fixed size, batched augment kernels in the worker)
  (c) decode    decode only (full-size JPEG decode to RGB): the floor of any path
  (d) workers   device augmentation, the workers' part: decode + resize to uint8
  (d) device    device augmentation, the device's part, measured here on the CPU (one process)

Ratios are printed to (a) and to (c). Throughput excludes each loader's first batch (worker start).
The paths are measured in interleaved rounds (``--repeats``) and the median printed, so a load
that changes during the run (a shared machine) hits every path alike.

    python benchmarks/data_throughput.py                      # 96 images, batch 16, 224 px
    python benchmarks/data_throughput.py --images 256 --batch_size 32
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time

import datasets
import numpy as np
import torch
from PIL import Image

from hf_contrast import DeviceAugmentation, TwoViewAugmentation, TwoViewDataset, write_shards
from hf_contrast.data.shards import read_shard_sizes, resolve_shards
from hf_contrast.data.streaming import StreamingTwoViewDataset


def synthetic_corpus(n: int, seed: int = 0) -> datasets.Dataset:
    """``n`` JPEG photos-like images (smooth colour fields plus texture), 200-500 px a side."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        w, h = (int(v) for v in rng.integers(200, 501, size=2))
        yy, xx = np.mgrid[0:h, 0:w] / max(w, h)
        base = np.stack([np.sin(xx * rng.uniform(2, 9) + c) * np.cos(yy * rng.uniform(2, 9) - c) for c in range(3)], -1)
        pixels = ((base * 0.4 + 0.5 + rng.normal(0, 0.06, (h, w, 3))).clip(0, 1) * 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=90)
        images.append({"bytes": out.getvalue(), "path": None})
    return datasets.Dataset.from_dict({"image": images}, features=datasets.Features({"image": datasets.Image()}))


class PerImage(torch.utils.data.Dataset):
    """Map-style dataset over JPEG bytes applying ``fn`` to each decoded image."""

    def __init__(self, blobs: list[bytes], fn):
        self.blobs, self.fn = blobs, fn

    def __len__(self):
        return len(self.blobs)

    def __getitem__(self, i):
        return self.fn(Image.open(io.BytesIO(self.blobs[i])).convert("RGB"))


def pil_views(augmentation):
    return lambda image: augmentation(image)  # two views, torchvision PIL pipeline


def decode_only(image):
    return torch.from_numpy(np.array(image)).sum(dtype=torch.int64)  # forces the full decode


def throughput(loader, batch_size: int) -> float:
    """Images/s over the loader, after its first batch."""
    it = iter(loader)
    next(it)
    start, images = time.perf_counter(), 0
    for batch in it:
        first = batch if torch.is_tensor(batch) else next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
        images += len(first)
    return images / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=96)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is printed")
    a = p.parse_args()
    torch.set_num_threads(1)
    augmentation = TwoViewAugmentation(image_size=a.image_size)
    corpus = synthetic_corpus(a.images)
    blobs = [v["bytes"] for v in corpus.cast_column("image", datasets.Image(decode=False))["image"]]
    workers = [int(w) for w in a.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        files = resolve_shards(write_shards(corpus, tmp, images_per_shard=max(1, a.images // 4)))
        sizes = read_shard_sizes(files)

        def stream(device_augmentation, num_workers):
            raw = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
            ds = StreamingTwoViewDataset(raw, augmentation, shard_sizes=sizes, shuffle_buffer=a.images)
            return ds.configure(a.batch_size, num_workers=num_workers, device_augmentation=device_augmentation).loader()

        def loader(dataset, num_workers):
            return torch.utils.data.DataLoader(dataset, batch_size=a.batch_size, num_workers=num_workers,
                                               collate_fn=None if not isinstance(dataset, TwoViewDataset) else
                                               torch.utils.data.default_collate)

        paths = {
            "(a) pil": lambda w: loader(PerImage(blobs, pil_views(augmentation)), w),
            "(b) map": lambda w: loader(TwoViewDataset(corpus, augmentation), w),
            "(b) stream": lambda w: stream(False, w),
            "(c) decode": lambda w: loader(PerImage(blobs, decode_only), w),
            "(d) workers": lambda w: stream(True, w),
        }
        rates = {name: {w: [] for w in workers} for name in paths}
        for _ in range(a.repeats):  # interleaved rounds: a load that changes during the run hits every path
            for w in workers:
                for name, make in paths.items():
                    rates[name][w].append(throughput(make(w), a.batch_size))
        results = {name: {w: float(np.median(r)) for w, r in row.items()} for name, row in rates.items()}
        batch = next(iter(stream(True, 0)))
        device = DeviceAugmentation(augmentation)
        device(batch["images"], batch["view_params"])  # warm-up
        start = time.perf_counter()
        for _ in range(5):
            device(batch["images"], batch["view_params"])
        device_rate = 5 * len(batch["images"]) / (time.perf_counter() - start)

    print(f"\n{a.images} JPEGs of 200-500 px, two views at {a.image_size} px, batch {a.batch_size}, "
          f"median of {a.repeats} interleaved rounds, 1 thread per process (CPU: {os.cpu_count()} cores)")
    header = "".join(f"{f'{w} workers':>12}{'/ (a)':>8}{'/ (c)':>8}" for w in workers)
    print(f"{'path':<14}{header}")
    for name, row in results.items():
        cells = "".join(f"{row[w]:>10.1f}/s{row[w] / results['(a) pil'][w]:>7.2f}x{row[w] / results['(c) decode'][w]:>7.2f}x"
                        for w in workers)
        print(f"{name:<14}{cells}")
    print(f"{'(d) device':<14}{device_rate:>10.1f}/s  (device part on the CPU, main process, 1 thread)")


if __name__ == "__main__":
    main()
