"""A streamed run stopped and resumed, on one process or under ``torchrun --nproc_per_node 2``.

    python tests/streaming/stream_run.py OUT_DIR SHARD_DIR --workers W --max_steps N --stop S [--device_augmentation]

Trains MoCo (test_resnet) on the webdataset shards in SHARD_DIR for N steps uninterrupted, then
again stopped after S steps and resumed from that checkpoint. Every rank writes both final states
(``{full,resumed}_rank<r>.safetensors``) and ``keys_rank<r>.json``: the sample keys of every step
of each run, the batches per epoch and the images each run decoded (workers: 0 only).
"""

import argparse
import glob
import json
import os
import sys

import datasets
import torch
from safetensors.torch import save_file

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    TwoViewAugmentation,
    distributed,
)
from hf_contrast.data.shards import read_shard_sizes
from hf_contrast.data.streaming import StreamingTwoViewDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: stop_at
from stop_at import StopAt  # noqa: E402

BATCH = 8


class RecordingTrainer(ContrastiveTrainer):
    """Records the keys of every batch the training step receives."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.keys.append(list(inputs["__key__"]))
        return super().training_step(model, inputs, num_items_in_batch)


def build(out_dir, shard_dir, workers, max_steps, save_steps, device_augmentation):
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32,
                                 queue_size=40, momentum=0.9))
    files = sorted(glob.glob(os.path.join(shard_dir, "*.tar")))
    stream = datasets.load_dataset("webdataset", data_files={"train": files}, split="train", streaming=True)
    train = StreamingTwoViewDataset(stream, TwoViewAugmentation.small_images(32), seed=0, shuffle_buffer=6,
                                    shard_sizes=read_shard_sizes(files), return_keys=True)
    args = ContrastiveTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=max_steps, learning_rate=0.05, optim="sgd",
        optim_args="momentum=0.9", logging_steps=1, save_strategy="steps", save_steps=save_steps, use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=workers, report_to="none",
        device_augmentation=device_augmentation,
    )
    trainer = RecordingTrainer(model=model, args=args, train_dataset=train)
    trainer.keys = []
    return trainer


def state(trainer):
    out = {"queue": trainer.model.queue.keys}
    out.update({f"model.{k}": v for k, v in trainer.model.state_dict().items()})
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main(out_dir, shard_dir, workers=0, max_steps=8, stop=3, device_augmentation=False):
    rank = int(os.environ.get("RANK", 0))
    full = build(os.path.join(out_dir, "full"), shard_dir, workers, max_steps, max_steps, device_augmentation)
    full.train()
    save_file(state(full), os.path.join(out_dir, f"full_rank{rank}.safetensors"))
    run_dir = os.path.join(out_dir, "run")
    interrupted = build(run_dir, shard_dir, workers, max_steps, stop, device_augmentation)
    interrupted.add_callback(StopAt(stop))
    interrupted.train()
    resumed = build(run_dir, shard_dir, workers, max_steps, stop, device_augmentation)
    resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{stop}"))
    assert resumed.state.global_step == max_steps
    save_file(state(resumed), os.path.join(out_dir, f"resumed_rank{rank}.safetensors"))
    record = {"full": full.keys, "interrupted": interrupted.keys, "resumed": resumed.keys,
              "batches_per_epoch": full.train_dataset.batches_per_epoch(),
              "decoded": {"full": full.train_dataset.decoded, "resumed": resumed.train_dataset.decoded}}
    with open(os.path.join(out_dir, f"keys_rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("shard_dir")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--stop", type=int, default=3)
    p.add_argument("--device_augmentation", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    main(a.out_dir, a.shard_dir, a.workers, a.max_steps, a.stop, a.device_augmentation)
    distributed.shutdown()
