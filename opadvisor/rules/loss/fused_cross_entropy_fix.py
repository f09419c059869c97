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
from opadvisor.rewrite.toolkit import reference, resolves_to

KERNEL = "opadvisor.kernels.cross_entropy"
CROSS_ENTROPY_FUNCS = frozenset({"torch.nn.functional.cross_entropy"})
LOSS_MODULES = frozenset({"torch.nn.CrossEntropyLoss", "torch.nn.modules.loss.CrossEntropyLoss"})


class FusedCrossEntropyCodemod(RuleCodemod):
    RULE: ClassVar[str] = "fused_cross_entropy"
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("cross_?entropy",)  # F.cross_entropy, nn.CrossEntropyLoss
    SAFETY: ClassVar[str] = "safe"
    KERNEL_OP: ClassVar[str | tuple[str, ...] | None] = "cross_entropy"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        self._loss_module_line: int | None = None
        return True

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
        self.record_change(
            original_node, "F.cross_entropy -> opadvisor.kernels.cross_entropy (one pass over the logits)"
        )
        return updated_node.with_changes(func=reference(self.context, self._module, KERNEL))

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
