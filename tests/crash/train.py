"""A short, deterministic MoCo training run used by the resume and crash tests.

    python tests/crash/train.py OUT_DIR [--kill-while-saving STEP] [--resume]
    python tests/crash/train.py OUT_DIR --sigterm-in STEP [--workers 2] [--sigterm-group]

With ``--kill-while-saving STEP`` the process SIGKILLs itself in the middle of writing
checkpoint-STEP (after the weights, before optimizer, RNG and trainer state): a real process death
mid-checkpoint. At the end it writes the queue, key and query encoders and the loss trajectory to
``OUT_DIR/final_state.safetensors`` and ``OUT_DIR/losses.json``.

With ``--sigterm-in STEP`` the process sends itself SIGTERM during optimizer step STEP (with
``--sigterm-group``, to its whole process group: the DataLoader workers too, as ``kill -TERM -PGID`` or a
container stop does); the script runs through :func:`hf_contrast.cli.run_main`, as the training scripts do.
"""

import argparse
import json
import os
import signal
import sys

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    MoCoConfig,
    MoCoModel,
    TwoViewAugmentation,
    load_default_dataset,
    two_view_dataset,
)
from hf_contrast.cli import run_main

MAX_STEPS, SAVE_STEPS = 8, 3


class KillWhileSaving(ContrastiveTrainer):
    kill_at: int | None = None

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == self.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # model.safetensors is written, the rest is not
        super()._save_optimizer_and_scheduler(output_dir)


class SigtermIn(TrainerCallback):
    """SIGTERM to this process (or its group) at the start of optimizer step ``step`` (1-based)."""

    def __init__(self, step: int, group: bool, rank: int | None = None):
        self.step, self.group, self.rank = step, group, rank

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and self.rank in (None, args.process_index):
            if self.group:
                os.killpg(os.getpgid(0), signal.SIGTERM)
            else:
                os.kill(os.getpid(), signal.SIGTERM)


def build_trainer(out_dir: str, kill_at: int | None = None, workers: int = 0) -> ContrastiveTrainer:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = MoCoModel(MoCoConfig(backbone="test_resnet", projection_hidden_dim=32, projection_dim=16, image_size=32,
                                 queue_size=40, momentum=0.9, momentum_schedule="cosine", key_bn_splits=2))
    train = load_default_dataset()["train"].select(range(64))
    args = ContrastiveTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=16, max_steps=MAX_STEPS, learning_rate=0.05, optim="sgd",
        optim_args="momentum=0.9", lr_scheduler_type="cosine", logging_steps=1, save_strategy="steps",
        save_steps=SAVE_STEPS, use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=workers, report_to="none",
    )
    cls = KillWhileSaving if kill_at is not None else ContrastiveTrainer
    cls.kill_at = kill_at
    return cls(model=model, args=args,
               train_dataset=two_view_dataset(train, TwoViewAugmentation.small_images(32, crop_scale=(0.5, 1.0))))


def final_state(trainer: ContrastiveTrainer) -> dict[str, torch.Tensor]:
    model = trainer.model
    state = {"queue": model.queue.keys, "queue_ptr": model.queue.ptr, "queue_filled": model.queue.filled,
             "queue_ids": model.queue.instance_ids}
    state.update({f"key_encoder.{k}": v for k, v in model.key_encoder.state_dict().items()})
    state.update({f"encoder.{k}": v for k, v in model.encoder.state_dict().items()})
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def losses(trainer: ContrastiveTrainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--kill-while-saving", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sigterm-in", type=int, default=None)
    p.add_argument("--sigterm-group", action="store_true")
    p.add_argument("--sigterm-rank", type=int, default=None, help="Under torchrun: only this process is signalled.")
    p.add_argument("--workers", type=int, default=0)
    run_main(lambda argv: run(p.parse_args(argv)), p)


def run(a) -> None:
    trainer = build_trainer(a.out_dir, a.kill_while_saving, a.workers)
    if a.sigterm_in is not None:
        trainer.add_callback(SigtermIn(a.sigterm_in, a.sigterm_group, a.sigterm_rank))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    save_file(final_state(trainer), os.path.join(a.out_dir, "final_state.safetensors"))
    with open(os.path.join(a.out_dir, "losses.json"), "w") as f:
        json.dump(losses(trainer), f)


if __name__ == "__main__":
    main()
