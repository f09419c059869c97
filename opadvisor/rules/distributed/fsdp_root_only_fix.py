"""Codemod for `fsdp_root_only`: shard each repeated block with fully_shard before the root call.

Profile mode only (the blocks are those recorded from the module at the `fully_shard` call). Each target is
the statement of the root call; a loop over the blocks (the containers in the finding's facts, spelled from
the call's module expression, as `regional_compile` spells them) is inserted before it, each block's call
with the root call's own function and keyword arguments:

    fully_shard(model, mp_policy=mp)     ->  for block in model.blocks:
                                                 fully_shard(block, mp_policy=mp)
                                             fully_shard(model, mp_policy=mp)

The statement may also bind the result (`model = fully_shard(model)`). Refused (left alone, with the
reason): a module that is not a name or an attribute (it would be evaluated again), a call inside a larger
expression, `*args` / `**kwargs`, several statements on the line, a block path Python cannot spell.

Fix safety: safe (the same parameters and sums; FSDP reduces each block's gradients on their own).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import FULLY_SHARD_NAMES, calls_to, code, has_star_args, nodes_of, resolves_to
from opadvisor.rules.compile.regional_compile_fix import block_iterable
from opadvisor.rules.compile_facts import RegionalCompileFacts
from opadvisor.rules.distributed.parallel_facts import FsdpFacts

LOOP_NAME = "block"


class FsdpRootOnlyCodemod(RuleCodemod):
    """A per-block fully_shard loop inserted before the targeted root fully_shard(...) statement."""

    RULE: ClassVar[str] = "fsdp_root_only"
    FACTS = FsdpFacts
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False
    COMPOSES: ClassVar[bool] = True  # fsdp_fp32_gather adds a keyword to the same call
    NO_KERNEL_OP: ClassVar[str] = "FSDP unit granularity, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def __init__(self, context, targets=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(context, targets)
        self._loops: set[str] = set()  # iterables of existing loops that call fully_shard on each item
        self._names: set[str] = set()

    def visit_Module(self, node: cst.Module) -> bool:
        self._names = {n.value for n in nodes_of(node, cst.Name)}
        for loop in nodes_of(node, cst.For):
            if calls_to(self, loop.body, FULLY_SHARD_NAMES):
                self._loops.add(code(loop.iter))
        return self.targets is not None

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        target = self._target_on(original_node)
        if target is None:
            return updated_node
        self.answered.add(target)
        facts = target_facts(target, FsdpFacts)
        found = self._root_call(original_node)
        if isinstance(found, str) or facts is None:
            self.skip(original_node, found if isinstance(found, str) else "the finding carries no FSDP facts")
            return updated_node
        module, call = found
        iterable = block_iterable(module, _blocks(facts))
        if iterable is None:
            self.skip(original_node, "a block's path is no attribute or index")
            return updated_node
        if iterable in self._loops:
            self.already = f"each block of {iterable} is sharded already"
            return updated_node
        self.record_change(
            original_node, f"each of {facts.count} {facts.block} blocks sharded as its own FSDP unit"
        )
        return cst.FlattenSentinel(
            [self._loop(updated_node, facts, iterable, call), updated_node.with_changes(leading_lines=[])]
        )

    def _target_on(self, node: cst.CSTNode) -> Target | None:
        if not self.targets:
            return None
        start, end = self.lines_of(node)
        return next((t for t in self.targets if start <= t.end_line and t.line <= end), None)

    def _root_call(self, stmt: cst.SimpleStatementLine) -> tuple[str, cst.Call] | str:
        """(the module's expression, the call) of a `fully_shard(module, ...)` statement, or why not."""
        if len(stmt.body) != 1:
            return "several statements on the line: shard the blocks by hand"
        small = stmt.body[0]
        value = small.value if isinstance(small, cst.Assign | cst.Expr) else None
        if not isinstance(value, cst.Call) or not resolves_to(self, value.func, FULLY_SHARD_NAMES):
            inside = calls_to(self, stmt, FULLY_SHARD_NAMES)
            return "fully_shard is inside a larger expression" if inside else "no fully_shard(...) call here"
        if has_star_args(value):
            return f"the call passes {has_star_args(value)}"
        first = value.args[0] if value.args and value.args[0].keyword is None else None
        if first is None:
            return "the module is not fully_shard's first positional argument"
        node: cst.BaseExpression = first.value
        while isinstance(node, cst.Attribute):
            node = node.value
        if not isinstance(node, cst.Name):
            return f"the module `{code(first.value)}` is no name or attribute (it would be evaluated again)"
        return code(first.value), value

    def _loop(
        self, line: cst.SimpleStatementLine, facts: FsdpFacts, iterable: str, call: cst.Call
    ) -> cst.For:
        var = next(
            n
            for n in (LOOP_NAME, f"{LOOP_NAME}_", *(f"{LOOP_NAME}_{i}" for i in range(2, 99)))
            if n not in self._names
        )
        loop = cst.ensure_type(cst.parse_statement(f"for {var} in {iterable}:\n    pass\n"), cst.For)
        block_call = call.with_changes(args=[call.args[0].with_changes(value=cst.Name(var)), *call.args[1:]])
        body = cst.SimpleStatementLine([cst.Expr(block_call)])
        comment = cst.EmptyLine(
            comment=cst.Comment(
                f"# one FSDP unit per {facts.block}, gathered while the one before computes (opadvisor fsdp_root_only)"
            )
        )
        return loop.with_changes(
            leading_lines=[*line.leading_lines, comment], body=loop.body.with_changes(body=[body])
        )

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for target in self.targets or []:
            if target not in self.answered:
                self.skipped.append(Note(target.line, "no fully_shard(...) statement on these lines"))
        return updated_node


def _blocks(facts: FsdpFacts) -> RegionalCompileFacts:
    return RegionalCompileFacts(
        block=facts.block, count=facts.count, containers=facts.containers, singles=facts.singles
    )
