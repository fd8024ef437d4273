"""Run under ``torchrun --nproc_per_node W``: one MoCo v3 step in DDP on this rank's shard of a fixed
global batch, with a LayerNorm backbone (test_vit) and BatchNorm-free heads, so one process on the
whole batch is the exact reference (``mocov3_queue``: with a queue pre-filled identically on every rank,
two of its keys of the batch's own images, masked). Rank 0 writes the mean loss, the DDP-averaged gradients and the
negative count to ``OUT/<name>.safetensors`` (tests/test_mocov3_distributed.py compares)."""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_contrast import MoCoV3Config, MoCoV3Model, distributed

N_GLOBAL = 8
NO_BN = dict(projection_batch_norm=False, projection_output_batch_norm=False, predictor_batch_norm=False,
             predictor_output_batch_norm=False)


def build(**kw) -> MoCoV3Model:
    torch.manual_seed(0)
    model = MoCoV3Model(MoCoV3Config.for_backbone(
        "test_vit", projection_hidden_dim=32, projection_dim=16, predictor_hidden_dim=24, image_size=32, **NO_BN, **kw))
    with torch.no_grad():  # a momentum side that differs from the query side
        for p in model.key_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def main(out_dir: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = distributed.rank(), distributed.world_size()
    g = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(N_GLOBAL, 3, 32, 32, generator=g), torch.randn(N_GLOBAL, 3, 32, 32, generator=g)
    n = N_GLOBAL // world
    x1, x2 = x1[rank * n : (rank + 1) * n], x2[rank * n : (rank + 1) * n]  # (N, 3, 32, 32) this rank's shard
    ids = torch.arange(N_GLOBAL)[rank * n : (rank + 1) * n]  # (N,) global image ids
    queued = torch.randn(10, 16, generator=g)  # (10, D) the same on every rank, as after gathered enqueues
    queued_ids = torch.tensor([100, 1, 101, 102, 103, 5, 104, 105, 106, 107])  # images 1 and 5: one per rank
    configs = {"mocov3": {}, "mocov3_per_device": {"gather_distributed": False},
               "mocov3_attract": {"false_negatives": "attract", "false_negative_top_k": 2},
               "mocov3_queue": {"queue_size": 16}}
    for name, kw in configs.items():
        model = build(**kw)
        inputs = {}
        if model.has_queue:
            model.enqueue(queued, queued_ids)
            inputs = {"instance_ids": ids}
        ddp = DDP(model) if distributed.is_distributed() else model
        out = ddp(x1, x2, **inputs)
        out.loss.backward()
        loss = out.loss.detach().clone()
        if distributed.is_distributed():
            dist.all_reduce(loss)
            loss /= world  # mean over all queries of the global batch
        result = {"loss": loss, "num_negatives": torch.as_tensor(out.num_negatives).float()}
        result.update({f"grad.{k}": p.grad for k, p in model.named_parameters() if p.grad is not None})
        if rank == 0:
            save_file({k: v.contiguous() for k, v in result.items()}, os.path.join(out_dir, f"{name}.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
