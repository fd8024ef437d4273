"""Run under ``torchrun --nproc_per_node 2``: SimCLR without gathering (each rank's loss is its own), and
at the end of step 2 rank 1's projection head is poisoned with NaN, so only rank 1's loss is NaN at step 2;
the guard reports it at the next logging step (3).
Every rank writes the NonFiniteLossError it raised (or none) to ``OUT/nan_rank<r>.json``."""

import json
import os
import sys

import datasets
import torch
from transformers import TrainerCallback

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    NonFiniteLossError,
    SimCLRConfig,
    SimCLRModel,
    distributed,
)

TINY = dict(projection_hidden_dim=32, projection_dim=16, image_size=32)


class PoisonRank1(TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and distributed.rank() == 1:
            with torch.no_grad():
                next(self.model.projector.parameters()).fill_(float("nan"))


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": (x + 0.1).numpy()}).with_format("torch")
    model = SimCLRModel(SimCLRConfig(backbone="test_vit", gather_distributed=False, **TINY))
    args = ContrastiveTrainingArguments(
        output_dir=os.path.join(out_dir, "run"), per_device_train_batch_size=4, max_steps=5, learning_rate=0.01, logging_steps=3,
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, report_to="none",
    )
    trainer = ContrastiveTrainer(model=model, args=args, train_dataset=data, callbacks=[PoisonRank1(model)])
    error = None
    try:
        trainer.train()
    except NonFiniteLossError as e:
        error = str(e)
    with open(os.path.join(out_dir, f"nan_rank{distributed.rank()}.json"), "w") as f:
        json.dump({"error": error, "step": trainer.state.global_step}, f)


if __name__ == "__main__":
    main(sys.argv[1])
    distributed.shutdown()  # the trainer unreferenced: collected before the process group goes (see shutdown)
