"""A codemod base for rewrites that fold several consecutive statements of a block into one.

Subclasses implement `block_edits(stmts, indent)`: given the (original) statements of one block, return
`BlockEdit`s. Each edit names the statements it spans (`first`..`last`), optionally keeps the first as a
new statement (`kept_first`), and replaces nodes inside the last one (`replacements`, keyed by id() of the
original node). Every statement strictly between is removed, or, when the edit lists `removed`, exactly
those statements (temporaries read only by the rewritten expression, with other statements in between
kept). Nothing else in the file is touched.

Comments are never dropped: the leading lines of removed statements, their end-of-line comments, and
comments inside replaced code (outside the `carried` nodes that the rewrite reuses) become comment lines
above the rewritten statement, in source order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider, ScopeProvider

from opadvisor.rewrite import _edit as ed
from opadvisor.rewrite._names import reference
from opadvisor.rewrite._walk import Visitor
from opadvisor.rewrite.base import Note, RuleCodemod, Target


@dataclass
class BlockEdit:
    first: int
    last: int
    replacements: dict[int, cst.BaseExpression]  # id(original node in stmts[last]) -> new node
    carried: list[cst.CSTNode] = field(default_factory=list)  # original nodes reused by the rewrite
    kept_first: cst.SimpleStatementLine | None = None  # replaces stmts[first] when first < last
    kept_first_dropped: cst.CSTNode | None = None  # the part of stmts[first] that kept_first no longer has
    removed: frozenset[int] | None = None  # exactly these statements go (instead of all between)


class BlockRewriter(RuleCodemod):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ScopeProvider, ParentNodeProvider)

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self._module: cst.Module | None = None
        self._indents: list[str] = []

    # ---- subclasses ---------------------------------------------------------------------------------
    def block_edits(self, stmts: Sequence[cst.BaseStatement], indent: str) -> list[BlockEdit]:
        raise NotImplementedError

    # ---- helpers for subclasses -----------------------------------------------------------------------
    def reached(self, target: Target) -> None:
        """`target` was answered by an edit or a skip, though the note's line may lie before its lines (a
        chain read upward past the finding's first line, to a scale or an `if` around the mask)."""
        self.answered.add(target)

    def ref(self, qualified_name: str) -> cst.BaseExpression:
        assert self._module is not None
        return reference(self.context, self._module, qualified_name)

    def call_for(
        self,
        func: cst.BaseExpression,
        positional: Sequence[cst.BaseExpression],
        keywords: Sequence[tuple[str, cst.BaseExpression]],
        stmt: cst.SimpleStatementLine,
        top: cst.CSTNode,
        indent: str,
    ) -> cst.Call:
        """The call on one line when the statement still fits, else one argument per line."""
        assert self._module is not None
        flat = ed.build_call(func, positional, keywords)
        probe = ed.replace_nodes(stmt, {id(top): flat}).with_changes(leading_lines=[])  # type: ignore[union-attr]
        text = self._module.code_for_node(probe)
        if ed.fits(text, indent):
            return flat
        return ed.build_call(
            func, positional, keywords, exploded=True, indent_unit=self._module.default_indent
        )

    def stmt_lines(self, stmts: Sequence[cst.CSTNode], first: int, last: int) -> tuple[int, int]:
        start = self.get_metadata(PositionProvider, _inner(stmts[first])).start.line
        end = self.get_metadata(PositionProvider, _inner(stmts[last])).end.line
        return start, end

    # ---- traversal ------------------------------------------------------------------------------------
    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        return True

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> bool:
        assert self._module is not None
        self._indents.append(node.indent if node.indent is not None else self._module.default_indent)
        return True

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        indent = "".join(self._indents)
        self._indents.pop()
        body = self._apply(original_node.body, updated_node.body, indent)
        return updated_node if body is None else updated_node.with_changes(body=body)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = self._apply(original_node.body, updated_node.body, "")
        if self.targets:
            self._explain_unmatched(original_node)
        return updated_node if body is None else updated_node.with_changes(body=body)

    # ---- targets the rewrite found nothing at -------------------------------------------------------------
    def unmatched_reason(
        self, target: Target, functions: list[tuple[str, int, int]], lines: list[str]
    ) -> str | None:
        """Why nothing was rewritten or skipped at `target` (subclasses; None: no better word than "found
        no code it can rewrite"). `functions`: (name, first line, last line) of every def; `lines`: the source."""
        return None

    def _explain_unmatched(self, module: cst.Module) -> None:
        noted = [n.line for n in (*self.changes, *self.skipped)]
        functions = [
            (f.name.value, *self.lines_of(f)) for f in _all_nodes(module) if isinstance(f, cst.FunctionDef)
        ]
        lines = module.code.splitlines()
        for target in self.targets or ():
            if target in self.answered or any(target.line <= n <= target.end_line for n in noted):
                continue
            reason = self.unmatched_reason(target, functions, lines)
            if reason is not None:
                self.skipped.append(Note(target.line, reason))

    def _targeted(self, stmts: Sequence[cst.BaseStatement]) -> bool:
        """In profile mode, whether a target overlaps the block's lines: every edit of a block lies inside
        it and is made only where it overlaps a target, so a block outside them all is not analysed."""
        if self.targets is None:
            return True
        if not stmts:
            return False
        start, end = self.stmt_lines(stmts, 0, len(stmts) - 1)
        return any(start <= t.end_line and t.line <= end for t in self.targets)

    def _apply(
        self, original: Sequence[cst.BaseStatement], updated: Sequence[cst.BaseStatement], indent: str
    ) -> list[cst.BaseStatement] | None:
        if not self._targeted(original):
            return None
        edits = self.block_edits(original, indent)
        if not edits:
            return None
        by_last: dict[int, list[BlockEdit]] = {}
        removed: dict[int, BlockEdit] = {}
        firsts: dict[int, BlockEdit] = {}
        for edit in edits:
            by_last.setdefault(edit.last, []).append(edit)
            if edit.removed is not None:
                removed.update(dict.fromkeys(edit.removed, edit))
            elif edit.first < edit.last:
                firsts[edit.first] = edit
                removed.update(dict.fromkeys(range(edit.first + 1, edit.last), edit))
        body: list[cst.BaseStatement] = []
        moved: list[cst.EmptyLine] = []
        for index, stmt in enumerate(original):
            if index in firsts:
                edit = firsts[index]
                if edit.kept_first is not None:
                    body.append(edit.kept_first)
                    if edit.kept_first_dropped is not None:
                        moved.extend(
                            ed.comment_lines(ed.orphaned_comments([edit.kept_first_dropped], edit.carried))
                        )
                else:
                    moved.extend(_moved_lines(stmt, edit.carried))
                continue
            if index in removed:
                edit = removed[index]
                moved.extend(_moved_lines(stmt, edit.carried))
                continue
            if index in by_last:
                assert isinstance(stmt, cst.SimpleStatementLine)
                mapping: dict[int, cst.CSTNode] = {}
                carried: list[cst.CSTNode] = []
                for edit in by_last[index]:
                    mapping.update(edit.replacements)
                    carried.extend(edit.carried)
                tops = [n for n in _all_nodes(stmt) if id(n) in mapping]
                inner = ed.comment_lines(ed.orphaned_comments(tops, carried))
                new_stmt = ed.replace_nodes(stmt, mapping)
                assert isinstance(new_stmt, cst.SimpleStatementLine)
                body.append(new_stmt.with_changes(leading_lines=[*moved, *new_stmt.leading_lines, *inner]))
                moved = []
                continue
            body.append(updated[index])
        return body


def _inner(stmt: cst.CSTNode) -> cst.CSTNode:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return stmt


def _moved_lines(stmt: cst.BaseStatement, carried: Sequence[cst.CSTNode]) -> list[cst.EmptyLine]:
    """What a removed statement leaves behind: its leading lines and its comments (as comment lines); for
    a compound one (`if mask is not None:` around a folded mask), the comments in all of it."""
    if isinstance(stmt, cst.SimpleStatementLine):
        comments = ed.orphaned_comments([*stmt.body, stmt.trailing_whitespace], carried)
    else:
        comments = ed.orphaned_comments([stmt.with_changes(leading_lines=[])], carried)
    return [*stmt.leading_lines, *ed.comment_lines(comments)]


def _all_nodes(root: cst.CSTNode) -> list[cst.CSTNode]:
    out: list[cst.CSTNode] = []

    class _All(Visitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            out.append(node)
            return True

    root.visit(_All())
    return out
