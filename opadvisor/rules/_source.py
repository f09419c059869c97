"""The user's source, read with libcst: confirm and pinpoint what the profile says ran on which lines.

The profile gives each op a file and a line (`op.line_exact` False when the op came from an operator such
as `a @ b` or `x / d`, whose line the profiler cannot see: then `op.line` is the last line known in that
frame, at or before the real one). This module turns those into the exact statements:

    from opadvisor.rules._source import load_source, source_status, locate_ops

    src = load_source(path)               # None when the file is gone or does not parse; cached per file
    src = load_profiled_source(profile, path)   # the same, but None when the file changed since profiling
    src.calls(10, 14)                     # [CallSite] of calls starting on lines 10..14 ("F.softmax", ...)
    src.operators(10, 14)                 # [OperatorSite] of binary / augmented operators ("@", "/", "+=")
    src.statement_span(12)                # (first, last) line of the statement holding line 12
    src.enclosing_function(12)            # FunctionSpan(name, qualname, line, end_line) or None
    src.enclosing_loop(12)                # (first, last) line of the innermost for / while, or None
    locate_each(src, ops)                 # each op's statement lines, for a chain that ran in this order
    locate_ops(src, ops)                  # (first, last) statement lines of the whole chain
    source_status(profile, path)          # "ok" | "changed" | "missing": the file now vs. at profile time

Every query is cheap after the first parse of a file (one visitor collects calls, operators, statements and
functions once). Nothing here raises on a user's file: an unreadable or unparsable file gives None.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from opadvisor.files import file_sha256
from opadvisor.profile.model import Op, Profile

__all__ = [
    "CallSite",
    "FunctionSpan",
    "OperatorSite",
    "SourceFile",
    "SourceStatus",
    "callee_name",
    "load_profiled_source",
    "load_source",
    "locate_each",
    "locate_op",
    "locate_ops",
    "source_status",
]

SourceStatus = Literal["ok", "changed", "missing"]

# aten op -> the Python operators that produce it when written without a call (`a @ b`, `x / d`, `x += y`)
OPERATORS_OF: dict[str, tuple[str, ...]] = {
    "aten::matmul": ("@", "@="),
    "aten::mm": ("@", "@="),
    "aten::bmm": ("@", "@="),
    "aten::div": ("/", "/="),
    "aten::div_": ("/=",),
    "aten::mul": ("*", "*="),
    "aten::mul_": ("*=",),
    "aten::add": ("+", "+="),
    "aten::add_": ("+=",),
    "aten::sub": ("-", "-="),
    "aten::sub_": ("-=",),
    "aten::rsub": ("-",),
    "aten::eq": ("==",),
    "aten::ne": ("!=",),
    "aten::lt": ("<",),
    "aten::gt": (">",),
    "aten::bitwise_not": ("~",),
    "aten::pow": ("**",),
}

_OP_SYMBOL = {
    cst.MatrixMultiply: "@",
    cst.Divide: "/",
    cst.Multiply: "*",
    cst.Add: "+",
    cst.Subtract: "-",
    cst.Power: "**",
    cst.FloorDivide: "//",
    cst.Modulo: "%",
    cst.AddAssign: "+=",
    cst.SubtractAssign: "-=",
    cst.MultiplyAssign: "*=",
    cst.DivideAssign: "/=",
    cst.MatrixMultiplyAssign: "@=",
    cst.Equal: "==",
    cst.NotEqual: "!=",
    cst.LessThan: "<",
    cst.GreaterThan: ">",
    cst.BitInvert: "~",
}


_HASHES: dict[str, tuple[int, int, str]] = {}


def _cached_sha256(path: str) -> str | None:
    """`file_sha256`, cached on path, mtime and size (every finding asks about its file)."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    hit = _HASHES.get(path)
    if hit is not None and hit[0] == st.st_mtime_ns and hit[1] == st.st_size:
        return hit[2]
    digest = file_sha256(path)
    if digest is not None:
        _HASHES[path] = (st.st_mtime_ns, st.st_size, digest)
    return digest


def source_status(profile: Profile, path: str) -> SourceStatus:
    """Whether `path` is the file that was profiled: "ok", "changed" (hash differs), or "missing"."""
    now = _cached_sha256(path)
    if now is None:
        return "missing"
    then = profile.sources.get(path)
    if then is None or then == now:
        return "ok"
    return "changed"


def callee_name(func: cst.BaseExpression) -> str:
    """Dotted text of a call's callee: `F.softmax`, `scores.masked_fill`, `self.drop`; "" if not a name."""
    parts: list[str] = []
    node = func
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
    elif parts:
        parts.append("<expr>")
    return ".".join(reversed(parts))


@dataclass(frozen=True)
class CallSite:
    name: str  # dotted callee text, e.g. "torch.nn.functional.softmax", "scores.masked_fill", "self.dropout"
    line: int
    end_line: int
    node: cst.Call = field(repr=False, compare=False)

    @property
    def attr(self) -> str:
        """The last part of the callee: "softmax", "masked_fill", "dropout"."""
        return self.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class OperatorSite:
    symbol: str  # "@", "/", "+", "+=", "==", "~" ...
    line: int
    end_line: int
    node: cst.CSTNode = field(repr=False, compare=False)


