"""Codemods for findings in library code: what `opadvisor apply` writes into the user's script when the
pattern lives in an installed package (transformers, torch.nn's attention layers) it must not edit.

The finding (`Finding.library`, opadvisor/rules/_library.py) names the fix (opadvisor/libraries.py) and
the user's line it goes to; the engine targets that line:

- `LibraryPatchCodemod` ("library_patch"): after the statement that builds or loads the model
  (`model = BertForMaskedLM(config)`, `model = AutoModel.from_pretrained(...)`), inserts
  `model = opadvisor.patch(model, rules=[...])` with `import opadvisor`; a construction that is not a plain
  assignment (`return Model(...)`, `train(Model(...))`) gets its call wrapped instead:
  `opadvisor.patch(Model(...), rules=[...])`. Idempotent: an existing `opadvisor.patch(...)` of that model
  gets the missing rules added, nothing else. Safety: the patch's own (`unsafe=True` is written for an
  unsafe one).
- `HfAttnImplementationCodemod` ("hf_attn_implementation"): transformers' own switch for its fused
  attention. `X.from_pretrained(...)` / `X.from_config(...)` get `attn_implementation="sdpa"` (an
  explicit "eager" literal is changed); a model built by its constructor gets
  `model.set_attn_implementation("sdpa")` on the next line. Refused with the reason: a computed value
  (`attn_implementation=args.attn`), `**kwargs` that may set it; `suggest` offers the run-time switch there
  instead (`hf_attn_switch`: `opadvisor.patch` sets it per instance when the model runs "eager", so a
  script run with `--attn flash_attention_2` keeps its choice). Safe: the same function (transformers'
  SDPA path), dropout drawing its own masks.
- `MhaNeedWeightsCodemod` ("mha_need_weights"): at the user's call of an `nn.MultiheadAttention` whose
  weights are dropped (`out, _ = self.attn(q, k, v)`, `self.attn(q, k, v)[0]` in an assignment, a sum or
  a return), adds
  `need_weights=False` (an explicit `need_weights=True` becomes False), so torch runs
  `scaled_dot_product_attention` instead of materialising the weights. Refused where the weights are kept
  (`out, w = ...`). Safe: the output is the same function.

- `TimmFusedAttnCodemod` ("timm_fused_attn", and "timm_fused_attn_experimental" for the modules timm
  marks experimental): `timm.layers.set_fused_attn(True)` (`, experimental=True`) on the line before the
  model's construction, with `import timm`. timm's attention modules read the switch once, in their
  __init__, so it goes before the model is built: one line that holds for every module the model builds
  (a per-module `m.fused_attn = True` after the construction would be a loop in the user's script, and
  `fused_attn` is a TorchScript `Final`). Idempotent: the line before already setting it is left alone;
  `set_fused_attn(True)` there becomes the experimental form when that is needed. Safe for the tested
  modules (timm's SDPA branch computes the same function); unsafe for the experimental ones.

All of them compose with the rules' own rewrites of the same lines (`COMPOSES`): they insert after a line or
add a keyword, and a line another rule rewrote (`fused=True` on an optimizer) still takes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.libraries import LOADERS
from opadvisor.rewrite._args import append_keywords, has_star_args, keyword, layout, replace_keyword_value
from opadvisor.rewrite._match import code, qualified
from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rules.facts import Facts

PATCH_NAMES = frozenset({"opadvisor.patch", "opadvisor.patching.patch"})


@dataclass
class LibraryFixFacts(Facts):
    """What the engine hands a library fix's target (built from the finding's `library` block, not read
    from its facts): the rules the fix serves, whether it is unsafe, and the fix's name
    (opadvisor/libraries.py)."""

    rules: list[str] = field(default_factory=list)
    unsafe: bool = False
    fix: str | None = None


def _rules_of(facts: Sequence[LibraryFixFacts | None]) -> list[str]:
    """The rules the targets' facts ask the patch for, in a stable order."""
    return sorted({r for f in facts if f is not None for r in f.rules})


def _string_list(values: Sequence[str]) -> cst.List:
    elements = [
        cst.Element(
            cst.SimpleString(f'"{v}"'),
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            if i < len(values) - 1
            else cst.MaybeSentinel.DEFAULT,
        )
        for i, v in enumerate(values)
    ]
    return cst.List(elements)


