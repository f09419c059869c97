"""What each statement of a block binds and reads, built once per block, and look-ups through it.

    index = block_index(stmts)                  # memoised: the same statements give the same index
    index.lookup("mask", before=k)              # the nearest binding before statement k, or None
    index.simple_before("mask", before=k)       # the nearest `mask = value` before statement k, or None
    resolver = Resolver(stmts, at=k)            # what a name read by statement k stands for
    resolver.resolve(name_node)                 # the value of `name = value`, or None

A matcher reads an expression through the temporaries bound earlier in its block (`g = torch.sigmoid(x)`
then `y = x * g`). Every statement is visited once for what it binds (`assigned`) and the names each bound
value reads; a look-up is then a bisection in the list of the statements binding that name. A name read
inside a followed value resolves relative to *that* binding (so `x = x.to(t)` reads the `x` bound before
it, never itself): every chain of look-ups goes strictly upward and ends.

This is the one source-binding engine: fuse_region's Resolver (and its backward resolver), the dropout
matcher, manual_layernorm's block matcher, the softmax chain finder's temporaries, sdpa_attention's mask
values and fused_dropout_add's in-place check all look names up here.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import libcst as cst

from opadvisor.rewrite import _budget
from opadvisor.rewrite._match import code, names_in, nodes_of
from opadvisor.rewrite._walk import Visitor


class _Assigned(Visitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def _target(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Attribute):  # ctx.p = ...: binds `ctx.p`, not the names inside
            self.names.add(code(node))
        elif isinstance(node, cst.Subscript):  # x[i] = ...: changes x
            self._target(node.value)
        elif isinstance(node, (cst.Tuple, cst.List)):
            for el in node.elements:
                self._target(el.value)
        elif isinstance(node, cst.StarredElement):
            self._target(node.value)
        elif isinstance(node, cst.Name):
            self.names.add(node.value)

    def _defines(self, node: cst.FunctionDef | cst.ClassDef) -> bool:
        self.names.add(node.name.value)
        return False  # what its body binds is its own scope's (and a walk of a whole class is costly)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return self._defines(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return self._defines(node)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target)


def assigned(stmt: cst.CSTNode) -> set[str]:
    """Names and attribute texts (`ctx.p`) the statement binds or changes, any way (`x[i] = `, `for x`)."""
    v = _Assigned()
    stmt.visit(v)
    return v.names


def simple_binding(stmt: cst.BaseStatement) -> dict[str, cst.BaseExpression]:
    """Names and attributes (`mask`, `ctx.scale`) a simple `target = value` statement binds."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return {}
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target = small.targets[0].target
        if isinstance(target, (cst.Name, cst.Attribute)):
            return {code(target): small.value}
    return {}


@dataclass(frozen=True)
class Binding:
    index: int  # the binding statement
    value: cst.BaseExpression | None  # None: bound some other way (a loop, a tuple, +=): not followed


