"""Codemod for `manual_layernorm`: a layer norm written as mean/var/sqrt ops becomes one `layer_norm` call.

What it rewrites: a run of consecutive simple statements in one block (a module's `forward`, a free
function, a script) that computes

    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)    # or ((x - mean) ** 2).mean(-1, keepdim=True), .pow(2),
                                                     # correction=0, `var, mean = torch.var_mean(...)`
    x = (x - mean) / torch.sqrt(var + self.eps)      # or * torch.rsqrt(var + eps), (var + eps).sqrt(), ** 0.5
    x = self.weight * x + self.bias                  # optional; any order; or `return ...`

in any split into statements (temporaries inlined, one expression, `return`), becomes

    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

(`x.shape[-k:]` for statistics over the last k dimensions, `dim=(-2, -1)`), spelled with the file's own
alias of `torch.nn.functional` (`F.layer_norm`) or imported function when it has one. Comments of the
removed statements move above the new one. A biased std with no eps (`(x - mean) / std`) becomes eps=0.0.

Fix safety: safe for the forms above (the same function up to rounding; `F.layer_norm` computes the
statistics in float32 for half inputs, and under autocast returns float32 like `nn.LayerNorm`). Unsafe, and
skipped unless the codemod is built with `allow_unsafe=True`: an unbiased variance or standard deviation
(`x.var(-1, keepdim=True)`, `x.std(...)`: divides by N-1), and eps added outside the square root
(`(x - mean) / (std + eps)`). Never rewritten, with the reason: statistics over other dimensions than the
trailing ones (or different ones for the mean and the variance), temporaries (`mean`, `var`, ...) read
again after the pattern (ScopeProvider accesses; a read after the name is rebound does not count),
statements interleaved with other code, and a `self.weight`/`self.bias` that `__init__` builds with a
shape of more than one dimension (layer_norm needs exactly the normalized shape).

A target selects the patterns whose statements overlap its lines; its facts (`LayerNormFacts`) must
describe the same statistics: a pattern reducing another number of trailing dimensions than the profile
saw there is left, with the reason (the file is not the one profiled).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider, ScopeProvider
from libcst.metadata.scope_provider import ClassScope, FunctionScope, Scope

from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rewrite.toolkit import (
    bind_args,
    block_index,
    class_info,
    code,
    enclosing_class,
    number_value,
    qualified,
    reference,
    self_attr,
)
from opadvisor.rules.layernorm.manual_layernorm import LayerNormFacts

# Per statistic: the positional parameters of the tensor method; the torch function takes `input` first.
_SIGNATURES = {
    "mean": ("dim", "keepdim", "dtype"),
    "var": ("dim", "unbiased", "keepdim", "correction"),
    "std": ("dim", "unbiased", "keepdim", "correction"),
}
PARAMETER_CLASSES = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
FILLED_TENSORS = frozenset({"torch.ones", "torch.zeros", "torch.randn", "torch.rand", "torch.empty"})


def _is_number(expr: cst.BaseExpression, value: float) -> bool:
    return number_value(expr) == value


def _is_true(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "True"


def _is_false(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "False"


def _simple_root(expr: cst.BaseExpression) -> str | None:
    """The root name of a side-effect-free operand (`eps`, `self.weight`, `1e-5` -> ""), else None."""
    if isinstance(expr, cst.Integer | cst.Float):
        return ""
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Minus):
        return _simple_root(expr.expression)
    while isinstance(expr, cst.Attribute):
        expr = expr.value
    return expr.value if isinstance(expr, cst.Name) else None


class _NoMatch(Exception):
    pass


def _attempt(method: Callable[..., bool]) -> Callable[..., bool]:
    """A sub-pattern test that leaves the match as it found it when it fails."""

    @functools.wraps(method)
    def wrapper(self: _BlockMatcher, *args: Any) -> bool:
        mt: _Match = args[-1]
        saved = dataclasses.replace(mt, used=set(mt.used), unsafe=list(mt.unsafe))
        try:
            if method(self, *args):
                return True
        except _NoMatch:
            pass
        for f in dataclasses.fields(mt):
            setattr(mt, f.name, getattr(saved, f.name))
        return False

    return wrapper


@dataclass
class _Match:
    """One layer norm found in a block: statement indices, operands, and what makes it unsafe."""

    output: int
    used: set[int] = field(default_factory=set)
    x: tuple[str, int | None] | None = None  # (name, index of the statement binding it; None = before)
    x_node: cst.Name | None = None
    weight: cst.BaseExpression | None = None
    bias: cst.BaseExpression | None = None
    eps: cst.BaseExpression | None = None
    dims: int | None = None  # k: the statistics reduce the last k dimensions
    other_dim: str | None = None  # the dim when it is not trailing, or differs between the statistics
    unsafe: list[str] = field(default_factory=list)


class _BlockMatcher:
    """Match a layer norm ending at statement `output` of `stmts`, inlining earlier assignments."""

    def __init__(
        self,
        codemod: ManualLayerNormCodemod,
        stmts: Sequence[cst.BaseStatement],
        start: int,
        values: list[dict[str, cst.BaseExpression]],
    ) -> None:
        self.codemod = codemod
        self.stmts = stmts
        self.start = start  # first statement of the window of consecutive simple statements
        self.index = block_index(stmts)  # what each statement binds, any way: built once per block
        self.bound = values  # per statement, the values the layer norm reads its names as

    # ---- the statements -------------------------------------------------------------------------------------
    def value_of(self, k: int) -> cst.BaseExpression:
        return self.stmts[k].body[0].value  # type: ignore[attr-defined]

    def binding(self, name: str, at: int) -> int | None:
        """The statement of the window that last bound `name` before statement `at` (None: before it)."""
        found = self.index.lookup(name, at, self.start)
        return None if found is None else found.index

    def deref(self, expr: cst.BaseExpression, at: int, mt: _Match) -> tuple[cst.BaseExpression, int]:
        # each step goes to a statement before `at` (relative to the binding followed): it ends
        while isinstance(expr, cst.Name):
            k = self.binding(expr.value, at)
            value = None if k is None else self.bound[k].get(expr.value)
            if k is None or value is None:  # bound before the window, or some other way (`x += 1`): a leaf
                break
            mt.used.add(k)
            expr, at = value, k
        return expr, at

    # ---- patterns -------------------------------------------------------------------------------------------
    def match(self, output: int) -> _Match:
        mt = _Match(output=output)
        if isinstance(self.value_of(output), cst.Name):
            raise _NoMatch  # `return x`: the computation is in the statements before
        expr, at = self.deref(self.value_of(output), output, mt)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            for norm, bias, nat in ((expr.left, expr.right, at), (expr.right, expr.left, at)):
                trial = _Match(output=output, used=set(mt.used))
                try:
                    self.scaled_norm(norm, nat, trial)
                    trial.bias = self.operand(bias, nat, trial)
                except _NoMatch:
                    continue
                return trial
        self.scaled_norm(expr, at, mt)
        return mt

    def operand(self, expr: cst.BaseExpression, at: int, mt: _Match) -> cst.BaseExpression:
        """A weight, bias or eps: side-effect free, not the input, not bound inside the pattern."""
        root = _simple_root(expr)
        if root is None or (mt.x is not None and root == mt.x[0]):
            raise _NoMatch
        if root and self.binding(root, at) is not None:
            raise _NoMatch
        return expr

    def factors(self, expr: cst.BaseExpression, at: int, sign: int, mt: _Match) -> list[tuple]:
        expr, at = self.deref(expr, at, mt)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Multiply | cst.Divide):
            inner = -sign if isinstance(expr.operator, cst.Divide) else sign
            return self.factors(expr.left, at, sign, mt) + self.factors(expr.right, at, inner, mt)
        return [(expr, at, sign)]

    def scaled_norm(self, expr: cst.BaseExpression, at: int, mt: _Match) -> None:
        """[weight *] (x - mean) / sqrt(var + eps), in any order of the product."""
        leaves = self.factors(expr, at, 1, mt)
        centre = [f for f in leaves if f[2] == 1 and self.is_centre(f[0], f[1], mt)]
        if len(centre) != 1:
            raise _NoMatch
        rest = [f for f in leaves if f is not centre[0]]
        scale = [f for f in rest if self.is_inv_std(f[0], f[1], f[2], mt)]
        if len(scale) != 1:
            raise _NoMatch
        rest = [f for f in rest if f is not scale[0]]
        if len(rest) > 1 or any(f[2] != 1 for f in rest):
            raise _NoMatch
        if rest:
            mt.weight = self.operand(rest[0][0], rest[0][1], mt)

    def input(self, expr: cst.BaseExpression, at: int, mt: _Match) -> None:
        """The normalized tensor: a plain name, the same binding everywhere in the pattern."""
        if not isinstance(expr, cst.Name):
            raise _NoMatch
        key = (expr.value, self.binding(expr.value, at))
        if mt.x is None:
            mt.x, mt.x_node = key, expr
        elif mt.x != key:
            raise _NoMatch

    def stat(
        self, expr: cst.BaseExpression, at: int, mt: _Match, names: tuple[str, ...]
    ) -> tuple[str, dict, int]:
        """`x.mean(-1, keepdim=True)` / `torch.var(x, dim=-1, ...)`: (kind, bound arguments, at)."""
        expr, at = self.deref(expr, at, mt)
        if not isinstance(expr, cst.Call):
            raise _NoMatch
        kinds = {f"torch.{n}" for n in names} & qualified(self.codemod, expr.func)
        if kinds:
            kind = sorted(kinds)[0].removeprefix("torch.")
            args = bind_args(expr, ("input", *_SIGNATURES[kind]))
        elif isinstance(expr.func, cst.Attribute) and expr.func.attr.value in names:
            kind = expr.func.attr.value
            args = bind_args(expr, _SIGNATURES[kind], required=0)
            if args is not None:
                args["input"] = cst.Arg(expr.func.value)
        else:
            raise _NoMatch
        if args is None:
            raise _NoMatch
        bound = {name: arg.value for name, arg in args.items()}
        if not _is_true(bound.get("keepdim")) or "dtype" in bound or "out" in bound:
            raise _NoMatch
        dim = bound.get("dim")
        if dim is None:
            raise _NoMatch
        dims = _trailing_dims(dim)
        if dims is None or mt.dims not in (None, dims):
            mt.other_dim = code(dim)
        elif mt.dims is None:
            mt.dims = dims
        return kind, bound, at

    @_attempt
    def is_mean(self, expr: cst.BaseExpression, at: int, mt: _Match) -> bool:
        try:
            kind, bound, at = self.stat(expr, at, mt, ("mean",))
            self.input(bound["input"], at, mt)
        except _NoMatch:
            return False
        return True

    @_attempt
    def is_centre(self, expr: cst.BaseExpression, at: int, mt: _Match) -> bool:
        """x - mean(x)."""
        expr, at = self.deref(expr, at, mt)
        if not (isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Subtract)):
            return False
        try:
            self.input(expr.left, at, mt)
        except _NoMatch:
            return False
        return self.is_mean(expr.right, at, mt)

    @_attempt
    def is_var(self, expr: cst.BaseExpression, at: int, mt: _Match) -> bool:
        """x.var(-1, keepdim=True, unbiased=False) or mean((x - mean) ** 2)."""
        try:
            kind, bound, at2 = self.stat(expr, at, mt, ("var", "mean"))
        except _NoMatch:
            return False
        if kind == "var":
            self.check_correction(bound, "variance", mt)
            try:
                self.input(bound["input"], at2, mt)
            except _NoMatch:
                return False
            return True
        square, sat = self.deref(bound["input"], at2, mt)
        base = None
        if isinstance(square, cst.BinaryOperation) and isinstance(square.operator, cst.Power):
            if _is_number(square.right, 2):
                base = square.left
        elif isinstance(square, cst.Call) and not any(a.keyword or a.star for a in square.args):
            func = square.func
            args = [a.value for a in square.args]
            if isinstance(func, cst.Attribute) and func.attr.value == "pow" and len(args) == 1:
                base = func.value if _is_number(args[0], 2) else None
            elif isinstance(func, cst.Attribute) and func.attr.value == "square" and not args:
                base = func.value
            elif "torch.square" in qualified(self.codemod, func) and len(args) == 1:
                base = args[0]
            elif "torch.pow" in qualified(self.codemod, func) and len(args) == 2 and _is_number(args[1], 2):
                base = args[0]
        return base is not None and self.is_centre(base, sat, mt)

    def check_correction(self, bound: dict, what: str, mt: _Match) -> None:
        correction = bound.get("correction")
        if correction is not None:
            biased = _is_number(correction, 0)
        else:
            biased = _is_false(bound.get("unbiased"))
        if not biased:
            mt.unsafe.append(f"the {what} is unbiased (divides by N-1; layer_norm divides by N)")

    def sqrt_arg(self, expr: cst.BaseExpression, at: int, mt: _Match, power: float) -> tuple | None:
        """The argument of sqrt (power 0.5) or rsqrt (power -0.5), in any spelling."""
        expr, at = self.deref(expr, at, mt)
        name = "sqrt" if power > 0 else "rsqrt"
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Power):
            return (expr.left, at) if _is_number(expr.right, power) else None
        if not isinstance(expr, cst.Call) or any(a.keyword or a.star for a in expr.args):
            return None
        args = [a.value for a in expr.args]
        if isinstance(expr.func, cst.Attribute) and expr.func.attr.value == name and not args:
            return expr.func.value, at
        if f"torch.{name}" in qualified(self.codemod, expr.func) and len(args) == 1:
            return args[0], at
        return None

    @_attempt
    def var_plus_eps(self, expr: cst.BaseExpression, at: int, mt: _Match) -> bool:
        expr, at = self.deref(expr, at, mt)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            for var, eps in ((expr.left, expr.right), (expr.right, expr.left)):
                saved = set(mt.used)
                if self.is_var(var, at, mt):
                    try:
                        mt.eps = self.operand(eps, at, mt)
                    except _NoMatch:
                        return False
                    return True
                mt.used = saved
            return False
        if self.is_var(expr, at, mt):
            mt.eps = cst.Float("0.0")
            return True
        return False

    @_attempt
    def is_std(self, expr: cst.BaseExpression, at: int, mt: _Match) -> bool:
        """x.std(-1, keepdim=True[, unbiased=False]) or sqrt(var) (no eps inside)."""
        arg = self.sqrt_arg(expr, at, mt, 0.5)
        if arg is not None:
            return self.is_var(*arg, mt)
        try:
            kind, bound, at2 = self.stat(expr, at, mt, ("std",))
            self.input(bound["input"], at2, mt)
        except _NoMatch:
            return False
        self.check_correction(bound, "standard deviation", mt)
        return True

    @_attempt
    def is_inv_std(self, expr: cst.BaseExpression, at: int, sign: int, mt: _Match) -> bool:
        """Divided by sqrt(var + eps) / (std + eps) / std, or multiplied by rsqrt(var + eps)."""
        if sign == 1:
            arg = self.sqrt_arg(expr, at, mt, -0.5)
            return arg is not None and self.var_plus_eps(*arg, mt)
        arg = self.sqrt_arg(expr, at, mt, 0.5)
        if arg is not None:
            return self.var_plus_eps(*arg, mt)
        expr, at = self.deref(expr, at, mt)
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            for std, eps in ((expr.left, expr.right), (expr.right, expr.left)):
                if self.is_std(std, at, mt):
                    try:
                        mt.eps = self.operand(eps, at, mt)
                    except _NoMatch:
                        return False
                    mt.unsafe.append(
                        "eps is added to the standard deviation, not to the variance under the square root"
                    )
                    return True
            return False
        if self.is_std(expr, at, mt):
            mt.eps = cst.Float("0.0")
            return True
        return False


def _single(stmt: cst.BaseStatement) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def _trailing_dims(dim: cst.BaseExpression) -> int | None:
    """k when `dim` names the last k dimensions (`-1`, `(-2, -1)`, ...), else None."""
    if _is_number(dim, -1):
        return 1
    if isinstance(dim, cst.Tuple | cst.List) and dim.elements:
        values = sorted(number_value(e.value) or 0.0 for e in dim.elements)
        if values == [float(-i) for i in range(len(values), 0, -1)]:
            return len(values)
    return None


def _assigned_name(stmt: cst.BaseStatement) -> str | None:
    """`name` for a statement `name = value` (one target, a plain name), else None."""
    small = _single(stmt)
    if (
        isinstance(small, cst.Assign)
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
    ):
        return small.targets[0].target.value
    return None


def _is_output_stmt(stmt: cst.BaseStatement) -> bool:
    small = _single(stmt)
    return _assigned_name(stmt) is not None or (isinstance(small, cst.Return) and small.value is not None)


class ManualLayerNormCodemod(RuleCodemod):
    """Collapse hand-written layer norms into `torch.nn.functional.layer_norm` (facts read: reduce_dims)."""

    RULE: ClassVar[str] = "manual_layernorm"
    FACTS = LayerNormFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (r"mean\s*\(",)  # the statistics: .mean, var_mean, std_mean
    NO_KERNEL_OP: ClassVar[str] = "the layer norm becomes PyTorch's own layer_norm"
    SAFETY: ClassVar[str] = "safe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (
        PositionProvider,
        QualifiedNameProvider,
        ScopeProvider,
        ParentNodeProvider,
    )

    def __init__(
        self, context: CodemodContext, targets: Sequence[Target] | None = None, *, allow_unsafe: bool = False
    ) -> None:
        super().__init__(context, targets)
        self.allow_unsafe = allow_unsafe
        self._module = cst.Module(body=[])

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def bound_names(self, stmt: cst.BaseStatement) -> dict[str, tuple[cst.Name, cst.BaseExpression]]:
        """The names a simple statement binds, each with its Name node and the value it gets:
        `name = value`, and `var, mean = torch.var_mean(x, ...)` (also std_mean) read as
        `var = x.var(...)`, `mean = x.mean(dim, keepdim=...)`."""
        name = _assigned_name(stmt)
        if name is not None:
            small = stmt.body[0]  # type: ignore[attr-defined]
            return {name: (small.targets[0].target, small.value)}
        small = _single(stmt)
        if not (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.value, cst.Call)
            and m.matches(small.targets[0].target, m.Tuple([m.Element(m.Name()), m.Element(m.Name())]))
        ):
            return {}
        kinds = qualified(self, small.value.func) & {"torch.var_mean", "torch.std_mean"}
        args = bind_args(small.value, ("input", *_SIGNATURES["var"]))
        if not kinds or args is None:
            return {}
        stat = sorted(kinds)[0].removeprefix("torch.").removesuffix("_mean")
        x = args.pop("input").value
        kept = [cst.Arg(a.value, keyword=cst.Name(k)) for k, a in args.items()]
        spread = cst.Call(cst.Attribute(x, cst.Name(stat)), kept)
        mean = cst.Call(
            cst.Attribute(x, cst.Name("mean")), [a for a in kept if a.keyword.value in ("dim", "keepdim")]
        )
        first, second = (e.value for e in small.targets[0].target.elements)  # type: ignore[attr-defined]
        return {first.value: (first, spread), second.value: (second, mean)}  # type: ignore[attr-defined]

    def _values_bound(self, stmt: cst.BaseStatement) -> dict[str, cst.BaseExpression]:
        return {name: value for name, (_, value) in self.bound_names(stmt).items()}

    # ---- blocks -------------------------------------------------------------------------------------------
    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body = self._rewrite_block(original_node, list(original_node.body), list(updated_node.body))
        return updated_node if body is None else updated_node.with_changes(body=body)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = self._rewrite_block(original_node, list(original_node.body), list(updated_node.body))
        self.changes.sort(key=lambda n: n.line)
        self.skipped.sort(key=lambda n: n.line)
        return updated_node if body is None else updated_node.with_changes(body=body)

    def _rewrite_block(
        self, block: cst.CSTNode, original: list[cst.BaseStatement], updated: list[cst.BaseStatement]
    ) -> list[cst.BaseStatement] | None:
        found: list[_Match] = []
        start = 0
        # profile mode: a match's statements end at its output, so an output ending before every target
        # matches nothing wanted (not analysed)
        first_line = min((t.line for t in self.targets), default=0) if self.targets is not None else 0
        values: list[dict[str, cst.BaseExpression]] | None = None
        for i, stmt in enumerate(original):
            if not isinstance(stmt, cst.SimpleStatementLine):
                start = i + 1  # the window: consecutive simple statements (no control flow between)
                continue
            if not _is_output_stmt(stmt) or (first_line and self.lines_of(stmt)[1] < first_line):
                continue
            if values is None:
                values = [self._values_bound(s) for s in original]
            try:
                mt = _BlockMatcher(self, original, start, values).match(i)
            except _NoMatch:
                mt = None
            if mt is not None and mt.x is not None:
                mt.used.add(i)
                found.append(mt)
        # The longest pattern wins: a later output that consumes an earlier one replaces it.
        chosen: list[_Match] = []
        taken: set[int] = set()
        for mt in reversed(found):
            if mt.used & taken:
                continue
            if not any(self.targeted(original[k]) for k in mt.used):
                continue
            if self._accept(block, original, mt):
                chosen.append(mt)
            taken |= mt.used
        if not chosen:
            return None
        new_body = list(updated)
        for mt in chosen:  # from the end, so earlier indices stay valid
            first = min(mt.used)
            new_body[first : mt.output + 1] = [self._replacement(original, updated, mt)]
        return new_body

    def _accept(self, block: cst.CSTNode, stmts: list[cst.BaseStatement], mt: _Match) -> bool:
        first = min(mt.used)
        node = stmts[mt.output]
        if mt.used != set(range(first, mt.output + 1)):
            others = sorted(set(range(first, mt.output + 1)) - mt.used)
            self.skip(
                node,
                f"the layer norm's statements are interleaved with other code (line {self.lines_of(stmts[others[0]])[0]})",
            )
            return False
        if mt.x[1] is not None and mt.x[1] in mt.used:  # type: ignore[index]
            return False
        if mt.other_dim is not None:
            self.skip(
                node,
                f"layer norm over dim {mt.other_dim}, not the last dimension(s) (or not the same for every "
                "statistic): layer_norm cannot express it",
            )
            return False
        reason = self._profile_disagrees(stmts, mt)
        if reason:
            self.skip(node, reason)
            return False
        if mt.unsafe and not self.allow_unsafe:
            self.skip(
                node, "not equivalent to layer_norm: " + "; ".join(mt.unsafe) + " (allowed with allow_unsafe)"
            )
            return False
        reason = self._read_elsewhere(block, stmts, mt) or self._param_shape(block, mt)
        if reason:
            self.skip(node, reason)
            return False
        return True

    def _profile_disagrees(self, stmts: list[cst.BaseStatement], mt: _Match) -> str | None:
        """Why the profile's facts at this match describe other statistics (None: the same, or no facts)."""
        target = next((t for k in sorted(mt.used) if (t := self.targeted(stmts[k])) is not None), None)
        facts = self.facts_of(target) if target is not None else None
        trailing = list(range(-mt.dims, 0)) if mt.dims is not None else None
        if (
            facts is None
            or not facts.reduce_dims
            or trailing is None
            or sorted(facts.reduce_dims) == trailing
        ):
            return None
        return (
            f"the profile saw statistics over dims {facts.reduce_dims} here, the source takes them over "
            f"{trailing}: profile the file again"
        )

    def _read_elsewhere(self, block: cst.CSTNode, stmts: list[cst.BaseStatement], mt: _Match) -> str | None:
        """Why a temporary the rewrite removes is still needed (read after the pattern), else None."""
        first = min(mt.used)
        start = self.get_metadata(PositionProvider, stmts[first]).start
        end = self.get_metadata(PositionProvider, stmts[mt.output]).end
        out_target = stmts[mt.output].body[0]  # type: ignore[attr-defined]
        out_name = out_target.targets[0].target.value if isinstance(out_target, cst.Assign) else None
        removed = [
            (k, n, node)
            for k in sorted(mt.used - {mt.output})
            for n, (node, _) in self.bound_names(stmts[k]).items()
        ]
        for k, name, target_node in removed:
            if name == out_name or any(name in self.bound_names(stmts[j]) for j in range(k + 1, mt.output)):
                continue  # rebound later in the pattern: this binding is never seen outside it
            scope = self.get_metadata(ScopeProvider, target_node, None)
            if scope is None:
                return f"cannot tell where `{name}` is read"
            accesses = {id(a.node): a for asg in scope.assignments[name] for a in asg.references}
            for access in accesses.values():
                pos = self.get_metadata(PositionProvider, access.node).start
                if (start.line, start.column) <= (pos.line, pos.column) <= (end.line, end.column):
                    continue
                if self._dead_read(block, stmts, mt, name, scope, access.node, pos, start):
                    continue
                return f"`{name}` is read again on line {pos.line}: the temporaries cannot be collapsed"
        return None

    def _dead_read(self, block, stmts, mt, name, scope: Scope, node: cst.CSTNode, pos, start) -> bool:  # noqa: ANN001
        """True when a read of `name` cannot see the binding the pattern removes."""
        inner = self.get_metadata(ScopeProvider, node, None)
        while inner is not None and inner is not scope and not isinstance(inner, FunctionScope | ClassScope):
            inner = inner.parent  # comprehensions run in place
        if inner is not scope:
            return False  # read from a nested function or class: it may run at any time
        if (pos.line, pos.column) < (start.line, start.column):
            return not self._in_loop(block)
        # After the pattern: dead only if a later statement of this block rebinds the name first.
        for stmt in stmts[mt.output + 1 :]:
            spos = self.get_metadata(PositionProvider, stmt)
            if (
                (spos.start.line, spos.start.column)
                <= (pos.line, pos.column)
                <= (spos.end.line, spos.end.column)
            ):
                return False
            if name in self.bound_names(stmt):
                return True
        return False

    def _in_loop(self, block: cst.CSTNode) -> bool:
        node: cst.CSTNode | None = block
        while node is not None and not isinstance(node, cst.FunctionDef | cst.ClassDef | cst.Module):
            if isinstance(node, cst.For | cst.While):
                return True
            node = self.get_metadata(ParentNodeProvider, node, None)
        return False

    def _param_shape(self, block: cst.CSTNode, mt: _Match) -> str | None:
        """A `self.weight` / `self.bias` that `__init__` builds with more than one dimension."""
        attrs = [a for a in (self_attr(mt.weight), self_attr(mt.bias)) if a is not None]  # type: ignore[arg-type]
        cls = enclosing_class(self, block) if attrs else None
        if cls is None:
            return None
        info = class_info(cls)
        for attr in attrs:
            value = info.value(attr)
            if isinstance(value, cst.Call) and value.args and qualified(self, value.func) & PARAMETER_CLASSES:
                value = value.args[0].value
            if not isinstance(value, cst.Call) or not qualified(self, value.func) & FILLED_TENSORS:
                continue
            sizes = [a.value for a in value.args if a.keyword is None]
            if (
                any(a.star for a in value.args)
                or len(sizes) == 1
                and not isinstance(sizes[0], cst.Tuple | cst.List)
            ):
                continue
            if len(sizes) == 1 and len(sizes[0].elements) == 1:  # type: ignore[attr-defined]
                continue
            return (
                f"self.{attr} is built as {code(value)}: layer_norm needs a 1-D weight and bias of size "
                "x.shape[-1]"
            )
        return None

    # ---- the new statement ------------------------------------------------------------------------------
    def _replacement(
        self, original: list[cst.BaseStatement], updated: list[cst.BaseStatement], mt: _Match
    ) -> cst.BaseStatement:
        x = mt.x[0]  # type: ignore[index]
        args = [f"{x}", f"({x}.shape[-1],)" if mt.dims == 1 else f"{x}.shape[-{mt.dims}:]"]
        if mt.weight is not None and mt.bias is not None:
            args += [code(mt.weight), code(mt.bias), code(mt.eps)]  # type: ignore[arg-type]
        else:
            if mt.weight is not None:
                args.append(code(mt.weight))
            elif mt.bias is not None:
                args.append("None")
            if mt.bias is not None:
                args.append(code(mt.bias))
            args.append(f"eps={code(mt.eps)}")  # type: ignore[arg-type]
        func = code(reference(self.context, self._module, "torch.nn.functional.layer_norm"))
        call = cst.parse_expression(f"{func}({', '.join(args)})")

        first = min(mt.used)
        leading: list[cst.EmptyLine] = []
        for k in range(first, mt.output + 1):
            stmt = updated[k]
            leading.extend(stmt.leading_lines)
            if k != mt.output and stmt.trailing_whitespace.comment is not None:  # type: ignore[attr-defined]
                leading.append(cst.EmptyLine(comment=stmt.trailing_whitespace.comment))  # type: ignore[attr-defined]
        out = updated[mt.output]
        small = out.body[0]  # type: ignore[attr-defined]
        new_small = small.with_changes(value=call)
        lines = f"{self.lines_of(original[first])[0]}-{self.lines_of(original[mt.output])[1]}"
        what = f"{func}({x}, ...) replaces the hand-written layer norm (lines {lines})"
        if mt.unsafe:
            what += "; unsafe: " + "; ".join(mt.unsafe)
        self.record_change(original[first], what)
        return out.with_changes(body=[new_small], leading_lines=leading)  # type: ignore[attr-defined]