@dataclass(frozen=True)
class FunctionSpan:
    name: str
    qualname: str  # "Attention.forward"
    line: int  # the `def` line (decorators excluded)
    end_line: int


class _Collector(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.calls: list[CallSite] = []
        self.operators: list[OperatorSite] = []
        self.statements: list[tuple[int, int]] = []
        self.functions: list[FunctionSpan] = []
        self.loops: list[tuple[int, int]] = []  # (first, last) line of every for / while statement
        self.ifs: list[tuple[int, int]] = []  # (first, last) line of every if statement (elif: its own)
        self._scope: list[str] = []

    def _pos(self, node: cst.CSTNode) -> tuple[int, int]:
        p = self.get_metadata(PositionProvider, node)
        return p.start.line, p.end.line

    def visit_Call(self, node: cst.Call) -> None:
        a, b = self._pos(node)
        self.calls.append(CallSite(callee_name(node.func), a, b, node))

    def _operator(self, node: cst.CSTNode, op: cst.CSTNode) -> None:
        sym = _OP_SYMBOL.get(type(op))
        if sym is not None:
            a, b = self._pos(node)
            self.operators.append(OperatorSite(sym, a, b, node))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        self._operator(node, node.operator)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._operator(node, node.operator)

    def visit_UnaryOperation(self, node: cst.UnaryOperation) -> None:
        self._operator(node, node.operator)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        for target in node.comparisons:
            self._operator(node, target.operator)

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.statements.append(self._pos(node))

    def _header(self, node: cst.CSTNode, body: cst.CSTNode) -> None:
        start = self._pos(node)[0]
        body_start = self._pos(body)[0]
        self.statements.append((start, max(start, body_start - 1) if body_start > start else start))

    def visit_If(self, node: cst.If) -> None:
        self._header(node, node.body)
        self.ifs.append(self._pos(node))  # the whole statement, its else included

    def visit_For(self, node: cst.For) -> None:
        self._header(node, node.body)
        self.loops.append(self._pos(node))

    def visit_While(self, node: cst.While) -> None:
        self._header(node, node.body)
        self.loops.append(self._pos(node))

    def visit_With(self, node: cst.With) -> None:
        self._header(node, node.body)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scope.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._scope.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        p = self.get_metadata(PositionProvider, node)
        def_line = self.get_metadata(PositionProvider, node.name).start.line
        self._scope.append(node.name.value)
        self.functions.append(FunctionSpan(node.name.value, ".".join(self._scope), def_line, p.end.line))

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._scope.pop()


class SourceFile:
    """One parsed user file. Build through `load_source(path)` (cached)."""

    def __init__(self, path: str, text: str, tree: cst.Module) -> None:
        self.path = path
        self.text = text
        self.lines = text.splitlines()
        self.tree = tree
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
        col = _Collector()
        wrapper.visit(col)
        self._calls = sorted(col.calls, key=lambda c: (c.line, c.end_line))
        self._call_lines = [c.line for c in self._calls]
        self._ops = sorted(col.operators, key=lambda o: (o.line, o.end_line))
        self._op_lines = [o.line for o in self._ops]
        # innermost statement first when several contain a line: sort by start, then shortest
        self._stmts = sorted(set(col.statements), key=lambda s: (s[0], s[1] - s[0]))
        self._functions = col.functions
        self._loops = col.loops
        self._ifs = {start: (start, end) for start, end in col.ifs}

    def line_text(self, line: int) -> str:
        return self.lines[line - 1] if 1 <= line <= len(self.lines) else ""

    def calls(self, start: int, end: int) -> list[CallSite]:
        """Calls whose first line is in [start, end], in source order (outer call before inner)."""
        i = bisect.bisect_left(self._call_lines, start)
        j = bisect.bisect_right(self._call_lines, end)
        return self._calls[i:j]

    def calls_named(self, start: int, end: int, *attrs: str) -> list[CallSite]:
        """Calls in [start, end] whose callee's last part is one of `attrs` ("softmax", "masked_fill")."""
        wanted = set(attrs)
        return [c for c in self.calls(start, end) if c.attr in wanted]

    def operators(self, start: int, end: int, *symbols: str) -> list[OperatorSite]:
        """Operators whose first line is in [start, end], optionally only the given symbols."""
        i = bisect.bisect_left(self._op_lines, start)
        j = bisect.bisect_right(self._op_lines, end)
        found = self._ops[i:j]
        return [o for o in found if o.symbol in symbols] if symbols else found

    def statement_span(self, line: int) -> tuple[int, int]:
        """(first, last) line of the innermost statement holding `line` (the line itself when none does)."""
        best: tuple[int, int] | None = None
        i = bisect.bisect_right(self._stmts, (line, 10**9))
        for a, b in reversed(self._stmts[:i]):
            if a <= line <= b and (best is None or (b - a) < (best[1] - best[0])):
                best = (a, b)
            if best is not None and a < best[0] - 200:  # statements far above cannot be tighter
                break
        return best or (line, line)

    def enclosing_loop(self, line: int) -> tuple[int, int] | None:
        """(first, last) line of the innermost for / while statement holding `line`, None outside loops."""
        inside = [loop for loop in self._loops if loop[0] <= line <= loop[1]]
        return max(inside, key=lambda loop: loop[0]) if inside else None

    def if_statement(self, line: int) -> tuple[int, int] | None:
        """(first, last) line of the if statement that starts at `line` (its else included), else None."""
        return self._ifs.get(line)

    def enclosing_function(self, line: int) -> FunctionSpan | None:
        """The innermost function whose body holds `line`."""
        best: FunctionSpan | None = None
        for f in self._functions:
            if f.line <= line <= f.end_line and (best is None or f.line >= best.line):
                best = f
        return best

    def function_qualified(self, qualname: str) -> FunctionSpan | None:
        """The function whose qualified name is `qualname` ("BertLayer.forward"), the first when several."""
        return next((f for f in self._functions if f.qualname == qualname), None)

    def function_named(self, name: str, near_line: int | None = None) -> FunctionSpan | None:
        """The function called `name` (the one whose def is closest above `near_line`, when given)."""
        cands = [f for f in self._functions if f.name == name]
        if not cands:
            return None
        if near_line is None:
            return cands[0]
        inside = [f for f in cands if f.line <= near_line <= f.end_line]
        return (
            max(inside, key=lambda f: f.line) if inside else min(cands, key=lambda f: abs(f.line - near_line))
        )


_CACHE: dict[str, tuple[float, int, SourceFile | None]] = {}


def load_source(path: str | Path) -> SourceFile | None:
    """The parsed file (cached on path, mtime and size), or None when it is missing or does not parse."""
    p = str(path)
    try:
        st = Path(p).stat()
    except OSError:
        return None
    hit = _CACHE.get(p)
    if hit is not None and hit[0] == st.st_mtime and hit[1] == st.st_size:
        return hit[2]
    try:
        text = Path(p).read_text(encoding="utf-8")
        src: SourceFile | None = SourceFile(p, text, cst.parse_module(text))
    except (OSError, UnicodeDecodeError, cst.ParserSyntaxError, RecursionError):
        src = None
    _CACHE[p] = (st.st_mtime, st.st_size, src)
    return src


def locate_op(src: SourceFile, op: Op, *, until: int | None = None) -> tuple[int, int] | None:
    """The statement lines where `op` is written, None when the source does not show it.

    An op with an exact line gives that line's statement. An op written as an operator (`line_exact`
    False) is searched from `op.line` down to `until` (default: the end of the enclosing function) for the
    first operator that produces it (OPERATORS_OF); its statement is returned.
    """
    if op.line is None:
        return None
    if op.line_exact:
        return src.statement_span(op.line)
    symbols = OPERATORS_OF.get(op.name)
    if not symbols:
        return src.statement_span(op.line)
    if until is None:
        fn = src.enclosing_function(op.line)
        until = fn.end_line if fn else op.line + 50
    found = src.operators(op.line, max(op.line, until), *symbols)
    if not found:
        return None
    return src.statement_span(found[0].line)


def locate_each(src: SourceFile, ops: list[Op]) -> list[tuple[int, int] | None]:
    """The statement lines of each op of a chain that ran in this order in one function (None: not found).

    Exact lines anchor the search; an operator op (`line_exact` False) is searched from the statement of
    the previous op (or its own recorded line, whichever is later) down to the next exact line, so
    `scores = q @ k.T / d` followed by `scores = scores + mask` and `F.softmax(...)` pinpoints all three.
    """
    out: list[tuple[int, int] | None] = []
    cursor: int | None = None
    for i, op in enumerate(ops):
        if op.line is None:
            out.append(None)
            continue
        if op.line_exact:
            span: tuple[int, int] | None = src.statement_span(op.line)
        else:
            nxt = next((o.line for o in ops[i + 1 :] if o.line_exact and o.line is not None), None)
            start = max(op.line, cursor or 0)
            span = locate_op(src, dataclasses.replace(op, line=start), until=nxt)
            if span is None and start != op.line:
                span = locate_op(src, op, until=nxt)
        out.append(span)
        if span is not None:
            cursor = span[0]
    return out


def locate_ops(src: SourceFile | None, ops: list[Op]) -> tuple[int, int] | None:
    """(first, last) statement line over a chain of ops (see `locate_each`); None when nothing is found."""
    if src is None:
        return None
    spans = [s for s in locate_each(src, ops) if s is not None]
    if not spans:
        return None
    return min(s[0] for s in spans), max(s[1] for s in spans)


def load_profiled_source(profile: Profile, path: str) -> SourceFile | None:
    """The parsed file only when it is still the file that was profiled (`source_status` "ok"), else None.

    Rules pinpoint lines with libcst only through this, so a file edited since profiling never yields
    lines that look exact but are wrong: the rule falls back to the profile's lines and the engine marks
    the finding `source_status` "changed" / "missing".
    """
    if source_status(profile, path) != "ok":
        return None
    return load_source(path)