@dataclass
class BlockIndex:
    """For each statement what it binds; for each name the statements binding it (ascending)."""

    stmts: list[cst.BaseStatement]
    binds: list[frozenset[str]] = field(default_factory=list)
    simple: list[dict[str, cst.BaseExpression]] = field(default_factory=list)
    binders: dict[str, list[int]] = field(default_factory=dict)
    _reads: dict[int, frozenset[str]] = field(default_factory=dict)  # id(value) -> the names it reads
    _leaves: dict[int, list[cst.CSTNode]] = field(default_factory=dict)  # id(value) -> its names/attributes

    def __post_init__(self) -> None:
        for i, stmt in enumerate(self.stmts):
            _budget.check()
            names = frozenset(assigned(stmt))
            self.binds.append(names)
            self.simple.append(simple_binding(stmt))
            for name in names:
                self.binders.setdefault(name, []).append(i)

    def lookup(self, text: str, before: int, start: int = 0) -> Binding | None:
        """The nearest statement in [start, before) binding `text`, or None when none does."""
        j = nearest_before(self.binders.get(text, ()), before, start)
        return None if j is None else Binding(j, self.simple[j].get(text))

    def simple_before(self, text: str, before: int, start: int = 0) -> Binding | None:
        """The nearest statement in [start, before) binding `text` as `text = value` (bindings of other
        kinds, `text += ...`, a loop, skipped), or None."""
        where = self.binders.get(text, ())
        for i in range(bisect.bisect_left(where, before) - 1, -1, -1):
            _budget.check()
            j = where[i]
            if j < start:
                break
            if text in self.simple[j]:
                return Binding(j, self.simple[j][text])
        return None

    def simple_after(self, text: str, after: int) -> Binding | None:
        """The first statement after `after` binding `text` as `text = value`, or None."""
        where = self.binders.get(text, ())
        for j in where[bisect.bisect_right(where, after) :]:
            _budget.check()
            if text in self.simple[j]:
                return Binding(j, self.simple[j][text])
        return None

    def rebound(self, names: frozenset[str] | set[str], after: int, before: int) -> bool:
        """Whether a statement strictly between `after` and `before` binds one of `names`."""
        for name in names:
            where = self.binders.get(name, ())
            i = bisect.bisect_right(where, after)
            if i < len(where) and where[i] < before:
                return True
        return False

    def reads(self, value: cst.BaseExpression) -> frozenset[str]:
        """The names (every Name node's text) `value` reads; visited once per value."""
        key = id(value)
        if key not in self._reads:
            self._reads[key] = frozenset(n.value for n in names_in(value))
        return self._reads[key]

    def leaves(self, value: cst.BaseExpression) -> list[cst.CSTNode]:
        """The names and attributes inside `value` (what a matcher may look up next)."""
        key = id(value)
        if key not in self._leaves:
            self._leaves[key] = [*nodes_of(value, cst.Name), *nodes_of(value, cst.Attribute)]
        return self._leaves[key]


def nearest_before(indices: Sequence[int], before: int, start: int = 0) -> int | None:
    """The largest of the ascending `indices` in [start, before), or None."""
    _budget.check()
    i = bisect.bisect_left(indices, before) - 1
    return indices[i] if i >= 0 and indices[i] >= start else None


_INDEXES: dict[tuple[int, ...], BlockIndex] = {}  # the index holds its statements: their ids stay theirs
_MAX_INDEXES = 256


def block_index(stmts: Sequence[cst.BaseStatement]) -> BlockIndex:
    """The index of these statements, built once (a small cache: blocks are revisited per match)."""
    key = tuple(id(s) for s in stmts)
    index = _INDEXES.get(key)
    if index is None:
        index = BlockIndex(list(stmts))
        if len(_INDEXES) >= _MAX_INDEXES:
            _INDEXES.pop(next(iter(_INDEXES)))
        _INDEXES[key] = index
    return index


class Resolver:
    """What a name (or `ctx.attr`) read by statement `at` of a block stands for: the value of the nearest
    earlier `name = value` in [start, at), when nothing between it and `at` rebinds what it reads.

    A node inside a value it returned is looked up relative to that value's statement (`x = x.to(t)`: the
    `x` inside is the one bound before). The match is rewritten at `at`, so a name left as a leaf there
    must mean there what it meant where it was read: one rebound in between is recorded in `stale` (the
    caller refuses the match). `used`: text -> statement looked into; a name met again through another of
    its bindings is not followed (one binding per name, which is what folding temporaries away needs)."""

    def __init__(self, stmts: Sequence[cst.BaseStatement], at: int, start: int = 0) -> None:
        self.index = block_index(stmts)
        self.stmts = self.index.stmts
        self.at = at
        self.start = start
        self.used: dict[str, int] = {}
        self.stale: set[str] = set()  # leaves that mean something else at `at` than where they are read
        self._origin: dict[int, int] = {}  # id(node inside a followed value) -> the statement it is read at

    def owns(self, node: cst.CSTNode) -> bool:
        """Whether `node` came out of a value this resolver returned."""
        return id(node) in self._origin

    def resolve(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        text = code(node)
        at = self._origin.get(id(node), self.at)
        value = self._followed(text, at)
        if value is None and at < self.at and self.index.rebound({text}, at - 1, self.at):
            self.stale.add(text)
        return value

    def _followed(self, text: str, at: int) -> cst.BaseExpression | None:
        found = self.index.lookup(text, at, self.start)
        if found is None or found.value is None:
            return None
        j, value = found.index, found.value
        if self.used.get(text, j) != j or self.index.rebound(self.index.reads(value), j, self.at):
            return None
        self.used[text] = j
        for leaf in self.index.leaves(value):
            self._origin.setdefault(id(leaf), j)
        return value
