"""Codemod for `cudnn_rnn`: re-pack a recurrent layer's weights before the call that found them scattered.

Before::

    out, (h, c) = self.lstm(x)

After::

    self.lstm.flatten_parameters()
    out, (h, c) = self.lstm(x)

`flatten_parameters()` copies the weights into one contiguous buffer in place (the parameters stay the
same objects, so the optimizer keeps them), which is the buffer cuDNN's fused kernels read; it returns at
once when they are packed already (and does nothing on the CPU). Where a weight's data was replaced once
(`lstm.weight_hh_l0.data = ...`), the first call packs them and the later ones cost a pointer check;
where something replaces them at every step (a weight drop, DataParallel replicas), each call still packs
them once (flatten_parameters instead of cuDNN) and the saving is small: the finding's estimate says so.

Which calls: the findings whose facts' `problems` include "not_flat"; on their lines, a statement
calling `<...>.<name>(...)` where `<name>` is the last part of the profiled module's path (`self.lstm` for
"encoder.lstm"). A statement that `<...>.<name>.flatten_parameters()` already precedes is left as it is.
Findings about float32 or cuDNN being off are display only (no change). Without a profile (static mode)
nothing is rewritten: whether the weights are packed is known only at run time.

Fix safety: safe (the same values; only where they are stored changes).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider

from opadvisor.rewrite.base import RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import code
from opadvisor.rules.rnn.cudnn_rnn import CudnnRnnFacts


class CudnnRnnCodemod(RuleCodemod):
    """Insert `<layer>.flatten_parameters()` before the calls whose weights the profile found not packed."""

    RULE: ClassVar[str] = "cudnn_rnn"
    FACTS = CudnnRnnFacts
    STATIC_MODE: ClassVar[bool] = False  # which calls found the weights scattered only a profile says
    NO_KERNEL_OP: ClassVar[str] = "flatten_parameters() re-packs the weights for the layer's own cuDNN call"
    SAFETY: ClassVar[str] = "safe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider,)

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return updated_node.with_changes(body=self._with_flattening(original_node.body, updated_node.body))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        updated_node = updated_node.with_changes(
            body=self._with_flattening(original_node.body, updated_node.body)
        )
        self.note_unreached(_unreached)
        return updated_node

    def _with_flattening(self, original: tuple, updated: tuple) -> list:
        body: list = []
        for before, after in zip(original, updated, strict=True):
            layer = self._layer_called(before)
            if layer is not None and not _flattens(body[-1] if body else None, layer):
                call = cst.Call(func=cst.Attribute(value=layer, attr=cst.Name("flatten_parameters")))
                body.append(cst.SimpleStatementLine([cst.Expr(call)], leading_lines=after.leading_lines))
                after = after.with_changes(leading_lines=[])
                self.record_change(
                    before,
                    f"{code(layer)}.flatten_parameters() before the call: cuDNN reads one packed buffer",
                )
            elif layer is not None:
                self._note_done(before)
            body.append(after)
        return body

    def _layer_called(self, stmt: cst.CSTNode) -> cst.BaseExpression | None:
        """The layer expression this statement calls, when a not-flat finding targets it."""
        if self.targets is None or not isinstance(stmt, cst.SimpleStatementLine):
            return None
        target = self.targeted(stmt)
        if target is None or "not_flat" not in _facts(target).problems:
            return None
        name = _facts(target).module.rpartition(".")[2]
        for call in m.findall(stmt, m.Call(func=m.Attribute(attr=m.Name(name)) | m.Name(name))):
            self.answered.add(target)
            return call.func  # type: ignore[attr-defined]
        return None

    def _note_done(self, stmt: cst.CSTNode) -> None:
        target = self.targeted(stmt)
        if target is not None:
            self.answered.add(target)


def _facts(target: Target) -> CudnnRnnFacts:
    return target_facts(target, CudnnRnnFacts) or CudnnRnnFacts()


def _unreached(target: Target) -> str | None:
    facts = _facts(target)
    if "not_flat" not in facts.problems:
        return None  # float32-only advice: nothing to rewrite there
    return f"no statement calling {facts.module or 'the layer'} on these lines"


def _flattens(stmt: cst.CSTNode | None, layer: cst.BaseExpression) -> bool:
    """Whether `stmt` is `<layer>.flatten_parameters()` already."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    expr = stmt.body[0]
    return m.matches(
        expr, m.Expr(m.Call(func=m.Attribute(attr=m.Name("flatten_parameters")), args=[]))
    ) and expr.value.func.value.deep_equals(layer)  # type: ignore[union-attr]
