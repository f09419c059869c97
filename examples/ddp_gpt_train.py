"""Train a GPT-style language model with DistributedDataParallel, written the common naive way.

    torchrun --nproc-per-node 2 examples/ddp_gpt_train.py --size tiny --device cpu     # 2 CPU processes, gloo
    torchrun --nproc-per-node 2 examples/ddp_gpt_train.py --size medium                # 2 GPUs, NCCL
    opadvisor profile --nproc-per-node 2 examples/ddp_gpt_train.py -- --size tiny --device cpu
    python examples/ddp_gpt_train.py --size tiny --device cpu                          # one process

What is naive about it (what `opadvisor suggest` finds): `find_unused_parameters=True` although every
parameter gets a gradient (DDP then traverses the autograd graph after every forward), a 1 MB gradient
bucket (`bucket_cap_mb=1`: many small all-reduces where 25 MB buckets would send a few), and gradients
accumulated over `--accum` micro-batches while every micro-batch's backward all-reduces them (no
`no_sync()`), and gradients kept beside DDP's buckets (no `gradient_as_bucket_view=True`: each reduced
gradient is copied back into `.grad`). `--size medium` is GPT-2-medium-sized (24 layers, 1024 wide, 16 heads, 1024 tokens);
`--size tiny` runs on a laptop CPU. Synthetic tokens, the same on every run; rank 0 prints the loss of
each optimizer step.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

SIZES = {  # vocab, context, width, layers, heads, micro-batch
    "tiny": (256, 32, 128, 4, 4, 4),
    "small": (50304, 1024, 768, 12, 12, 8),
    "medium": (50304, 1024, 1024, 24, 16, 4),
}


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def init_distributed(device):
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # torchrun (or opadvisor profile --nproc-per-node)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:  # a plain `python ddp_gpt_train.py`: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def batches(vocab, context, batch, rank, seed, device):
    """Synthetic next-token data: each rank its own stream, the same on every run."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        tokens = torch.randint(vocab, (batch, context + 1), generator=gen)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    rank, world_size = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    vocab, context, width, layers, heads, micro = SIZES[args.size]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(vocab, context, width, layers, heads).to(device)
    model = DDP(model, find_unused_parameters=True, bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    data = batches(vocab, context, micro, rank, args.seed, device)
    for step in range(1, args.steps + 1):
        total = 0.0
        for _micro_step in range(args.accum):
            x, y = next(data)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1)) / args.accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {total:.6f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
