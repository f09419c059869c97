"""Codemod for `fused_cross_entropy`: `F.cross_entropy(...)` calls `opadvisor.kernels.cross_entropy(...)`.

Before::

    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

After::

    loss = cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

with `from opadvisor.kernels import cross_entropy` (or the file's own spelling of it). Only the callee
changes: `opadvisor.kernels.cross_entropy` has `F.cross_entropy`'s signature and takes every argument as
it is (what it does not fuse, such as class weights or label smoothing, it hands to `F.cross_entropy`), so
the arguments, their comments and layout stay as written. The function is found however it was imported
(`import torch.nn.functional as F`, `from torch.nn.functional import cross_entropy as ce`, `torch.nn.
functional.cross_entropy`).

A float32 copy of the logits made for the loss alone (`logits.float()`, `.to(torch.float32)`, anywhere in a
chain of views on the first argument: `logits.float().view(-1, V)`) is dropped where the call runs inside
`with torch.autocast(...)` with a 16-bit dtype and not switched off by an `enabled=` expression: the
kernel computes in float32 from the 16-bit logits, and autocast makes the loss float32 either way, so the
values are the same and the copy (tokens x vocabulary x 4 bytes, written, read, and its gradient cast back)
is saved. Outside autocast the cast stays: there it decides the loss's dtype.

Fix safety: safe. The fused loss computes log-sum-exp in float32 from the logits as they are: the same
function, more precisely than eager, which rounds the log-probabilities to the logits' 16-bit dtype
before the loss (also under autocast on CUDA); losses differ by at most half a bf16 step of their value.

In profile mode the findings name the calls over many classes on a GPU; in static mode every call is
rewritten (for few classes the bundled function calls `F.cross_entropy` itself). A target line holding
no functional call (an `nn.CrossEntropyLoss` module called there) is reported, not rewritten.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rewrite.toolkit import AUTOCASTS, float32_cast, keyword, reference, resolves_to

KERNEL = "opadvisor.kernels.cross_entropy"
CROSS_ENTROPY_FUNCS = frozenset({"torch.nn.functional.cross_entropy"})
LOSS_MODULES = frozenset({"torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss"})
HALF = frozenset({"torch.bfloat16", "torch.float16", "torch.half"})
VIEWS = frozenset({"view", "reshape", "flatten", "contiguous"})  # the chain a copy may sit in


class FusedCrossEntropyCodemod(RuleCodemod):
    RULE: ClassVar[str] = "fused_cross_entropy"
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("cross_?entropy",)  # F.cross_entropy, nn.CrossEntropyLoss
    SAFETY: ClassVar[str] = "safe"
    KERNEL_OP: ClassVar[str | tuple[str, ...] | None] = "cross_entropy"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        self._loss_module_line: int | None = None
        self._autocast_depth = 0  # enclosing `with` statements that surely run under 16-bit autocast
        return True

    def visit_With(self, node: cst.With) -> None:
        self._autocast_depth += self._half_autocast(node)

    def leave_With(self, original_node: cst.With, updated_node: cst.With) -> cst.With:
        self._autocast_depth -= self._half_autocast(original_node)
        return updated_node

    def _half_autocast(self, node: cst.With) -> bool:
        """Whether one of the `with`'s items is an autocast to a 16-bit dtype that is surely enabled."""
        return any(
            isinstance(item.item, cst.Call) and self._is_half_autocast(item.item) for item in node.items
        )

    def _is_half_autocast(self, call: cst.Call) -> bool:
        if not resolves_to(self, call.func, AUTOCASTS):
            return False
        enabled = keyword(call, "enabled")
        if enabled is not None and not (
            isinstance(enabled.value, cst.Name) and enabled.value.value == "True"
        ):
            return False
        dtype_arg = keyword(call, "dtype")
        dtype = dtype_arg.value if dtype_arg is not None else None
        positional = [a for a in call.args if a.keyword is None]
        if dtype is None and resolves_to(self, call.func, {"torch.autocast", "torch.amp.autocast"}):
            dtype = positional[1].value if len(positional) > 1 else None
        # no dtype: autocast's default, float16 on CUDA and bfloat16 on the CPU
        return dtype is None or resolves_to(self, dtype, HALF)

    def visit_Call(self, node: cst.Call) -> None:
        if self._loss_module_line is None and resolves_to(self, node.func, LOSS_MODULES):
            self._loss_module_line = self.lines_of(node)[0]
        if resolves_to(self, node.func, {KERNEL}):  # rewritten before: nothing to say about its line
            target = self.targeted(node)
            if target is not None:
                self.answered.add(target)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not resolves_to(self, original_node.func, CROSS_ENTROPY_FUNCS):
            return updated_node
        target = self.targeted(original_node)
        if target is None:
            return updated_node
        self.answered.add(target)
        words = "F.cross_entropy -> opadvisor.kernels.cross_entropy (one pass over the logits)"
        args = list(updated_node.args)
        first = original_node.args[0] if original_node.args else None
        if self._autocast_depth and first is not None and first.keyword is None and args[0].keyword is None:
            # read on the original node: qualified names are metadata of the original tree
            uncast = self._without_float_copy(first.value)
            if uncast is not None:
                args[0] = args[0].with_changes(value=uncast)
                words += "; the float32 copy of the logits dropped (autocast: the loss is float32 either way)"
        self.record_change(original_node, words)
        return updated_node.with_changes(func=reference(self.context, self._module, KERNEL), args=args)

    def _without_float_copy(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        """`node` with the float32 cast in its chain of views removed, or None where it has none."""
        uncast = float32_cast(self, node)
        if uncast is not None or not (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)):
            return uncast
        if node.func.attr.value not in VIEWS:
            return None
        inner = self._without_float_copy(node.func.value)
        return None if inner is None else node.with_changes(func=node.func.with_changes(value=inner))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(self._unmatched)
        return updated_node

    def _unmatched(self, target: Target) -> str:
        if self._loss_module_line is not None:
            return (
                "the loss here is not an F.cross_entropy call (the file builds nn.CrossEntropyLoss at line "
                f"{self._loss_module_line}): call opadvisor.kernels.cross_entropy(logits, target, ...) instead"
            )
        return "no F.cross_entropy call on this line to rewrite"
