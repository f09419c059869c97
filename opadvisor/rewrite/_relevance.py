"""Which top-level classes and functions a codemod has to read (issue 29: every rule's pass walked the
whole file, 14 passes of a 5,000-line file for `apply --rule all`).

A codemod declares `SOURCE_WORDS`: regular expressions (case-insensitive) one of which every match it
rewrites or notes names in the source: "softmax" covers `F.softmax`, `nn.Softmax` and DeBERTa's `XSoftmax`.
A top-level `class` or `def` is read when

- its text names a word (a *seed*: `class StableDropout` for the dropout words),
- or it names a module-level name bound by a statement that names a word or a seed's name (`sm =
  F.softmax`, `from torch.nn.functional import softmax as sm`, `Drop = StableDropout`),
- or it names a seed (a caller of `StableDropout(...)`, where a match at the call site lies).

One hop from a seed is enough: a match lies where a word, an alias of one, or a seed is named. Every other
top-level statement (imports, assignments, `if __name__ == "__main__":`, `try:` blocks) is always read. A
file that names no word at all is not walked (`names_any`). `tests/realcode/test_relevance.py` holds the
filter to the unfiltered output on real model files.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import libcst as cst

_KEEP = 64  # (module, words) pairs remembered: a few texts times the rules
_UNREAD: OrderedDict[tuple[int, tuple[str, ...]], tuple[cst.Module, frozenset[int]]] = OrderedDict()


def words_pattern(words: Sequence[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{w})" for w in words), re.IGNORECASE)


def names_any(source: bytes | str, words: Sequence[str]) -> bool:
    """Whether `source` names one of `words` anywhere (False: a codemod with these words has nothing to do)."""
    text = source.decode("utf-8", errors="surrogateescape") if isinstance(source, bytes) else source
    return words_pattern(words).search(text) is not None


def unread_statements(module: cst.Module, words: Sequence[str]) -> frozenset[int]:
    """The ids of `module`'s top-level classes and functions a codemod with these words need not read
    (empty when `words` is empty: every statement is read). Memoised per module and words."""
    if not words:
        return frozenset()
    key = (id(module), tuple(words))
    hit = _UNREAD.get(key)
    if hit is not None and hit[0] is module:
        _UNREAD.move_to_end(key)
        return hit[1]
    unread = _unread(module, words_pattern(words))
    _UNREAD[key] = (module, unread)
    while len(_UNREAD) > _KEEP:
        _UNREAD.popitem(last=False)
    return unread


def _unread(module: cst.Module, words: re.Pattern[str]) -> frozenset[int]:
    texts = [module.code_for_node(stmt) for stmt in module.body]
    defs = [i for i, s in enumerate(module.body) if isinstance(s, cst.ClassDef | cst.FunctionDef)]
    seeds = {i for i in defs if words.search(texts[i])}
    named = {module.body[i].name.value for i in seeds}  # type: ignore[attr-defined]
    others = [i for i, s in enumerate(module.body) if not isinstance(s, cst.ClassDef | cst.FunctionDef)]
    named |= _aliases(module, others, texts, words, named)
    if not named:
        return frozenset(id(module.body[i]) for i in defs if i not in seeds)
    names = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(named))) + r")\b")
    return frozenset(id(module.body[i]) for i in defs if i not in seeds and not names.search(texts[i]))


def _aliases(
    module: cst.Module, others: Iterable[int], texts: Sequence[str], words: re.Pattern[str], seeds: set[str]
) -> set[str]:
    """The names bound by the non-def statements that name a word, a seed or (transitively) such a name."""
    bound = {i: _bound_names(module.body[i]) for i in others}
    aliases: set[str] = set()
    pending = [i for i in bound if bound[i]]
    changed = True
    while changed:  # each round adds at least one statement's names, so at most len(pending) rounds
        changed = False
        known = seeds | aliases
        pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(known))) + r")\b") if known else None
        for i in list(pending):
            if words.search(texts[i]) or (pattern is not None and pattern.search(texts[i])):
                aliases |= bound[i]
                pending.remove(i)
                changed = True
    return aliases


class _Binder(cst.CSTVisitor):
    """The names a statement binds at module level: assignment targets, imports' names, nested defs."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._targets(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._targets(node.target)

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        if node.asname is not None and isinstance(node.asname.name, cst.Name):
            self.names.add(node.asname.name.value)
        else:
            name = node.name
            while isinstance(name, cst.Attribute):
                name = name.value
            if isinstance(name, cst.Name):
                self.names.add(name.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.names.add(node.name.value)
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.names.add(node.name.value)
        return False

    def _targets(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            self.names.add(target.value)
        elif isinstance(target, cst.Tuple | cst.List):
            for element in target.elements:
                self._targets(element.value)
        elif isinstance(target, cst.StarredElement):
            self._targets(target.value)


def _bound_names(stmt: cst.CSTNode) -> set[str]:
    binder = _Binder()
    stmt.visit(binder)
    return binder.names