def _listed_strings(node: cst.BaseExpression) -> list[str] | None:
    if not isinstance(node, cst.List | cst.Tuple):
        return None
    out = []
    for el in node.elements:
        if not isinstance(el.value, cst.SimpleString):
            return None
        out.append(el.value.evaluated_value)
    return out


class _AtStatement(RuleCodemod):
    """A codemod whose targets are user lines holding one statement to edit or to insert a line after.

    Statements are handled where their block is left (`leave_Module`, `leave_IndentedBlock`), so that the
    statement after a target can be read: an inserted line that is already there makes no change.
    """

    COMPOSES: ClassVar[bool] = True
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)
    FACTS: ClassVar[type[Facts] | None] = LibraryFixFacts
    previous: cst.BaseStatement | None = None  # the statement before the one `statement` is handling

    def _targets_at(self, node: cst.CSTNode) -> list[Target]:
        if self.targets is None:
            return []  # no static mode: which model (or call) it is comes from the profile
        start, end = self.lines_of(node)
        return [t for t in self.targets if start <= t.line <= end]

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._body(original_node.body, updated_node.body))

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        return updated_node.with_changes(body=self._body(original_node.body, updated_node.body))

    def _body(self, original: Sequence[cst.BaseStatement], updated: Sequence[cst.BaseStatement]) -> list:
        body = list(updated)
        out: list[cst.BaseStatement] = []
        for i, orig in enumerate(original):
            targets = self._targets_at(orig) if isinstance(orig, cst.SimpleStatementLine) else []
            if not targets:
                out.append(body[i])
                continue
            self.previous = out[-1] if out else None
            emitted, later = self.statement(orig, body[i], body[i + 1 :], targets)  # type: ignore[arg-type]
            if -1 in later and out:  # the statement before the target, replaced
                out[-1] = later.pop(-1)
            out.extend(emitted)
            for offset, stmt in later.items():
                body[i + 1 + offset] = stmt
        return out

    def statement(
        self,
        original: cst.SimpleStatementLine,
        updated: cst.SimpleStatementLine,
        rest: list[cst.BaseStatement],
        targets: list[Target],
    ) -> tuple[list[cst.BaseStatement], dict[int, cst.BaseStatement]]:
        """The statements that replace a targeted one, and replacements for statements after it (by their
        index in `rest`; -1: the statement before it, `self.previous`)."""
        raise NotImplementedError


