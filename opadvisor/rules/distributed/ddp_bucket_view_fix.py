"""Codemod for `ddp_bucket_view`: `gradient_as_bucket_view=True` in the reported DistributedDataParallel call.

Profile mode only (the profile showed DDP copying gradients back from its buckets). Each target is the
statement that built the DDP wrapper; the call gets the keyword, or its literal `False` becomes `True`:

    model = DDP(model, device_ids=[rank])
    ->  model = DDP(model, device_ids=[rank], gradient_as_bucket_view=True)

Refused (left alone, with the reason): a file that handles `.grad` in place (`x.grad.detach_()`,
`x.grad.requires_grad_(...)`, `x.grad.set_(...)`, an assignment of a tensor to `x.grad`: a bucket view
cannot be detached in place, and a replaced `.grad` is no view; `x.grad = None` is fine), a value that
is not a literal False, a call with `**kwargs` and no `gradient_as_bucket_view=`.

Fix safety: safe (the same gradients, held in the buckets instead of beside them).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod
from opadvisor.rewrite.toolkit import code, nodes_of, set_flag, targeted_ddp_call

KEYWORD = "gradient_as_bucket_view"
IN_PLACE = frozenset({"detach_", "requires_grad_", "set_"})  # what a bucket view of .grad does not allow
CHANGE = "the gradients become views of DDP's buckets: no copy back after the all-reduce"


class DdpBucketViewCodemod(RuleCodemod):
    """`gradient_as_bucket_view=True` in the targeted DDP(...) calls."""

    RULE: ClassVar[str] = "ddp_bucket_view"
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False
    COMPOSES: ClassVar[bool] = True  # ddp_find_unused / ddp_small_bucket edit the same call
    NO_KERNEL_OP: ClassVar[str] = "a DDP setting, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        found = grad_handled_in_place(node)
        if found is None:
            return True
        for t in self.targets or []:
            self.skipped.append(
                Note(t.line, f"the file handles .grad in place ({found}): {KEYWORD} left off")
            )
        return False

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if targeted_ddp_call(self, original_node) is None:
            return updated_node
        return set_flag(self, original_node, updated_node, KEYWORD, True, CHANGE)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no DistributedDataParallel(...) call on these lines")
        return updated_node


def grad_handled_in_place(module: cst.Module) -> str | None:
    """The first `<x>.grad.detach_(...)`-style call or `<x>.grad = <tensor>` assignment of the file, as
    code; None when there is none."""
    for call in nodes_of(module, cst.Call):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in IN_PLACE and _is_grad(func.value):
            return code(call)
    for assign in nodes_of(module, cst.Assign):
        for target in assign.targets:
            # `p.grad = None` is zero_grad(set_to_none=True) by hand: DDP makes the next .grad a view again
            if _is_grad(target.target) and code(assign.value) != "None":
                return f"{code(target.target)} = {code(assign.value)}"
    return None


def _is_grad(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Attribute) and node.attr.value == "grad"
