"""A tiny DDP loop (gloo on CPU, NCCL with --device cuda) in which one rank fails at a chosen step.

    --crash-rank R --crash-step K --how raise|exit|kill|hang|block
raise: ValueError from the script; exit: sys.exit(3); kill: SIGKILL to itself (no Python cleanup, no
report); hang: rank R sleeps for an hour in Python while the others wait in the all-reduce; block: rank R
waits in C++ for a message nobody sends (no Python signal handler can run), the others in the all-reduce.
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--crash-rank", type=int, default=1)
parser.add_argument("--crash-step", type=int, default=3)
parser.add_argument("--how", default="raise")
parser.add_argument("--device", default="cpu")
parser.add_argument("--marker", default=None, help="touch this file when failing")
args = parser.parse_args()

device = torch.device(args.device)
if device.type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 8).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def fail_here(step):
    if args.marker:
        open(args.marker, "w").close()
    if args.how == "raise":
        raise ValueError(f"the user's own bug on rank {rank} at step {step}")
    if args.how == "exit":
        sys.exit(3)
    if args.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if args.how == "hang":
        time.sleep(3600)
    if args.how == "block":
        dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())


for step in range(1, args.steps + 1):
    if rank == args.crash_rank and step == args.crash_step:
        fail_here(step)
    model(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
