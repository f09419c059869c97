"""The base every rule codemod builds on (libcst codemod commands).

A codemod rewrites the sites of one rule. In profile mode the engine passes `targets` (the line ranges
and typed facts of the findings), and the codemod changes only matches that overlap a target; in static mode
(`opadvisor apply --rule R FILE...`) `targets` is None and every match is rewritten. A match that cannot
be rewritten safely is left alone and reported with `self.skip(node, reason)`; a rewrite is recorded with
`self.record_change(node, description)`. Imports go through `AddImportsVisitor.add_needed_import`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider

from opadvisor.rewrite import _budget, _metadata, _relevance
from opadvisor.rules.facts import Facts, FactsError

F = TypeVar("F", bound=Facts)


@dataclass(frozen=True)
class Target:
    """A place the profile says the rule applies: 1-based inclusive lines, and the finding's facts, typed
    (the codemod's `FACTS`; None for a target that carries none: a codemod without facts, a test's bare
    lines). Build one from a finding with `finding_target`, which checks its facts."""

    line: int
    end_line: int
    facts: Facts | None = field(default=None, hash=False, compare=False)
    # the rule of the finding this target fixes, where the codemod is another (a library fix's
    # `library_patch`, `hf_attn_implementation`, ...): messages speak of the rule users know (issue 30)
    finding_rule: str | None = field(default=None, compare=False)
    # engine bookkeeping, no fact: the facts' per-step lines (label -> [first, last]) mapped onto the text
    # earlier rewrites left, as `line`/`end_line` are; None: as the facts have them
    moved_lines: dict[str, list[int]] | None = field(default=None, hash=False, compare=False)

    def step_lines(self) -> dict[str, list[int]]:
        """Where each step of the pattern is in the text being rewritten (label -> [first, last])."""
        if self.moved_lines is not None:
            return self.moved_lines
        return self.facts.step_lines() if self.facts is not None else {}

    def step_line(self, label: str) -> tuple[int, int] | None:
        span = self.step_lines().get(label)
        return (span[0], span[-1]) if span else None


def target_facts(target: Target, cls: type[F]) -> F | None:
    """The target's facts as `cls`; None for a target that carries none (a test's bare lines: a finding's
    target always carries its facts, `finding_target`); a FactsError for facts of another class."""
    if target.facts is None or isinstance(target.facts, cls):
        return target.facts
    raise FactsError(
        f"{target.finding_rule or 'a target'}: its facts are {type(target.facts).__name__}, "
        f"read as {cls.__name__}"
    )


def finding_target(finding: Any, facts_type: type[Facts] | None) -> Target:
    """The target of a finding whose fix reads facts of `facts_type` (None: reads none): a FactsError
    naming the rule and the field when the finding's facts do not fit."""
    facts = finding.facts(facts_type) if facts_type is not None else None
    return Target(finding.line, finding.end_line, facts)


@dataclass(frozen=True)
class Note:
    line: int  # in the text the codemod ran on (applied.json keeps it: verify maps the rewritten sites)
    message: str
    # issue 30: the finding it belongs to, as every command names it: its lines as profiled ("35-40")
    # and its rule; None for a note outside any finding (the profiled line of the note is then used)
    where: str | None = field(default=None, compare=False)
    finding_rule: str | None = field(default=None, compare=False)


