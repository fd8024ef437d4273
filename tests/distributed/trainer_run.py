"""Run under ``torchrun --nproc_per_node 2``: a few ContrastiveTrainer steps of MoCo (test_resnet, so
BatchNorm and cross-process shuffle-BN are exercised) and of SimCLR. Every rank writes its MoCo
queue, queue pointer and key-side parameters to ``OUT/moco_rank<r>.safetensors`` and the logged
negative counts to ``OUT/<method>_rank<r>.json``; tests check they agree across ranks."""

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
    SimCLRConfig,
    SimCLRModel,
    distributed,
)

TINY = dict(projection_hidden_dim=32, projection_dim=16, image_size=32)


def dataset(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    return datasets.Dataset.from_dict({"pixel_values": x.numpy(), "pixel_values_2": (x + 0.1 * torch.randn_like(x)).numpy(),
                                       "instance_id": list(range(n))}).with_format("torch")


def run(method: str, out_dir: str) -> ContrastiveTrainer:
    torch.manual_seed(0)
    if method == "moco":
        model = MoCoModel(MoCoConfig(backbone="test_resnet", queue_size=20, momentum=0.9, **TINY))
    else:
        model = SimCLRModel(SimCLRConfig(backbone="test_resnet", **TINY))
    args = ContrastiveTrainingArguments(
        output_dir=os.path.join(out_dir, method), per_device_train_batch_size=4, max_steps=6, learning_rate=0.05,
        logging_steps=2, save_strategy="steps", save_steps=3, use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, report_to="none",
    )
    trainer = ContrastiveTrainer(model=model, args=args, train_dataset=dataset())
    trainer.train()
    rank = distributed.rank()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out_dir, f"{method}_rank{rank}.json"), "w") as f:
        json.dump({"logs": logs, "negatives_per_anchor": trainer.negatives_per_anchor(),
                   "world_size": trainer.args.world_size}, f)
    if method == "moco":
        state = {"queue": model.queue.keys, "queue_ptr": model.queue.ptr, "queue_filled": model.queue.filled,
                 "queue_ids": model.queue.instance_ids}
        state.update({f"key.{i}": p.detach() for i, p in enumerate(model.key_parameters())})
        state.update({f"query.{i}": p.detach() for i, p in enumerate(model.query_parameters())})
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, f"moco_rank{rank}.safetensors"))
    return trainer


if __name__ == "__main__":
    for method in ("moco", "simclr"):
        run(method, sys.argv[1])
    distributed.shutdown()
