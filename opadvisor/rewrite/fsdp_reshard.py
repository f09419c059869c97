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

from opadvisor.rewrite._args import append_keywords, has_star_args, keyword, layout, replace_keyword_value
from opadvisor.rewrite._match import code
from opadvisor.rewrite._parallel import FULLY_SHARD_NAMES, targeted_call
from opadvisor.rewrite.base import RuleCodemod

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
        arg = keyword(original_node, KEYWORD)
        if arg is None:
            star = has_star_args(original_node)
            if star:
                self.skip(original_node, f"the call passes {star}, which may set {KEYWORD}: set it there")
                return updated_node
            self.record_change(original_node, f"{KEYWORD}=False: {CHANGE}")
            false = cst.Name("False")
            return append_keywords(updated_node, [(KEYWORD, false)], **layout(self, original_node))
        value = code(arg.value)
        if value == "False":
            self.already = f"{KEYWORD}=False in the fully_shard call"
            return updated_node
        if value != "True":
            self.skip(original_node, f"{KEYWORD}={value}: set it to False where that value comes from")
            return updated_node
        self.record_change(original_node, f"{KEYWORD}=True -> False: {CHANGE}")
        return replace_keyword_value(updated_node, KEYWORD, cst.Name("False"))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no fully_shard(...) call on these lines")
        return updated_node
