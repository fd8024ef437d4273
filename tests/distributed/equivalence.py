"""Run under ``torchrun --nproc_per_node W``: one SimCLR and one MoCo step on this rank's shard of a
fixed global batch, in DDP. Rank 0 writes the mean loss, the DDP-averaged gradients, the negative
counts and MoCo's queue after the enqueue to ``OUT/<name>.safetensors``; tests compare them with
one process on the whole batch (tests/test_distributed.py)."""

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_contrast import MoCoConfig, MoCoModel, SimCLRConfig, SimCLRModel, distributed

TINY = dict(projection_hidden_dim=32, projection_dim=16, image_size=32)
N_GLOBAL = 8


def global_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N_GLOBAL, 3, 32, 32, generator=g), torch.randn(N_GLOBAL, 3, 32, 32, generator=g)


def build(name: str, **kw):
    torch.manual_seed(0)
    if name.startswith("simclr"):
        return SimCLRModel(SimCLRConfig(backbone="test_vit", projection_batch_norm=False, **TINY, **kw))  # no BN anywhere
    model = MoCoModel(MoCoConfig(backbone="test_vit", queue_size=12, momentum=0.9, **TINY, **kw))
    model.enqueue(torch.nn.functional.normalize(torch.randn(5, 16, generator=torch.Generator().manual_seed(2)), dim=1))
    return model


def step(model, x1, x2) -> dict[str, torch.Tensor]:
    """One DDP forward/backward (+ enqueue for MoCo); returns what rank 0 saves."""
    ddp = DDP(model) if distributed.is_distributed() else model
    out = ddp(x1, x2)
    out.loss.backward()
    loss = out.loss.detach().clone()
    if distributed.is_distributed():
        dist.all_reduce(loss)
        loss /= distributed.world_size()  # mean over all anchors of the global batch
    if out.queue_keys is not None:
        model.enqueue(distributed.gather_no_grad(out.queue_keys))
    result = {"loss": loss, "num_negatives": torch.as_tensor(out.num_negatives).clone()}
    result.update({f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    if hasattr(model, "queue"):
        result.update(queue=model.queue.keys.clone(), queue_ptr=model.queue.ptr.clone())
    return result


def main(out_dir: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, world = distributed.rank(), distributed.world_size()
    x1, x2 = global_batch()
    n = N_GLOBAL // world
    x1, x2 = x1[rank * n : (rank + 1) * n], x2[rank * n : (rank + 1) * n]  # (N, 3, 32, 32) this rank's shard
    runs = {"simclr": {}, "simclr_per_device": {"gather_distributed": False}, "moco": {}}
    for name, kw in runs.items():
        result = step(build(name, **kw), x1, x2)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in result.items()}, os.path.join(out_dir, f"{name}.safetensors"))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