class LibraryPatchCodemod(_AtStatement):
    """Insert `model = opadvisor.patch(model, rules=[...])` after the model's construction."""

    RULE: ClassVar[str] = "library_patch"
    NO_KERNEL_OP: ClassVar[str] = (
        "opadvisor.patch picks at run time, per module instance, which fused forward (and so which ops) "
        "to swap in: the inserted line names none"
    )
    SAFETY: ClassVar[str] = "safe"

    def statement(self, original, updated, rest, targets):
        facts = [self.facts_of(t) for t in targets]
        rules = _rules_of(facts)
        unsafe = any(f is not None and f.unsafe for f in facts)
        stmt = original.body[0] if len(original.body) == 1 else None
        if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
            return [self._wrap_call(original, updated, rules, unsafe)], {}
        target = stmt.targets[0].target
        if not isinstance(target, cst.Name | cst.Attribute) or self._patches(stmt.value):
            return [self._wrap_call(original, updated, rules, unsafe)], {}
        name = code(target)
        # an earlier apply's line: after the construction, past other lines apply inserts there
        offset = next((i for i, s in enumerate(rest) if not _set_attn_of(s, name)), None)
        there = _patch_assignment(rest[offset]) if offset is not None else None
        if there is not None and there[0] == name:
            have, was_unsafe = there[1], there[2]
            merged = sorted(set(have or []) | set(rules))
            if have is None or (merged == sorted(have) and (was_unsafe or not unsafe)):
                self.skip(original, f"already done: {name} goes through opadvisor.patch with these rules")
                return [updated], {}
            call = self._patch_call(cst.parse_expression(name), merged, unsafe or was_unsafe)
            old = rest[offset]
            new = old.with_changes(body=[old.body[0].with_changes(value=call)])  # type: ignore[attr-defined]
            self.record_change(
                original, f"opadvisor.patch(..., rules={merged}): rules added to the patch of {name}"
            )
            return [updated], {offset: new}
        AddImportsVisitor.add_needed_import(self.context, "opadvisor")
        call = self._patch_call(cst.parse_expression(name), rules, unsafe)
        line = cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(target)], value=call)])
        self.record_change(
            original,
            f"{name} = opadvisor.patch({name}, rules={rules}): fused forwards for the library's modules, per "
            "instance, checked on their first call",
        )
        return [updated, line], {}

    def _patch_call(self, model: cst.BaseExpression, rules: list[str], unsafe: bool) -> cst.Call:
        args = [cst.Arg(model), cst.Arg(_string_list(rules), keyword=cst.Name("rules"), equal=_EQUAL)]
        if unsafe:
            args.append(cst.Arg(cst.Name("True"), keyword=cst.Name("unsafe"), equal=_EQUAL))
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        args = [a.with_changes(comma=comma) for a in args[:-1]] + [args[-1]]
        return cst.Call(cst.Attribute(cst.Name("opadvisor"), cst.Name("patch")), args)

    def _patches(self, value: cst.BaseExpression) -> bool:
        return isinstance(value, cst.Call) and bool(qualified(self, value.func) & PATCH_NAMES)

    def _wrap_call(
        self,
        original: cst.SimpleStatementLine,
        updated: cst.SimpleStatementLine,
        rules: list[str],
        unsafe: bool,
    ) -> cst.SimpleStatementLine:
        """`return Model(...)` / `f(Model(...))`: the construction call wrapped in opadvisor.patch."""
        existing = [c for c in m.findall(original, m.Call()) if self._patches(c)]
        if existing:
            arg = keyword(existing[0], "rules")
            have = _listed_strings(arg.value) if arg is not None else None
            if have is None and arg is None or have is not None and set(rules) <= set(have):
                self.skip(original, "already done: the model goes through opadvisor.patch with these rules")
                return updated
            self.skip(original, "the model already goes through opadvisor.patch here; add the rules by hand")
            return updated
        calls = [c for c in m.findall(original, m.Call()) if _builds_model(c)]
        if len(calls) != 1:
            self.skip(
                original,
                "cannot tell which call on this line builds the model; add `model = opadvisor.patch(model)` after "
                "it by hand",
            )
            return updated
        AddImportsVisitor.add_needed_import(self.context, "opadvisor")
        wrapped = self._patch_call(calls[0], rules, unsafe)
        self.record_change(original, f"opadvisor.patch({code(calls[0].func)}(...), rules={rules})")
        return updated.deep_replace(_find_equal(updated, calls[0]), wrapped)  # type: ignore[return-value]


def _builds_model(call: cst.Call) -> bool:
    """A loader (`X.from_pretrained(...)`) or a class call (`BertForMaskedLM(config)`)."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value in LOADERS:
        return True
    name = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", "")
    return bool(name) and name[:1].isupper()


_EQUAL = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def _find_equal(root: cst.CSTNode, node: cst.CSTNode) -> cst.CSTNode:
    """The call in `root` (an updated tree) structurally equal to `node` from the original tree."""
    for candidate in m.findall(root, m.Call()):
        if candidate.deep_equals(node):
            return candidate
    return node


def _set_attn_of(stmt: cst.BaseStatement, target: str) -> bool:
    """Whether `stmt` is `<target>.set_attn_implementation(...)` (a line apply inserts after the model)."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    expr = stmt.body[0]
    return (
        isinstance(expr, cst.Expr)
        and isinstance(expr.value, cst.Call)
        and code(expr.value.func) == f"{target}.set_attn_implementation"
    )