class RuleCodemod(VisitorBasedCodemodCommand):
    RULE: ClassVar[str] = ""
    SAFETY: ClassVar[str] = "safe"  # "safe" or "unsafe": the safety of the rewrite this codemod makes
    # True when its rewrite adds to code another rule may have rewritten (inserts a line next to it, adds a
    # keyword): a target whose lines an earlier rule changed is still passed on (mapped onto the new text)
    # instead of being refused as "already rewritten".
    COMPOSES: ClassVar[bool] = False
    # True when one rewrite serves every target in the file (sparse_launch wraps the model once, wherever
    # its findings point): a change anywhere satisfies all targets, and a refusal anywhere is each one's
    # reason
    FILE_LEVEL: ClassVar[bool] = False
    # the `opadvisor.kernels` op the rewrite calls, by its name in `dispatch_counts()` (verify checks that
    # the rewritten program ran its kernel); a tuple when each form the codemod rewrites calls its own op
    # (verify then expects those whose name the rule's rewrite added to the file); None when the fix calls
    # none, and then NO_KERNEL_OP says why (tests/verify/test_kernel_ops.py holds every fix to one of them)
    KERNEL_OP: ClassVar[str | tuple[str, ...] | None] = None
    NO_KERNEL_OP: ClassVar[str] = ""
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider,)
    # the facts its rule's findings carry (opadvisor.rules.facts), which the engine hands in on each target;
    # None for a codemod that reads none
    FACTS: ClassVar[type[Facts] | None] = None
    # Regular expressions (case-insensitive), one of which every match this codemod rewrites or notes names
    # in the source ("softmax" covers F.softmax, nn.Softmax, XSoftmax): its passes skip the top-level
    # classes and functions that cannot hold a match, and static mode skips a file naming none of them
    # (_relevance.py). Empty: every statement is read.
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ()
    # False for a codemod whose static pass changes a file naming none of its words too (fp32_gemm's TF32
    # lines: its words only say which definitions it reads)
    NEEDS_WORDS: ClassVar[bool] = True
    # False for a codemod that rewrites only what a profile's findings name: static mode skips it
    STATIC_MODE: ClassVar[bool] = True

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context)
        self.targets = list(targets) if targets is not None else None
        self.changes: list[Note] = []
        self.skipped: list[Note] = []
        self.notes: list[Note] = []  # display-only suggestions (`note`): printed, never written
        # the targets a rewrite answered (`note_unreached` names the rest); not `reached`: BlockRewriter's method
        self.answered: set[Target] = set()
        # set by a codemod that finds its own fix already in place (say why, one line): apply then says
        # "already applied" once instead of "found no code" per target
        self.already: str | None = None
        self._unread: frozenset[int] = frozenset()  # ids of the top-level statements this pass skips
        # set by the engine's first round of a static `--rule all`: the imports a rewrite asks for are kept
        # here (AddImportsVisitor's entries) instead of being added; the engine adds every rule's at once
        self.defer_imports = False
        self.imports_asked: list[Any] = []
        # whether a hook returned another node than it was given: a pass that did not wrote nothing, and
        # the engine keeps the text it ran on instead of generating the same code again
        self.modified = False
        if self._extra_visit_funcs or self._extra_leave_funcs or self._matchers:
            raise TypeError(
                f"{type(self).__name__}: matcher decorators are not dispatched here (see on_visit)"
            )

    @contextmanager
    def _handle_metadata_reference(self, module: cst.Module) -> Generator[cst.Module, None, None]:
        """libcst's own, with the module's shared wrapper (_metadata.py): what an earlier codemod resolved on
        the same source is not resolved again."""
        wrapper = _metadata.wrapper_for(module)
        old = self.context.wrapper
        with self.resolve(wrapper):
            self.context = replace(self.context, wrapper=wrapper)
            try:
                yield wrapper.module
            finally:
                self.context = replace(self.context, wrapper=old)

    def source_words(self) -> tuple[str, ...]:
        """The SOURCE_WORDS of this pass: static mode's. A profile's findings point at lines that need not
        name them (a regional compile of any chain, copies of batches from any loop): every statement is
        read there."""
        return self.SOURCE_WORDS if self.targets is None else ()

    # ---- the analysis budget (see _budget.py): checked at every node; names the function being read ----
    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.Module):
            _budget.start_pass()  # parsing and metadata, done by now, are not the analysis
            self._unread = _relevance.unread_statements(node, self.source_words())
            return cst.CSTTransformer.on_visit(self, node)
        if id(node) in self._unread:
            return False  # a top-level class or function that names none of SOURCE_WORDS: no match in it
        if isinstance(node, cst.ClassDef | cst.FunctionDef):
            _budget.enter(node.name.value)  # before the check: an overrun here is this function's
        _budget.check()
        return cst.CSTTransformer.on_visit(self, node)

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode) -> Any:  # type: ignore[override]
        if id(original_node) in self._unread:
            return updated_node  # skipped in on_visit: none of its leave_ hooks ran either
        result = cst.CSTTransformer.on_leave(self, original_node, updated_node)
        if result is not updated_node:
            self.modified = True
        if isinstance(original_node, cst.ClassDef | cst.FunctionDef):
            _budget.leave()
        elif isinstance(original_node, cst.Module):
            _budget.end_pass()
        return result

    # The plain CSTTransformer dispatch, not that of libcst's MatcherDecoratableTransformer (the base of its
    # codemods): that one looks up a dozen matcher tables at every node and attribute, a third of a pass's
    # time, for decorators (@m.visit, @m.call_if_inside) no codemod here uses (__init__ refuses them). No
    # `visit_<Node>_<attribute>` hooks either: none is defined, and their look-ups cost as much again.
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        return None

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        return None

    def _instantiate_and_run(self, transform: type[Codemod], tree: cst.Module) -> cst.Module:
        """libcst's own, except that the imports a rewrite asked for are added on the module's top level only
        (`_imports_added`): libcst's AddImportsVisitor copies and walks the whole file, most of a pass's time."""
        if transform is not AddImportsVisitor:
            return super()._instantiate_and_run(transform, tree)
        if self.defer_imports:
            self.imports_asked = list(self.context.scratch.get(AddImportsVisitor.CONTEXT_KEY, []))
            return tree
        self.modified = True  # imports asked for (most often new ones)
        return _imports_added(
            tree, lambda slim: super(RuleCodemod, self)._instantiate_and_run(transform, slim)
        )

    # ---- helpers for subclasses ------------------------------------------------------------------
    def lines_of(self, node: cst.CSTNode) -> tuple[int, int]:
        pos = self.get_metadata(PositionProvider, node)
        return pos.start.line, pos.end.line

    def targeted(self, node: cst.CSTNode) -> Target | None:
        """The target this node overlaps, a catch-all Target in static mode, None if not targeted."""
        return self.target_for_lines(*self.lines_of(node))

    def skip(self, node: cst.CSTNode, reason: str) -> None:
        self.skipped.append(Note(self.lines_of(node)[0], reason))

    def record_change(self, node: cst.CSTNode, description: str) -> None:
        self.changes.append(Note(self.lines_of(node)[0], description))

    # ---- added with the engine (issue 6) -----------------------------------------------------------
    def target_for_lines(self, start: int, end: int) -> Target | None:
        """Like `targeted`, for a line range (a match spanning several statements)."""
        if self.targets is None:
            return Target(start, end)
        overlapping = [t for t in self.targets if start <= t.end_line and t.line <= end]
        # the most specific one: a finding spanning a caller and its callee (T5's block, lines 61-89) must
        # not take the lines of a finding inside it (its feed-forward, 74-75) with facts not for them: first
        # a target whose facts name these lines, then one containing them, then the narrowest
        return min(
            overlapping,
            key=lambda t: (
                not _facts_name(t, start, end),
                not (t.line <= start and end <= t.end_line),
                t.end_line - t.line,
            ),
            default=None,
        )

    def facts_of(self, target: Target) -> Any:
        """The target's facts, of this codemod's `FACTS` class (see `target_facts`)."""
        return target_facts(target, self.FACTS) if self.FACTS is not None else target.facts

    def note_unreached(self, why: Callable[[Target], str | None]) -> None:
        """In profile mode, a skip for every target that no rewrite answered (`answered`), saying `why` it
        was left (None: nothing to say)."""
        for target in self.targets or []:
            reason = why(target) if target not in self.answered else None
            if reason is not None:
                self.skipped.append(Note(target.line, reason))

    def note(self, node: cst.CSTNode, message: str) -> None:
        """A display-only suggestion (it would change the model, so it is never written): shown to the user."""
        self.notes.append(Note(self.lines_of(node)[0], message))


