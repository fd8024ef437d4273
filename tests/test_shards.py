"""Webdataset shards written from the embedded digits read back through datasets' streaming loader."""

import json
import sys

import datasets
import numpy as np
import pytest

from hf_contrast import write_shards
from hf_contrast.data.shards import read_shard_sizes, resolve_shards


def test_round_trip_through_streaming_webdataset(digits, tmp_path):
    ds = digits["train"].select(range(25))
    paths = write_shards(ds, str(tmp_path), images_per_shard=10)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert json.loads((tmp_path / "sizes.json").read_text()) == {
        "shard-000000.tar": 10, "shard-000001.tar": 10, "shard-000002.tar": 5}
    files = resolve_shards(str(tmp_path / "*.tar"))
    assert read_shard_sizes(files) == [10, 10, 5]
    stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    assert stream.num_shards == 3
    rows = list(stream)
    assert [r["cls"] for r in rows] == ds["label"]  # order and labels kept
    for row, image in zip(rows, ds["image"], strict=True):  # JPEG is lossy: close, not equal
        diff = np.abs(np.asarray(row["jpg"].convert("L"), dtype=float) - np.asarray(image, dtype=float))
        assert row["jpg"].size == image.size and diff.mean() < 3


def test_image_folder_and_bad_arguments(tmp_path):
    from PIL import Image

    for label in ("a", "b"):
        (tmp_path / "img" / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20 + i, 30), (i * 40, 0, 0)).save(tmp_path / "img" / label / f"{i}.png")
    paths = write_shards(str(tmp_path / "img"), str(tmp_path / "out"), images_per_shard=4)
    assert len(paths) == 2 and read_shard_sizes(paths) == [4, 2]
    stream = datasets.load_dataset("webdataset", data_files={"train": paths}, split="train", streaming=True)
    assert sorted(r["cls"] for r in stream) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="images_per_shard"):
        write_shards(str(tmp_path / "img"), str(tmp_path / "x"), images_per_shard=0)


def test_write_shards_script_refuses_abbreviated_flags_and_writes_the_digits(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "write_shards_script", Path(__file__).parents[1] / "training" / "write_shards.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(script)
    with pytest.raises(ValueError, match="not used by the HfArgumentParser: \\['--images_per', '500'\\]"):
        script.main(["--output_dir", str(tmp_path / "x"), "--images_per", "500"])  # prefix matching took it before
    assert not (tmp_path / "x").exists()
    paths = script.main(["--output_dir", str(tmp_path / "s"), "--split", "test", "--images_per_shard", "400"])
    assert len(paths) == 3 and read_shard_sizes(paths) == [400, 400, 200]  # the 1,000 held-out digits