def _patch_assignment(stmt: cst.BaseStatement) -> tuple[str, list[str] | None, bool] | None:
    """(target, rules, unsafe) of a statement `X = opadvisor.patch(X, rules=[...])`, else None."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    assign = stmt.body[0]
    if (
        not isinstance(assign, cst.Assign)
        or len(assign.targets) != 1
        or not isinstance(assign.value, cst.Call)
    ):
        return None
    call = assign.value
    if code(call.func) not in ("opadvisor.patch", "opadvisor.patching.patch") or not call.args:
        return None
    target = code(assign.targets[0].target)
    if code(call.args[0].value) != target:
        return None
    rules_arg = keyword(call, "rules")
    rules = _listed_strings(rules_arg.value) if rules_arg is not None else None
    unsafe_arg = keyword(call, "unsafe")
    return target, rules, unsafe_arg is not None and code(unsafe_arg.value) == "True"


class HfAttnImplementationCodemod(_AtStatement):
    """transformers' attn_implementation="sdpa" where the model is built or loaded."""

    RULE: ClassVar[str] = "hf_attn_implementation"
    NO_KERNEL_OP: ClassVar[str] = 'attn_implementation="sdpa" selects transformers\' own SDPA attention'
    SAFETY: ClassVar[str] = "safe"

    def statement(self, original, updated, rest, targets):
        loaders = [
            c
            for c in m.findall(original, m.Call(func=m.Attribute()))
            if c.func.attr.value in LOADERS  # type: ignore[attr-defined]
        ]
        if len(loaders) == 1:
            return [self._set_keyword(original, updated, loaders[0])], {}
        stmt = original.body[0] if len(original.body) == 1 else None
        if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1):
            self.skip(
                original,
                'cannot tell which call builds the model here: pass attn_implementation="sdpa" by hand',
            )
            return [updated], {}
        target = code(stmt.targets[0].target)
        if rest and _set_attn_of(rest[0], target):
            self.skip(original, f"already done: {target}.set_attn_implementation follows")
            return [updated], {}
        line = cst.parse_statement(f'{target}.set_attn_implementation("sdpa")')
        self.record_change(
            original, f'{target}.set_attn_implementation("sdpa"): transformers\' fused attention (SDPA)'
        )
        return [updated, line], {}

    def _set_keyword(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, call: cst.Call
    ) -> cst.SimpleStatementLine:
        arg = keyword(call, "attn_implementation")
        if arg is None and has_star_args(call):
            self.skip(original, f"the call unpacks {has_star_args(call)}, which may set attn_implementation")
            return updated
        if arg is not None:
            value = arg.value.evaluated_value if isinstance(arg.value, cst.SimpleString) else None
            if value == "sdpa":
                self.skip(original, 'already done: attn_implementation="sdpa"')
                return updated
            if value != "eager":
                self.skip(
                    original,
                    f'attn_implementation={code(arg.value)} is computed here; the profile saw "eager": set it to '
                    '"sdpa" by hand',
                )
                return updated
            new = replace_keyword_value(call, "attn_implementation", cst.SimpleString('"sdpa"'))
        else:
            new = append_keywords(
                call, [("attn_implementation", cst.SimpleString('"sdpa"'))], **layout(self, call)
            )
        self.record_change(original, 'attn_implementation="sdpa": transformers\' fused attention (SDPA)')
        return updated.deep_replace(_find_equal(updated, call), new)  # type: ignore[return-value]


class MhaNeedWeightsCodemod(_AtStatement):
    """need_weights=False at a call of an nn.MultiheadAttention whose weights are dropped."""

    RULE: ClassVar[str] = "mha_need_weights"
    NO_KERNEL_OP: ClassVar[str] = "need_weights=False lets nn.MultiheadAttention take its own fused path"
    SAFETY: ClassVar[str] = "safe"

    def statement(self, original, updated, rest, targets):
        stmt = original.body[0] if len(original.body) == 1 else None
        call = _dropped_weights_call(stmt)
        if call is None:
            self.skip(
                original,
                "the attention weights are kept here (or the result is not unpacked as `out, _ = ...` or indexed "
                "`[0]`): need_weights=False would drop them",
            )
            return [updated], {}
        arg = keyword(call, "need_weights")
        if arg is not None and code(arg.value) == "False":
            self.skip(original, "already done: need_weights=False")
            return [updated], {}
        if arg is None and has_star_args(call):
            self.skip(original, f"the call unpacks {has_star_args(call)}, which may set need_weights")
            return [updated], {}
        if arg is not None:
            new = replace_keyword_value(call, "need_weights", cst.Name("False"))
        else:
            new = append_keywords(call, [("need_weights", cst.Name("False"))], **layout(self, call))
        self.record_change(original, "need_weights=False: the weights are dropped; torch then runs SDPA")
        return [updated.deep_replace(_find_equal(updated, call), new)], {}


