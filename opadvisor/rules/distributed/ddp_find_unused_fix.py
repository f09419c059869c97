"""Codemod for `ddp_find_unused`: drop `find_unused_parameters=True` from a DistributedDataParallel call.

Profile mode only (the profile proved that no parameter was unused). Each target is the statement that
built the DDP wrapper; the call (however DDP was imported: `from torch.nn.parallel import
DistributedDataParallel as DDP`, `torch.nn.parallel.DistributedDataParallel`) loses its keyword, in its
own layout (a trailing comma stays trailing):

    model = DDP(model, device_ids=[rank], find_unused_parameters=True)  ->  model = DDP(model, device_ids=[rank])

Refused (left alone, with the reason): a call with `**kwargs` (the flag may come from them), a value
other than the literal `True` (`find_unused_parameters=args.find_unused`: change it where it is set).

Fix safety: safe (the same gradients; should a later iteration leave a parameter unused, DDP raises).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod
from opadvisor.rewrite.toolkit import code, has_star_args, keyword, remove_keyword, targeted_ddp_call

KEYWORD = "find_unused_parameters"


class DdpFindUnusedCodemod(RuleCodemod):
    """`find_unused_parameters=True` removed from the targeted DDP(...) calls."""

    RULE: ClassVar[str] = "ddp_find_unused"
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False  # only where the profile saw no unused parameter
    COMPOSES: ClassVar[bool] = True  # ddp_small_bucket edits the same call
    NO_KERNEL_OP: ClassVar[str] = "a DDP setting, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if targeted_ddp_call(self, original_node) is None:
            return updated_node
        arg = keyword(original_node, KEYWORD)
        if arg is None:
            if has_star_args(original_node):
                self.skip(
                    original_node, f"the call passes {has_star_args(original_node)}: remove {KEYWORD} there"
                )
            else:
                self.already = f"no {KEYWORD}=True in the DDP call"
            return updated_node
        if code(arg.value) != "True":
            self.skip(
                original_node, f"{KEYWORD}={code(arg.value)}: set it to False where that value comes from"
            )
            return updated_node
        self.record_change(
            original_node, f"{KEYWORD}=True removed: no parameter was unused in the profiled steps"
        )
        return remove_keyword(updated_node, KEYWORD)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no DistributedDataParallel(...) call on these lines")
        return updated_node
