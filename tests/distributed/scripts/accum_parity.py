"""Under torchrun (2 gloo ranks): the grad_accum_sync fixtures before and after the rewrite train the same
tiny model on the same per-rank data; the weights after the optimizer steps must agree (the same
gradients after each accumulation step), while the rewritten loops synchronise once per optimizer step.

    torchrun --nproc-per-node 2 tests/distributed/scripts/accum_parity.py

Prints one line per case on rank 0: `CASE max_weight_diff=... syncs_before=N syncs_after=M`; exits 1 on
a mismatch.
"""

import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

FIXTURES = Path(__file__).resolve().parents[2] / "rewrite" / "fixtures" / "grad_accum_sync"
ACCUM, STEPS, WIDTH = 3, 2, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def load(case: str, side: str) -> types.ModuleType:
    path = FIXTURES / f"{case}.{side}.py"
    spec = importlib.util.spec_from_file_location(f"{case}_{side}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: synchronisation matters
    return [(torch.randn(4, WIDTH, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


def run_ddp(side: str, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    data = iter(batches(rank, ACCUM * STEPS))
    load("ddp_range_form", side).train(net, data, STEPS, types.SimpleNamespace(accum=ACCUM), optimizer)
    return [p.detach().clone() for p in net.parameters()]


def run_fsdp(side: str, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    loader = [x for x, _ in batches(rank, ACCUM * STEPS)]
    module = load("fsdp_if_form", side)
    module.train(net, loader, ACCUM, lambda m: torch.optim.SGD(m.parameters(), lr=0.5))
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def syncs(run, side: str, rank: int) -> tuple[list[torch.Tensor], int]:
    """The weights, and the gradient collectives DDP's reducer / FSDP issued (c10d ops in the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        weights = run(side, rank)
    names = [e.name for e in prof.events()]
    grads = sum(
        1
        for n in names
        if n in ("c10d::allreduce_", "c10d::reduce_scatter_tensor_coalesced_", "c10d::_reduce_scatter_base_")
    )
    return weights, grads


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failed = False
    for case, run in (("ddp_range_form", run_ddp), ("fsdp_if_form", run_fsdp)):
        before, syncs_before = syncs(run, "in", rank)
        after, syncs_after = syncs(run, "out", rank)
        diff = max((a - b).abs().max().item() for a, b in zip(before, after, strict=True))
        torch.manual_seed(0)
        initial = [p.detach() for p in Net().parameters()]
        moved = max((a - b).abs().max().item() for a, b in zip(before, initial, strict=True))
        if rank == 0:
            print(
                f"{case} max_weight_diff={diff:.3g} moved={moved:.3g} syncs_before={syncs_before} syncs_after={syncs_after}",
                flush=True,
            )
        failed |= diff > 1e-5 or moved < 1e-3 or syncs_after >= syncs_before
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