def _dropped_weights_call(stmt: cst.BaseSmallStatement | None) -> cst.Call | None:
    """The attention call whose weights the statement drops, else None: `out, _ = attn(...)` (any name
    starting with `_`), or one `attn(...)[0]` anywhere in it (`y = attn(...)[0]`, `x = x + attn(...)[0]`,
    `return attn(...)[0]`). Two indexed calls on one statement: None (which one the profile saw is unknown)."""
    if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0].target, stmt.value
        if isinstance(value, cst.Call) and isinstance(target, cst.Tuple):
            if len(target.elements) != 2:
                return None
            second = target.elements[1].value
            return value if isinstance(second, cst.Name) and second.value.startswith("_") else None
    if stmt is None:
        return None
    indexed = [
        node.value
        for node in m.findall(stmt, m.Subscript(value=m.Call()))
        if len(node.slice) == 1  # type: ignore[attr-defined]
        and isinstance(node.slice[0].slice, cst.Index)  # type: ignore[attr-defined]
        and code(node.slice[0].slice.value) == "0"  # type: ignore[attr-defined]
    ]
    return indexed[0] if len(indexed) == 1 else None  # type: ignore[return-value]


class TimmFusedAttnCodemod(_AtStatement):
    """timm's fused attention switch, `timm.layers.set_fused_attn(True)`, on the line before the model is
    built: timm modules read it in their __init__ (`self.fused_attn = use_fused_attn()`), so it must come
    first; it overrides TIMM_FUSED_ATTN=0 and an earlier set_fused_attn(False)."""

    RULE: ClassVar[str] = "timm_fused_attn"
    SAFETY: ClassVar[str] = "safe"
    NO_KERNEL_OP: ClassVar[str] = "set_fused_attn(True) selects timm's own SDPA attention"
    EXPERIMENTAL: ClassVar[bool] = False
    _timm_imported: bool = False

    def visit_Module(self, node: cst.Module) -> None:
        self._timm_imported = any(
            code(alias.name) == "timm" and alias.asname is None
            for imp in m.findall(node, m.Import())
            for alias in imp.names  # type: ignore[attr-defined]
        )

    def statement(self, original, updated, rest, targets):
        have = _fused_attn_switch(self.previous)
        if have is not None and (have or not self.EXPERIMENTAL):
            self.skip(
                original, "already done: timm.layers.set_fused_attn(True) comes before the model is built"
            )
            return [updated], {}
        args = _switch_args(self.EXPERIMENTAL)
        self.record_change(
            original,
            f"timm.layers.set_fused_attn({args}) before the model is built: timm's fused attention (SDPA)",
        )
        if have is not None:  # set_fused_attn(True) before: the experimental modules need more
            return [updated], {-1: _with_experimental(self.previous)}  # type: ignore[arg-type]
        if not self._timm_imported:  # an `import timm` after other statements (an env var first) stays put
            AddImportsVisitor.add_needed_import(self.context, "timm")
        return [cst.parse_statement(f"timm.layers.set_fused_attn({args})"), updated], {}


class TimmFusedAttnExperimentalCodemod(TimmFusedAttnCodemod):
    """The same switch for the modules timm marks experimental: `set_fused_attn(True, experimental=True)`
    (which turns on the tested ones too)."""

    RULE: ClassVar[str] = "timm_fused_attn_experimental"
    SAFETY: ClassVar[str] = "unsafe"
    EXPERIMENTAL: ClassVar[bool] = True


def _switch_args(experimental: bool) -> str:
    return "True, experimental=True" if experimental else "True"


def _with_experimental(stmt: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """`set_fused_attn(True)` as the user spelt it, with `experimental=True` added."""
    expr = stmt.body[0]
    call = expr.value  # type: ignore[attr-defined]
    flag = cst.Arg(cst.Name("True"), keyword=cst.Name("experimental"), equal=_EQUAL)
    first = call.args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    new_call = call.with_changes(args=[first, flag])
    return stmt.with_changes(body=[expr.with_changes(value=new_call)])  # type: ignore[attr-defined]


def _fused_attn_switch(stmt: cst.BaseStatement | None) -> bool | None:
    """For a statement `timm.layers.set_fused_attn(True[, experimental=True])` (any spelling of the module
    path): whether it turns on the experimental modules too; None for any other statement."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    expr = stmt.body[0]
    if not (isinstance(expr, cst.Expr) and isinstance(expr.value, cst.Call)):
        return None
    call = expr.value
    if not code(call.func).endswith("set_fused_attn") or not call.args or code(call.args[0].value) != "True":
        return None
    flag = keyword(call, "experimental")
    positional = call.args[1].value if len(call.args) > 1 and call.args[1].keyword is None else None
    value = flag.value if flag is not None else positional
    return value is not None and code(value) == "True"
