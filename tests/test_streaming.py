"""Streamed training on webdataset shards the tests write from the digits: exact resume that decodes
only what it trains, the split by rank and worker under torchrun, clear errors before training."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    TwoViewAugmentation,
    two_view_dataset,
    write_shards,
)
from hf_contrast.data.shards import read_shard_sizes, resolve_shards
from hf_contrast.data.streaming import StreamingError, StreamingTwoViewDataset

SCRIPT = Path(__file__).parent / "streaming" / "stream_run.py"


def run_module():
    spec = importlib.util.spec_from_file_location("stream_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shards(digits, directory: Path, images: int, per_shard: int) -> Path:
    write_shards(digits["train"].select(range(images)), str(directory), images_per_shard=per_shard)
    return directory


def assert_bitwise_equal(out: Path, rank: int = 0) -> None:
    full, resumed = load_file(out / f"full_rank{rank}.safetensors"), load_file(out / f"resumed_rank{rank}.safetensors")
    different = [k for k in full if not torch.equal(full[k], resumed[k])]
    assert set(full) == set(resumed) and not different, f"differ after resume: {different[:3]}"


@pytest.mark.parametrize("workers,device_augmentation", [(0, False), (2, True)])
def test_resume_is_exact_across_an_epoch_and_decodes_only_what_it_trains(digits, tmp_path, workers,
                                                                          device_augmentation):
    data = shards(digits, tmp_path / "shards", images=40, per_shard=20)
    max_steps, stop = 8, 3  # epochs of 5 (0 workers) or 4 (2 workers x 2 batches) steps: resume crosses one
    run_module().main(str(tmp_path / "out"), str(data), workers, max_steps, stop, device_augmentation)
    assert_bitwise_equal(tmp_path / "out")
    record = json.loads((tmp_path / "out" / "keys_rank0.json").read_text())
    assert record["interrupted"] == record["full"][:stop] and record["resumed"] == record["full"][stop:]
    per_epoch = record["batches_per_epoch"]
    assert per_epoch == (5 if workers == 0 else 4)
    first = [k for batch in record["full"][:per_epoch] for k in batch]
    assert len(first) == len(set(first)) == per_epoch * 8  # an epoch reads each sample once
    if workers == 0:
        assert sorted(first) == [f"{i:09d}" for i in range(40)]
        assert record["decoded"] == {"full": max_steps * 8, "resumed": (max_steps - stop) * 8}  # no replay
    second = record["full"][per_epoch:]
    assert second != record["full"][:len(second)]  # a new epoch brings a new order


def test_ranks_read_disjoint_halves_of_the_corpus_with_equal_steps_under_torchrun(digits, tmp_path):
    data = shards(digits, tmp_path / "shards", images=64, per_shard=16)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           str(tmp_path / "out"), str(data), "--workers", "1", "--max_steps", "8", "--stop", "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads((tmp_path / "out" / f"keys_rank{r}.json").read_text()) for r in (0, 1)]
    assert [len(r["full"]) for r in records] == [8, 8]  # equal steps on every rank
    per_epoch = records[0]["batches_per_epoch"]
    assert per_epoch == records[1]["batches_per_epoch"] == 4  # 2 shards of 16 per rank, batch 8
    for epoch in range(2):
        window = slice(epoch * per_epoch, (epoch + 1) * per_epoch)
        seen = [{k for batch in r["full"][window] for k in batch} for r in records]
        assert not seen[0] & seen[1]  # disjoint...
        assert sorted(seen[0] | seen[1]) == [f"{i:09d}" for i in range(64)]  # ...and together the whole corpus
    for rank in (0, 1):
        assert_bitwise_equal(tmp_path / "out", rank)


def stream_trainer(directory: Path, **overrides):
    files = resolve_shards(str(directory / "*.tar"))
    stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    train = two_view_dataset(stream, TwoViewAugmentation.small_images(32), shard_sizes=read_shard_sizes(files))
    assert isinstance(train, StreamingTwoViewDataset)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32,
                                 queue_size=40))
    args = ContrastiveTrainingArguments(output_dir=str(directory / "out"), per_device_train_batch_size=8,
                                        use_cpu=True, report_to="none", **overrides)
    return ContrastiveTrainer(model=model, args=args, train_dataset=train)


def test_too_few_shards_or_no_max_steps_fail_before_training(digits, tmp_path):
    data = shards(digits, tmp_path, images=40, per_shard=20)  # 2 shards
    with pytest.raises(StreamingError, match=r"2 shards but 1 processes x 3 DataLoader workers.*images_per_shard"):
        stream_trainer(data, max_steps=4, dataloader_num_workers=3)
    with pytest.raises(ValueError, match="max_steps"):
        stream_trainer(data)
    with pytest.raises(StreamingError, match="split_dataset_by_node"):
        from datasets.distributed import split_dataset_by_node

        stream = datasets.load_dataset("webdataset", data_files={"train": resolve_shards(str(data / "*.tar"))},
                                       split="train", streaming=True)
        StreamingTwoViewDataset(split_dataset_by_node(stream, rank=0, world_size=2), TwoViewAugmentation())


class PidRecordingStream(StreamingTwoViewDataset):
    """Adds the process id of the worker that made each batch."""

    def __iter__(self):
        for batch in super().__iter__():
            batch["pid"] = torch.tensor(os.getpid())
            yield batch


def test_workers_persist_across_epochs_and_batches_stay_in_order(digits, tmp_path):
    data = shards(digits, tmp_path, images=32, per_shard=8)  # 4 shards: 2 workers x 2 shards of 8, batch 4
    files = resolve_shards(str(data / "*.tar"))
    stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    ds = PidRecordingStream(stream, TwoViewAugmentation.small_images(16), shard_sizes=read_shard_sizes(files),
                            return_keys=True).configure(batch_size=4, num_workers=2, device_augmentation=True)
    loader = ds.loader()
    epochs = [list(loader) for _ in range(3)]
    assert [len(e) for e in epochs] == [ds.batches_per_epoch(e) for e in range(3)] == [8, 8, 8]
    pids = {int(b["pid"]) for e in epochs for b in e}
    assert len(pids) == 2 and os.getpid() not in pids  # the same two worker processes in every epoch
    assert loader.iterators_created == 1
    for epoch in epochs:  # each epoch still reads every sample once, in a new order
        keys = [k for b in epoch for k in b["__key__"]]
        assert sorted(keys) == [f"{i:09d}" for i in range(32)]
    assert [k for b in epochs[0] for k in b["__key__"]] != [k for b in epochs[1] for k in b["__key__"]]
    assert ds.state_dict()["epoch"] == 3 and ds.state_dict()["batches"] == 0
    fresh = StreamingTwoViewDataset(stream, TwoViewAugmentation.small_images(16), shard_sizes=read_shard_sizes(files),
                                    return_keys=True).configure(batch_size=4, num_workers=2, device_augmentation=True)
    fresh.load_state_dict({**ds.state_dict(), "epoch": 2, "batches": 1})  # a resumed run: new workers, same batches
    resumed = list(fresh.loader())
    assert [b["__key__"] for b in resumed] == [b["__key__"] for b in epochs[2][1:]]
    assert all(torch.equal(a["view_params"], b["view_params"]) for a, b in zip(resumed, epochs[2][1:], strict=True))
    loader.close()


def test_an_abandoned_pass_frees_the_workers_and_the_next_resumes_in_order(digits, tmp_path):
    data = shards(digits, tmp_path, images=32, per_shard=8)
    files = resolve_shards(str(data / "*.tar"))
    stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    ds = StreamingTwoViewDataset(stream, TwoViewAugmentation.small_images(16), shard_sizes=read_shard_sizes(files),
                                 return_keys=True).configure(batch_size=4, num_workers=2, device_augmentation=True)
    loader = ds.loader()
    whole = [b["__key__"] for b in loader]  # epoch 0
    passes = iter(loader)  # epoch 1, stopped after 3 batches (as the trainer at max_steps)
    first = [next(passes)["__key__"] for _ in range(3)]
    passes.close()
    assert loader._iterator is None and ds.state_dict()["batches"] == 3  # workers shut down, position kept
    rest = [b["__key__"] for b in loader]
    assert len(first + rest) == len(whole) and sorted(k for b in first + rest for k in b) == sorted(
        k for b in whole for k in b)
    assert loader.iterators_created == 2
