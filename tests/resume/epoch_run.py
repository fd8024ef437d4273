"""Exact resume past the first epoch, on one process or under ``torchrun --nproc_per_node 2``.

    python tests/resume/epoch_run.py OUT_DIR --workers W

Trains MoCo (test_resnet, real digits, real augmentation) for 3 epochs uninterrupted, then again
stopped one step into epoch 2 and resumed from that checkpoint; every rank writes both final
states to ``OUT_DIR/{full,resumed}_rank<r>.safetensors``.
"""

import argparse
import os
import sys

import torch
from safetensors.torch import save_file

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    TwoViewAugmentation,
    distributed,
    load_default_dataset,
    two_view_dataset,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: stop_at
from stop_at import StopAt  # noqa: E402

IMAGES, BATCH, EPOCHS = 48, 8, 3


def build(out_dir: str, workers: int, save_steps: int, max_steps: int) -> ContrastiveTrainer:
    torch.manual_seed(0)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32,
                                 queue_size=40, momentum=0.9))
    train = load_default_dataset()["train"].select(range(IMAGES))
    args = ContrastiveTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=max_steps, learning_rate=0.05, optim="sgd",
        optim_args="momentum=0.9", logging_steps=1, save_strategy="steps", save_steps=save_steps, use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=workers, dataloader_persistent_workers=workers > 0,
        report_to="none",
    )
    return ContrastiveTrainer(model=model, args=args,
                              train_dataset=two_view_dataset(train, TwoViewAugmentation.small_images(32)))


def state(trainer: ContrastiveTrainer) -> dict[str, torch.Tensor]:
    model = trainer.model
    out = {"queue": model.queue.keys, "queue_ptr": model.queue.ptr, "queue_ids": model.queue.instance_ids}
    out.update({f"model.{k}": v for k, v in model.state_dict().items()})
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def main(out_dir: str, workers: int) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))  # the process group starts with the first trainer
    steps_per_epoch = IMAGES // (BATCH * world)
    max_steps, stop = EPOCHS * steps_per_epoch, 2 * steps_per_epoch + 1  # stop one step into epoch 2
    rank = int(os.environ.get("RANK", 0))
    full = build(os.path.join(out_dir, "full"), workers, save_steps=max_steps, max_steps=max_steps)
    full.train()
    save_file(state(full), os.path.join(out_dir, f"full_rank{rank}.safetensors"))
    run_dir = os.path.join(out_dir, "run")
    interrupted = build(run_dir, workers, save_steps=stop, max_steps=max_steps)
    interrupted.add_callback(StopAt(stop))
    interrupted.train()
    resumed = build(run_dir, workers, save_steps=stop, max_steps=max_steps)
    resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{stop}"))
    assert resumed.state.global_step == max_steps
    save_file(state(resumed), os.path.join(out_dir, f"resumed_rank{rank}.safetensors"))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    main(a.out_dir, a.workers)
    distributed.shutdown()
