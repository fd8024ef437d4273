"""Run under ``torchrun --nproc_per_node 2``: gradient-cached SimCLR (test_vit, no BatchNorm) on this
rank's shard of a fixed global batch, in DDP, next to the plain DDP step; then a short
ContrastiveTrainer run with caching and gradient accumulation next to the same run without caching.

Rank 0 writes ``OUT/grad_cache.safetensors``: the cached step's mean loss, DDP-averaged gradients
(``grad.*``), negative count and number of DDP all-reduce calls, the plain step's all-reduce calls,
and the trainers' final weights (``cached.*``, ``plain.*``). Run without torchrun it does the same
on one process with the whole batch (the reference of tests/test_grad_cache.py).
"""

import os
import sys
import tempfile

import datasets
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_contrast import (
    ContrastiveTrainer,
    ContrastiveTrainingArguments,
    SimCLRConfig,
    SimCLRModel,
    distributed,
)
from hf_contrast.trainer.grad_cache import grad_cache_step

TINY = dict(projection_hidden_dim=32, projection_dim=16, image_size=32)
N_GLOBAL = 8
CHUNK = 3  # 4 images per rank: chunks of 3 and 1


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_GLOBAL, 3, 32, 32, generator=g), torch.randn(N_GLOBAL, 3, 32, 32, generator=g)


def build(**kw) -> SimCLRModel:
    torch.manual_seed(0)
    return SimCLRModel(SimCLRConfig(backbone="test_vit", projection_batch_norm=False, **TINY, **kw))


def counting_allreduce(state: dict, bucket):
    """DDP's default all-reduce, counted: how often DDP synchronised gradients."""
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def ddp_step(x1, x2, cached: bool) -> tuple[dict, int]:
    model = build()
    calls = {"calls": 0}
    wrapped = model
    if distributed.is_distributed():
        wrapped = DDP(model)
        wrapped.register_comm_hook(calls, counting_allreduce)
    if cached:
        out = grad_cache_step(wrapped, x1, x2, CHUNK)
    else:
        out = wrapped(x1, x2)
        out.loss.backward()
    loss = out.loss.detach().clone()
    if distributed.is_distributed():
        dist.all_reduce(loss)
        loss /= distributed.world_size()  # mean over all anchors of the global batch
    result = {"loss": loss, "num_negatives": torch.tensor(out.num_negatives)}
    result.update({f"grad.{n}": p.grad for n, p in model.named_parameters()})
    return result, calls["calls"]


def train(out_dir: str, cached: bool) -> dict:
    """Two optimizer steps of 2 micro-batches (4 images per process each) with SGD; final weights."""
    model = build(grad_cache_chunk_size=CHUNK if cached else None)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4 * N_GLOBAL, 3, 32, 32, generator=g)
    data = datasets.Dataset.from_dict(
        {"pixel_values": x.numpy(), "pixel_values_2": (x + 0.3 * torch.randn_like(x)).numpy()}
    )
    args = ContrastiveTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=N_GLOBAL // distributed.world_size(),
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=0.01,
        max_grad_norm=0.0,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        report_to="none",
    )
    ContrastiveTrainer(model=model, args=args, train_dataset=data.with_format("torch")).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(out_dir: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = distributed.rank(), distributed.world_size()
    x1, x2 = global_batch()
    n = N_GLOBAL // world
    x1, x2 = x1[rank * n : (rank + 1) * n], x2[rank * n : (rank + 1) * n]  # (N, 3, 32, 32) this rank's shard
    result, cached_calls = ddp_step(x1, x2, cached=True)
    _, plain_calls = ddp_step(x1, x2, cached=False)
    result.update(
        cached_allreduce_calls=torch.tensor(cached_calls), plain_allreduce_calls=torch.tensor(plain_calls)
    )
    with tempfile.TemporaryDirectory() as tmp:
        result.update({f"cached.{k}": v for k, v in train(tmp, cached=True).items()})
        result.update({f"plain.{k}": v for k, v in train(tmp, cached=False).items()})
    if rank == 0:
        save_file(
            {k: v.contiguous() for k, v in result.items()}, os.path.join(out_dir, "grad_cache.safetensors")
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
