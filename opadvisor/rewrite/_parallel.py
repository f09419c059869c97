"""What the data-parallel codemods (issue 34) share: the names DDP and fully_shard are reached by, and the
wrapper's call on a statement."""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst as cst

from opadvisor.rewrite._args import append_keywords, has_star_args, keyword, layout, replace_keyword_value
from opadvisor.rewrite._match import code, nodes_of, resolves_to

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


def set_flag(
    codemod: RuleCodemod, original: cst.Call, updated: cst.Call, name: str, value: bool, why: str
) -> cst.Call:
    """`updated` with `name=value`: the keyword appended, or its literal opposite flipped (a change noted with
    `why`); left alone where it already holds `value` (`already`), where its value is some expression, and
    where the call passes `**kwargs` without it (both skipped with the reason)."""
    want, other = str(value), str(not value)
    arg = keyword(original, name)
    if arg is None:
        star = has_star_args(original)
        if star:
            codemod.skip(original, f"the call passes {star}, which may set {name}: set it there")
            return updated
        codemod.record_change(original, f"{name}={want}: {why}")
        return append_keywords(updated, [(name, cst.Name(want))], **layout(codemod, original))
    given = code(arg.value)
    if given == want:
        codemod.already = f"{name}={want} in the call"
        return updated
    if given != other:
        codemod.skip(original, f"{name}={given} is no literal: set it to {want} where that value comes from")
        return updated
    codemod.record_change(original, f"{name}={other} -> {want}: {why}")
    return replace_keyword_value(updated, name, cst.Name(want))


__all__ = ["DDP_NAMES", "FULLY_SHARD_NAMES", "calls_to", "set_flag", "targeted_call", "targeted_ddp_call"]
