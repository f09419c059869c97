"""Which top-level classes and functions a codemod has to read (issue 29: every rule's pass walked the
whole file, 14 passes of a 5,000-line file for `apply --rule all`).

A codemod declares `SOURCE_WORDS`: regular expressions (case-insensitive) one of which every match it
rewrites or notes names in the source: "softmax" covers `F.softmax`, `nn.Softmax` and DeBERTa's `XSoftmax`.
A top-level `class` or `def` is read when

- its text names a word (a *seed*: `class StableDropout` for the dropout words),
- or it names a module-level name bound by a statement that names a word or a seed's name (`sm =
  F.softmax`, `from torch.nn.functional import softmax as sm`, `Drop = StableDropout`),
- or it builds a seed class or reads its attribute (`StableDropout(...)`, `XSoftmax.apply(...)`): a
  match at the call site,
- or it is a function a seed calls by name (`maybe_add_mask(attn, bias)`): a matcher may read its body.

One hop from a seed is enough: a match lies where a word, an alias of one, or a seed is named. Every other
top-level statement (imports, assignments, `if __name__ == "__main__":`, `try:` blocks) is always read. A
file that names no word at all is not walked (`names_any`). `tests/realcode/test_relevance.py` holds the
filter to the unfiltered output on real model files.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import libcst as cst
from libcst.helpers import get_full_name_for_node

from opadvisor.rewrite._walk import Visitor

_STRINGS = re.compile(r'''(?s)(""".*?"""|\'\'\'.*?\'\'\'|'[^'\n]*'|"[^"\n]*")''')  # string literals, roughly
_KEEP = 64  # (module, words) pairs remembered: a few texts times the rules
_UNREAD: OrderedDict[tuple[int, tuple[str, ...]], tuple[cst.Module, frozenset[int]]] = OrderedDict()


def _remembered(cache: OrderedDict, key: Any, owner: cst.CSTNode, make: Callable[[], Any], keep: int) -> Any:
    """`make()` for the node `owner`, remembered under `key` (built from `id(owner)`) while `owner` is the
    node there and among the last `keep` asked for (an id is reused once its node is gone)."""
    hit = cache.get(key)
    if hit is not None and hit[0] is owner:
        cache.move_to_end(key)
        return hit[1]
    value = make()
    cache[key] = (owner, value)
    while len(cache) > keep:
        cache.popitem(last=False)
    return value


ENABLED = True  # False: every statement read, no file skipped (engine.unfiltered, to check the filter)


def words_pattern(words: Sequence[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{w})" for w in words), re.IGNORECASE)


def names_any(source: bytes | str, words: Sequence[str]) -> bool:
    """Whether `source` names one of `words` anywhere (False: a codemod with these words has nothing to do)."""
    if not ENABLED:
        return True
    text = source.decode("utf-8", errors="surrogateescape") if isinstance(source, bytes) else source
    return words_pattern(words).search(text) is not None


def unread_statements(module: cst.Module, words: Sequence[str]) -> frozenset[int]:
    """The ids of `module`'s top-level classes and functions a codemod with these words need not read
    (empty when `words` is empty: every statement is read). Memoised per module and words."""
    if not words or not ENABLED:
        return frozenset()
    key = (id(module), tuple(words))
    return _remembered(_UNREAD, key, module, lambda: _unread(module, words_pattern(words)), _KEEP)


def read_spans(module: cst.Module, words: Sequence[str], lines: int) -> list[tuple[int, int]] | None:
    """The 0-based [first, last + 1) line ranges of the top-level statements a static pass with these words
    reads (all but `unread_statements`), each with the blank and comment lines before it; None where the
    statements' lines do not add up to the module's `lines` (the newlines of its text)."""
    texts, _ = _texts_and_names(module)
    unread = unread_statements(module, words)
    at = len(module.header)
    spans = []
    for stmt, text in zip(module.body, texts, strict=True):
        n = text.count("\n")
        if id(stmt) not in unread:
            spans.append((at, at + n))
        at += n
    return spans if at + len(module.footer) == lines else None


_TEXTS: OrderedDict[int, tuple[cst.Module, tuple[list[str], dict[int, set[str]]]]] = OrderedDict()


def _texts_and_names(module: cst.Module) -> tuple[list[str], dict[int, set[str]]]:
    """Each top-level statement's text, and the names each non-definition binds: once per module, for
    every set of words."""

    def make() -> tuple[list[str], dict[int, set[str]]]:
        texts = [_statement_text(module, stmt) for stmt in module.body]
        bound = {
            i: _bound_names(s)
            for i, s in enumerate(module.body)
            if not isinstance(s, cst.ClassDef | cst.FunctionDef) and not _only_imports(s)
        }
        return texts, bound

    return _remembered(_TEXTS, id(module), module, make, 8)


_STMT_TEXTS: OrderedDict[int, tuple[cst.BaseStatement, str]] = OrderedDict()


def _statement_text(module: cst.Module, stmt: cst.BaseStatement) -> str:
    """A top-level statement's code, once per statement node: a slim module keeps the nodes it reads, so
    its texts are those of the module it was cut from."""
    return _remembered(_STMT_TEXTS, id(stmt), stmt, lambda: module.code_for_node(stmt), 20_000)


def _unread(module: cst.Module, words: re.Pattern[str]) -> frozenset[int]:
    """The definitions not read (see the module's doc), and the multi-line assignments to plain names that
    name no word, no seed and no alias (timm's `default_cfgs = generate_default_cfgs({...})` tables)."""
    texts, bound = _texts_and_names(module)
    defs = [i for i, s in enumerate(module.body) if isinstance(s, cst.ClassDef | cst.FunctionDef)]
    seeds = {i for i in defs if words.search(texts[i])}
    seeds |= _called_by(module, defs, seeds, texts)
    named = {module.body[i].name.value for i in seeds}  # type: ignore[attr-defined]
    others = [i for i, s in enumerate(module.body) if not isinstance(s, cst.ClassDef | cst.FunctionDef)]
    aliases = _aliases(module, others, texts, bound, words, named)
    # a class among the seeds counts where it is built or its attribute read (`StableDropout(...)`,
    # `XSoftmax.apply(...)`), not where it is only named (`-> VisionTransformer:`); a function among them
    # does not: a match lies inside it, not at its callers (timm's 200 registry functions all call
    # `_create_vision_transformer`, which names nn.Linear)
    classes = sorted(module.body[i].name.value for i in seeds if isinstance(module.body[i], cst.ClassDef))  # type: ignore[attr-defined]
    called = r"\b(?:" + "|".join(map(re.escape, classes)) + r")\s*[(.]" if classes else None
    alias = r"\b(?:" + "|".join(map(re.escape, sorted(aliases))) + r")\b" if aliases else None
    pattern = re.compile("|".join(p for p in (called, alias) if p)) if called or alias else None
    unread = [i for i in defs if i not in seeds and (pattern is None or not pattern.search(texts[i]))]
    tables = [
        i
        for i in others
        if _plain_assignment(module.body[i])
        and texts[i].count("\n") > 1
        and not words.search(_STRINGS.sub('""', texts[i]))  # a word in a table's strings is no call
        and (pattern is None or not pattern.search(texts[i]))
    ]
    return frozenset(id(module.body[i]) for i in (*unread, *tables))


def _called_by(module: cst.Module, defs: Sequence[int], seeds: set[int], texts: Sequence[str]) -> set[int]:
    """The top-level functions a seed calls by name (timm's `attn = maybe_add_mask(attn, bias)` in a seed
    that names softmax): a matcher may read a small helper's body in the seed's chain."""
    functions = {
        module.body[i].name.value: i  # type: ignore[attr-defined]
        for i in defs
        if i not in seeds and isinstance(module.body[i], cst.FunctionDef)
    }
    if not functions or not seeds:
        return set()
    call = re.compile(r"\b(" + "|".join(map(re.escape, sorted(functions))) + r")\s*\(")
    return {functions[name] for i in seeds for name in call.findall(texts[i])}


def _plain_assignment(stmt: cst.CSTNode) -> bool:
    """`a = b = <expression>` (one statement on its line): all it binds is its target names."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return False
    assign = stmt.body[0]
    return isinstance(assign, cst.Assign) and all(isinstance(t.target, cst.Name) for t in assign.targets)


def _aliases(
    module: cst.Module,
    others: Iterable[int],
    texts: Sequence[str],
    bound: dict[int, set[str]],
    words: re.Pattern[str],
    seeds: set[str],
) -> set[str]:
    """The names bound by the non-def statements that name a word, a seed or (transitively) such a name;
    of an import, the names whose own import names one (`softmax as sm`, not every name of
    `from timm.layers import Mlp, PatchDropout, ...`)."""
    aliases: set[str] = set()
    for i in others:
        if _only_imports(module.body[i]):
            aliases |= _imported_aliases(module.body[i], words)  # type: ignore[arg-type]
    pending = [i for i in others if bound.get(i)]
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


def _only_imports(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )


def _imported_aliases(stmt: cst.SimpleStatementLine, words: re.Pattern[str]) -> set[str]:
    """The names an import line binds to something whose own name names a word."""
    found: set[str] = set()
    for imp in stmt.body:
        names = imp.names  # type: ignore[attr-defined]  # an import line (_only_imports)
        for alias in names if not isinstance(names, cst.ImportStar) else ():
            if words.search(get_full_name_for_node(alias.name) or ""):
                found |= _bound_names(alias)
    return found


class _Binder(Visitor):
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


# ---- a slim module: what a static pass reads, on the original's lines ------------------------------------------
_SLIM_MIN_SHARE = 0.3  # slim a module only when its unread definitions hold at least this share of its lines


def slim_module(
    module: cst.Module, words: Sequence[str], source: bytes | None = None
) -> tuple[cst.Module, dict[int, cst.CSTNode]] | None:
    """`module` with each top-level definition a pass with these words need not read stood in for by a
    one-line `class Name: pass` / `def name(): pass` after as many blank lines as the definition had lines
    (so every statement kept has its own line numbers, and the name stays bound), and the stand-ins'
    ids -> the definitions; None where that would save little (libcst's metadata, most of a static pass's
    time on a long file, is computed over every node: timm's registry functions and configuration tables)."""
    unread = unread_statements(module, words)
    if not unread:
        return None
    texts, _ = _texts_and_names(module)
    lines = {id(s): texts[i].count("\n") for i, s in enumerate(module.body) if id(s) in unread}
    total = (source.decode("utf-8", "replace") if source is not None else module.code).count("\n")
    if sum(n for n in lines.values() if n > 1) < _SLIM_MIN_SHARE * max(total, 1):
        return None
    originals: dict[int, cst.CSTNode] = {}
    body: list[cst.BaseStatement] = []
    for stmt in module.body:
        n = lines.get(id(stmt), 0)
        if n > 1:
            stand_in = _stand_in(stmt, n)
            if module.code_for_node(stand_in).count("\n") != n:
                return None  # a stand-in that does not keep the lines: read the whole module
            originals[id(stand_in)] = stmt
            stmt = stand_in
        body.append(stmt)
    return module.with_changes(body=body), originals


def _stand_in(stmt: cst.BaseStatement, lines: int) -> cst.BaseStatement:
    blank = [cst.EmptyLine()] * (lines - 1)
    suite = cst.SimpleStatementSuite([cst.Pass()])
    if isinstance(stmt, cst.ClassDef):
        return cst.ClassDef(name=stmt.name, body=suite, leading_lines=blank)
    if isinstance(stmt, cst.FunctionDef):
        return cst.FunctionDef(name=stmt.name, params=cst.Parameters(), body=suite, leading_lines=blank)
    targets = stmt.body[0].targets  # type: ignore[attr-defined]  # a plain assignment (_plain_assignment)
    return cst.SimpleStatementLine([cst.Assign(targets=targets, value=cst.Name("None"))], leading_lines=blank)


def restored(module: cst.Module, originals: dict[int, cst.CSTNode]) -> cst.Module | None:
    """A pass's output over a slim module with its stand-ins replaced by the definitions again; None when a
    stand-in did not come back unchanged (the pass is then run over the whole module)."""
    body = [originals.get(id(stmt), stmt) for stmt in module.body]
    back = sum(1 for stmt in module.body if id(stmt) in originals)
    return module.with_changes(body=body) if back == len(originals) else None
