"""Unreadable images and broken shards: found before the first step, named, or skipped and counted."""

import io
import os
import tarfile

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_contrast import (
    ShardError,
    TwoViewAugmentation,
    UnreadableImageError,
    check_images,
    check_shards,
    two_view_dataset,
    write_shards,
)
from hf_contrast.data.shards import read_shard_sizes, resolve_shards
from hf_contrast.data.streaming import StreamingTwoViewDataset


def jpeg(seed: int, size=(24, 20)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def decodes(source) -> bool:
    """The reference: PIL's full decode, as training does it."""
    try:
        with Image.open(source) as image:
            image.load()
        return True
    except Exception:
        return False


@pytest.fixture
def folder(tmp_path):
    """An image folder of 8 JPEGs and PNGs: one JPEG cut in half (the issue's case), one PNG cut in half, one
    JPEG cut by 2 bytes (only its EOI marker gone), one JPEG with data after its end (a "motion photo",
    readable), and a text file named .jpg."""
    for label in ("a", "b"):
        (tmp_path / "img" / label).mkdir(parents=True)
    for i in range(8):
        data = png(i) if i % 4 == 3 else jpeg(i)
        name = tmp_path / "img" / "ab"[i % 2] / f"{i}.{'png' if i % 4 == 3 else 'jpg'}"
        if i in (1, 3):
            data = data[:len(data) // 2]
        elif i == 4:
            data = data[:-2]
        elif i == 6:
            data = data + b"\x00\x00\x00\x18ftypmp42" + bytes(200)
        name.write_bytes(data)
    (tmp_path / "img" / "a" / "8.jpg").write_text("<html>Not found</html>")
    return tmp_path / "img"


def test_image_folder_check_names_exactly_the_files_a_full_decode_rejects(folder):
    ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    paths = [v["path"] for v in ds.cast_column("image", datasets.Image(decode=False))["image"]]
    expected = sorted((p for p in paths if not decodes(p)), key=os.path.basename)  # reference: decode every file
    assert [os.path.basename(p) for p in expected] == ["1.jpg", "3.png", "4.jpg", "8.jpg"]
    with pytest.raises(UnreadableImageError, match=r"(?s)4 of 9 images.*1\.jpg.*Truncated File Read.*skip_bad_samples=4") as caught:
        check_images(ds)
    for p in expected:
        assert p in str(caught.value)
    report = check_images(ds, max_bad=4, num_threads=2)
    assert sorted((b.path for b in report.bad), key=os.path.basename) == expected and report.checked == 9
    assert [ds_index for ds_index in (b.index for b in report.bad)] == [paths.index(b.path) for b in report.bad]
    assert report.decoded < 9  # the good files with a complete end were not decoded
    assert check_images(ds, max_bad=4, decode_sample=9).decoded == 9


def test_hub_style_embedded_bytes_and_a_two_view_dataset_use_its_budget():
    values = [{"bytes": png(i) if i % 2 else jpeg(i), "path": None} for i in range(6)]
    values[4]["bytes"] = values[4]["bytes"][:100]  # a JPEG cut inside its data
    ds = datasets.Dataset.from_dict({"img": values, "label": list(range(6))},
                                    features=datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")}))
    with pytest.raises(UnreadableImageError, match=r"image 4: OSError"):
        check_images(ds)
    views = two_view_dataset(ds, TwoViewAugmentation.small_images(16), skip_bad_samples=1)
    assert [b.index for b in check_images(views).bad] == [4]  # within the dataset's budget: no error


def test_skip_bad_samples_replaces_with_the_next_readable_image_and_counts_across_workers(folder):
    ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    paths = [v["path"] for v in ds.cast_column("image", datasets.Image(decode=False))["image"]]
    bad = sorted(i for i, p in enumerate(paths) if not decodes(p))
    aug = TwoViewAugmentation.small_images(16)
    views = two_view_dataset(ds, aug, skip_bad_samples=len(bad))
    loader = torch.utils.data.DataLoader(views, batch_size=3, num_workers=2, collate_fn=list)
    ids = [int(item["instance_id"]) for batch in loader for item in batch]
    readable = [i for i in range(len(paths)) if i not in bad]
    expected = [i if i in readable else next((j for j in readable if j > i), readable[0]) for i in range(len(paths))]
    assert ids == expected  # each bad image replaced by the next readable one (cyclically)
    assert views.skipped_samples == len(bad) and views.skipped_sample_ids() == bad  # seen from the main process
    assert views.__getitems__([0, 1])[1]["pixel_values"].shape == (3, 16, 16)
    strict = two_view_dataset(ds, aug, skip_bad_samples=len(bad) - 1)
    with pytest.raises(UnreadableImageError, match=rf"Image {bad[-1]} .*\({paths[bad[-1]]}\).*over skip_bad_samples"):
        strict.__getitems__(list(range(len(paths))))
    with pytest.raises(UnreadableImageError, match=rf"Image {bad[0]} of column 'image' cannot be read \(.*--skip_bad"):
        two_view_dataset(ds, aug).__getitems__([bad[0]])


def shard_dir(digits, tmp_path, bad_image: int | None = None):
    ds = digits["train"].select(range(30))
    if bad_image is not None:  # a JPEG cut short inside an intact tar
        raw = ds.cast_column("image", datasets.Image(decode=False))
        values = list(raw["image"])
        values[bad_image] = {"bytes": jpeg(0, (40, 40))[:300], "path": None}
        ds = datasets.Dataset.from_dict({"image": values, "label": ds["label"]},
                                        features=datasets.Features({"image": datasets.Image(), "label": ds.features["label"]}))
    write_shards(ds, str(tmp_path), images_per_shard=10)
    return resolve_shards(str(tmp_path / "*.tar"))


def stream(files, **kwargs):
    data = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    return StreamingTwoViewDataset(data, TwoViewAugmentation.small_images(16), shard_sizes=read_shard_sizes(files),
                                   return_keys=True, shuffle_buffer=4, **kwargs)


@pytest.mark.parametrize("cut", ["data", "header"])
def test_a_truncated_shard_is_named_before_training_and_while_streaming(digits, tmp_path, cut):
    """The issue's case ("data": cut inside a JPEG, tarfile.ReadError: unexpected end of data, naming no
    shard) and a cut inside a member header (tarfile then ends the archive without a word)."""
    files = shard_dir(digits, tmp_path)
    assert check_shards(files, read_shard_sizes(files)).samples == [10, 10, 10]
    with tarfile.open(files[1]) as tar:
        member = tar.getmembers()[12]  # sample 6's JPEG
    end = member.offset_data + member.size // 2 if cut == "data" else member.offset + 100
    with open(files[1], "r+b") as f:  # as an interrupted copy leaves it
        f.truncate(end)
    with pytest.raises(ShardError, match=r"shard-000001\.tar is unreadable after 6 samples.*truncated.*write_shards"):
        check_shards(files)  # the tar alone, no sizes.json
    with pytest.raises(ShardError, match=r"shard-000001\.tar"):
        stream(files).configure(batch_size=5)  # the pre-flight at configure: before any step
    unchecked = stream(files, check_shards=False).configure(batch_size=5, num_workers=1)
    message = "cannot be read at sample 6 of 10" if cut == "data" else "ended after 6 samples"
    with pytest.raises(ShardError, match=rf"Shard .*shard-000001\.tar {message}.*write_shards"):
        list(unchecked.loader())  # raised in the DataLoader worker, naming the shard and the position


def test_undecodable_stream_samples_are_replaced_within_the_batch_counted_and_resumed_exactly(digits, tmp_path):
    files = shard_dir(digits, tmp_path, bad_image=13)  # sample 3 of shard 1
    with pytest.raises(UnreadableImageError, match=r"Sample '000000013' \(sample 3 of shard .*shard-000001\.tar\)"):
        list(stream(files).configure(batch_size=5).loader())
    ds = stream(files, skip_bad_samples=1).configure(batch_size=5)
    loader = ds.loader()
    epochs = [[b["__key__"] for b in loader] for _ in range(2)]
    for keys in epochs:
        flat = [k for batch in keys for k in batch]
        assert len(keys) == 6 and all(len(batch) == 5 for batch in keys) and "000000013" not in flat
        assert sorted(set(flat)) == sorted({f"{i:09d}" for i in range(30)} - {"000000013"})
        batch = next(b for b in keys if len(set(b)) == 4)  # the one with the replaced sample
        twice = [i for i, k in enumerate(batch) if batch.count(k) == 2]
        assert twice[1] == twice[0] + 1 or twice == [0, 4]  # replaced by the next sample of its batch, cyclically
    assert ds.skipped_samples == 1 and ds.skipped_sample_ids() == [13]  # distinct: once over two epochs
    state = {**ds.state_dict(), "epoch": 1, "batches": 2}
    assert state["skipped"] == [13]
    resumed = stream(files, skip_bad_samples=1).configure(batch_size=5)
    resumed.load_state_dict(state)
    assert [b["__key__"] for b in resumed.loader()] == epochs[1][2:] and resumed.skipped_samples == 1


def test_evaluation_names_an_unreadable_file(folder):
    """The issue's run died in the end-of-run kNN with PIL's bare "Truncated File Read"."""
    from hf_contrast import eval_dataset

    ds = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    paths = [v["path"] for v in ds.cast_column("image", datasets.Image(decode=False))["image"]]
    ev = eval_dataset(ds, TwoViewAugmentation.small_images(16))
    assert ev[0]["pixel_values"].shape == (3, 16, 16) and ev[0]["labels"] == ds[0]["label"]
    bad = next(i for i, p in enumerate(paths) if p.endswith("1.jpg"))
    with pytest.raises(UnreadableImageError, match=rf"\({paths[bad]}\): OSError: Truncated File Read.*check_images"):
        ev[bad]
