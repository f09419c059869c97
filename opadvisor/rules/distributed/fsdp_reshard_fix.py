"""Codemod for `fsdp_reshard`: `reshard_after_forward=False` in the reported `fully_shard(...)` calls.

Profile mode only (the profile proved the backward gathered these units again and that memory allows
keeping them). Each target is the statement of a reported call; the call gets the keyword, or its
literal `True` becomes `False`:

    fully_shard(block)                              ->  fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=True)  ->  fully_shard(model, reshard_after_forward=False)

Refused (left alone, with the reason): a value that is not a literal True (`reshard_after_forward=args.r`:
change it where it is set), a call with `**kwargs` and no `reshard_after_forward=` (they may set it).

Fix safety: unsafe (the same values, but the unsharded parameters stay in memory from forward to backward).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod
from opadvisor.rewrite.toolkit import FULLY_SHARD_NAMES, set_flag, targeted_call

KEYWORD = "reshard_after_forward"
CHANGE = "the gathered parameters stay from forward to backward: no all-gather in backward"


class FsdpReshardCodemod(RuleCodemod):
    """`reshard_after_forward=False` in the targeted fully_shard(...) calls."""

    RULE: ClassVar[str] = "fsdp_reshard"
    SAFETY: ClassVar[str] = "unsafe"
    STATIC_MODE: ClassVar[bool] = False
    COMPOSES: ClassVar[bool] = True  # fsdp_fp32_gather adds mp_policy to the same calls
    NO_KERNEL_OP: ClassVar[str] = "an FSDP setting, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if targeted_call(self, original_node, FULLY_SHARD_NAMES) is None:
            return updated_node
        return set_flag(self, original_node, updated_node, KEYWORD, False, CHANGE)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no fully_shard(...) call on these lines")
        return updated_node
