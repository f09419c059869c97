"""A small FSDP2 model sharded one unit per block, the usual way (FSDP2's default reshard_after_forward:
each block frees its gathered parameters after forward and gathers them again in backward).

    torchrun --nproc-per-node 2 tests/distributed/scripts/fsdp_blocks.py    # 2 CPU processes, gloo
    torchrun --nproc-per-node 2 tests/distributed/scripts/fsdp_blocks.py --device cuda    # 2 GPUs, NCCL

Rank 0 prints the loss of each step; every rank its own synthetic batch, the same on every run.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

STEPS, WIDTH, BLOCKS, BATCH = 6, 64, 3, 8


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    device = torch.device(parser.parse_args().device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model().to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=gen).to(device)
        loss = (model(x) - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
