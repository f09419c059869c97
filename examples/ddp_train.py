"""Train a small MLP classifier with DistributedDataParallel on synthetic data, one process per rank.

    torchrun --nproc-per-node 2 examples/ddp_train.py --device cpu              # 2 CPU processes, gloo
    torchrun --nproc-per-node 2 examples/ddp_train.py --device cuda             # 2 GPUs, NCCL
    opadvisor profile --nproc-per-node 2 examples/ddp_train.py -- --device cpu  # what opadvisor finds in it
    python examples/ddp_train.py                                                # one process, no launcher

Plain PyTorch DDP: the process group comes from the launcher's environment (RANK, WORLD_SIZE,
MASTER_ADDR ...; a single process without a launcher makes a group of one), a DistributedSampler gives
each rank its own part of a fixed synthetic dataset, gradients are all-reduced in DDP's buckets during
backward, and rank 0 prints the loss averaged over the ranks. `--accum-steps K` accumulates gradients
over K micro-batches and skips the all-reduce of the first K-1 with `no_sync()`. `--slow-rank R
--slow-ms T` makes rank R sleep T ms in every step (a straggler, to see what the others' waiting looks
like).
"""

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class MLP(nn.Module):
    def __init__(self, features, hidden, layers, classes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(features if i == 0 else hidden, hidden) for i in range(layers))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def synthetic_dataset(n, features, classes, seed):
    """Points labelled by a fixed random linear map: learnable, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    w = torch.randn(features, classes, generator=gen)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def init_distributed(device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # started by torchrun (or opadvisor profile --nproc-per-node)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:  # a plain `python ddp_train.py`: a group of one, no network needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="per rank, per micro-batch")
    parser.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP gradient bucket size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-rank", type=int, default=None, help="this rank sleeps --slow-ms every step")
    parser.add_argument("--slow-ms", type=float, default=0.0)
    args = parser.parse_args()

    device = torch.device(args.device)
    rank, world_size = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)

    model = MLP(args.features, args.hidden, args.layers, args.classes).to(device)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    micro_batches = args.steps * args.accum_steps
    dataset = synthetic_dataset(
        args.batch * world_size * micro_batches, args.features, args.classes, args.seed
    )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    ddp.train()
    batches = iter(loader)
    for step in range(1, args.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for micro in range(args.accum_steps):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            # The last micro-batch's backward all-reduces the accumulated gradients; the others skip it.
            last = micro == args.accum_steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y) / args.accum_steps
                loss.backward()
            total += loss.detach()
        if rank == args.slow_rank and args.slow_ms > 0:
            time.sleep(args.slow_ms / 1000.0)
        optimizer.step()
        dist.all_reduce(total)  # the loss averaged over ranks, for the log line
        if rank == 0:
            print(f"step {step} loss {total.item() / world_size:.6f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
