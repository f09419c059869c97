"""Codemod for `fsdp_fp32_gather`: a 16-bit MixedPrecisionPolicy for every fully_shard call of the file.

Profile mode only (the autocast dtype is the one the profile saw). One rewrite serves every finding of the
file (`FILE_LEVEL`): each `fully_shard(...)` call without `mp_policy=` gets

    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

(the profiled autocast dtype), in the call's own layout, and `MixedPrecisionPolicy` is imported from
`torch.distributed.fsdp` (and `torch` where the file does not import it). Every call of the file, so
that the per-block calls `fsdp_root_only` writes gather 16-bit parameters too.

Refused (left alone, with the reason): a call with `**kwargs` (it may set mp_policy).

Fix safety: unsafe (the forward sees 16-bit parameters also where autocast kept float32: norms, softmax,
the loss; gradients are still reduced in float32).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, target_facts
from opadvisor.rewrite.toolkit import (
    FULLY_SHARD_NAMES,
    append_keywords,
    has_star_args,
    keyword,
    layout,
    resolves_to,
    torch_binding,
)
from opadvisor.rules.distributed.parallel_facts import FsdpFacts

HALF = ("bfloat16", "float16")
POLICY_MODULE = "torch.distributed.fsdp"
POLICY = "MixedPrecisionPolicy"


class FsdpFp32GatherCodemod(RuleCodemod):
    """`mp_policy=MixedPrecisionPolicy(param_dtype=torch.<autocast>, reduce_dtype=torch.float32)` added."""

    RULE: ClassVar[str] = "fsdp_fp32_gather"
    FACTS = FsdpFacts
    SAFETY: ClassVar[str] = "unsafe"
    STATIC_MODE: ClassVar[bool] = False
    FILE_LEVEL: ClassVar[bool] = True  # every fully_shard call of the file, the per-block ones included
    COMPOSES: ClassVar[bool] = True  # fsdp_root_only inserts a loop before the same call
    NO_KERNEL_OP: ClassVar[str] = "an FSDP policy, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def __init__(self, context, targets=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(context, targets)
        self._dtype: str | None = None
        self._torch = "torch"

    def visit_Module(self, node: cst.Module) -> bool:
        if not self.targets:
            return False
        facts = [target_facts(t, FsdpFacts) for t in self.targets]
        dtypes = {f.autocast for f in facts if f is not None and f.autocast in HALF}
        if len(dtypes) != 1:
            for t in self.targets:
                self.skip_line(t.line, "the finding carries no 16-bit autocast dtype (profile again)")
            return False
        self._dtype = dtypes.pop()
        bound = [b for b in map(torch_binding, node.body) if b]
        self._torch = bound[0] if bound else "torch"
        return True

    def skip_line(self, line: int, reason: str) -> None:
        self.skipped.append(Note(line, reason))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self._dtype is None or not resolves_to(self, original_node.func, FULLY_SHARD_NAMES):
            return updated_node
        if keyword(original_node, "mp_policy") is not None:
            return updated_node
        if has_star_args(original_node):
            self.skip(
                original_node, f"the call passes {has_star_args(original_node)}, which may set mp_policy"
            )
            return updated_node
        torch = self._torch
        policy = cst.parse_expression(
            f"{POLICY}(param_dtype={torch}.{self._dtype}, reduce_dtype={torch}.float32)"
        )
        AddImportsVisitor.add_needed_import(self.context, POLICY_MODULE, POLICY)
        if torch == "torch" and self._torch_missing():
            AddImportsVisitor.add_needed_import(self.context, "torch")
        self.record_change(original_node, f"all-gathers in {self._dtype}, gradients reduced in float32")
        return append_keywords(updated_node, [("mp_policy", policy)], **layout(self, original_node))

    def _torch_missing(self) -> bool:
        module = self.context.module
        return module is None or not any(torch_binding(s) for s in module.body)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self._dtype is not None and not self.changes and not self.skipped:
            self.already = "every fully_shard call of the file has an mp_policy"
        return updated_node
