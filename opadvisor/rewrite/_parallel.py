"""What the data-parallel codemods (issue 34) share: the names DDP and fully_shard are reached by, and the
wrapper's call on a statement."""

from __future__ import annotations

import libcst as cst

from opadvisor.rewrite._match import nodes_of, resolves_to

DDP_NAMES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.parallel.DDP",
    }
)
FULLY_SHARD_NAMES = frozenset(
    {
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard.fully_shard",
        "torch.distributed.fsdp._fully_shard.fully_shard",
        "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard",
    }
)


def calls_to(visitor: cst.MetadataDependent, root: cst.CSTNode, names: frozenset[str]) -> list[cst.Call]:
    """The calls under `root` (an original node) whose function resolves to one of `names`."""
    return [c for c in nodes_of(root, cst.Call) if resolves_to(visitor, c.func, names)]


__all__ = ["DDP_NAMES", "FULLY_SHARD_NAMES", "calls_to"]
