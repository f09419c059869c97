"""What the data-parallel codemods (issue 34) share: the names DDP and fully_shard are reached by, and the
wrapper's call on a statement."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from opadvisor.rewrite._match import nodes_of, resolves_to

if TYPE_CHECKING:
    from opadvisor.rewrite.base import RuleCodemod, Target

DDP_NAMES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
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


def targeted_call(codemod: RuleCodemod, node: cst.Call, names: frozenset[str]) -> Target | None:
    """The profile's target a call (an original node) to one of `names` answers, marked answered; None for
    any other call, one no target names, or a codemod without targets."""
    if codemod.targets is None or not resolves_to(codemod, node.func, names):
        return None
    target = codemod.targeted(node)
    if target is not None:
        codemod.answered.add(target)
    return target


def targeted_ddp_call(codemod: RuleCodemod, node: cst.Call) -> Target | None:
    """`targeted_call` for a `DistributedDataParallel(...)` call."""
    return targeted_call(codemod, node, DDP_NAMES)


__all__ = ["DDP_NAMES", "FULLY_SHARD_NAMES", "calls_to", "targeted_call", "targeted_ddp_call"]