def _facts_name(target: Target, start: int, end: int) -> bool:
    """Whether the target's facts place one of their ops on lines start..end (its `step_lines`)."""
    return any(start <= span[-1] and span[0] <= end for span in target.step_lines().values())


_PLACEHOLDER = "__opadvisor_definition_{}__"


def with_imports(tree: cst.Module, imports: Sequence[Any], path: str) -> cst.Module:
    """`tree` with the imports of AddImportsVisitor entries `imports` (a codemod's `imports_asked`) added,
    as a codemod adds the imports it asked for."""
    if not imports:
        return tree
    context = CodemodContext(filename=path, scratch={AddImportsVisitor.CONTEXT_KEY: list(imports)})
    return _imports_added(tree, lambda slim: AddImportsVisitor(context).transform_module(slim))


def _imports_added(tree: cst.Module, add: Callable[[cst.Module], cst.Module]) -> cst.Module:
    """`add` (AddImportsVisitor's run) over `tree` with each top-level class, function and one-line
    statement that imports nothing stood in for by a one-name placeholder, then put back: the visitor reads
    the imports and places the new ones among the top-level statements, giving the statement after them a
    blank line (the placeholder carries the statement's leading lines for that). The module's docstring and
    compound statements (an `if`/`try` may import) stay. Where a placeholder did not come back exactly
    once, `add` runs over the whole module."""
    kept: dict[str, cst.BaseStatement] = {}
    body: list[cst.BaseStatement] = []
    for i, stmt in enumerate(tree.body):
        if _stands_in_for_imports(stmt, first=i == 0):
            name = _PLACEHOLDER.format(i)
            kept[name] = stmt
            stmt = cst.SimpleStatementLine([cst.Expr(cst.Name(name))], leading_lines=stmt.leading_lines)
        body.append(stmt)
    if not kept:
        return add(tree)
    out = add(tree.with_changes(body=body))
    restored: list[cst.BaseStatement] = []
    for stmt in out.body:
        name = _placeholder_name(stmt)
        if name is None:
            restored.append(stmt)
        elif name in kept:
            original = kept.pop(name)
            same = stmt.leading_lines is original.leading_lines  # type: ignore[attr-defined]
            restored.append(original if same else original.with_changes(leading_lines=stmt.leading_lines))
        else:
            return add(tree)
    return out.with_changes(body=restored) if not kept else add(tree)


def _stands_in_for_imports(stmt: cst.BaseStatement, first: bool) -> bool:
    if isinstance(stmt, cst.ClassDef | cst.FunctionDef):
        return True
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    if first and isinstance(stmt.body[0], cst.Expr) and isinstance(stmt.body[0].value, cst.SimpleString):
        return False  # the docstring: imports go after it
    return not any(isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body)


def _placeholder_name(stmt: cst.BaseStatement) -> str | None:
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return None
    expr = stmt.body[0]
    if isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Name):
        name = expr.value.value
        return name if name.startswith(_PLACEHOLDER.partition("{")[0]) else None
    return None
