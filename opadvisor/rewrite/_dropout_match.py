"""Dropout written by hand, read from source: `x * keep_mask / (1 - p)` in its usual spellings.

    m = DropoutMatcher(codemod, resolve).match(expr)
    m.x, m.p          # the input (a name or attribute) and an expression for the drop probability

What is recognised, as one product of factors (`*` and `/`, through temporaries `resolve` looks into):

- the data: the input `x` (a name or attribute), `x.masked_fill(drop, 0)` / `torch.masked_fill(x, drop,
  0)`, or `torch.where(keep, x, 0)` (also with `torch.zeros_like(x)`);
- at most one keep mask as a separate factor (with masked_fill / where the mask is theirs): drawn with
  `torch.rand_like(x) > p` (`>=`; `< keep` keeps with probability `keep`), `torch.rand(x.shape, ...)` /
  `torch.rand(x.size(), ...)`, `torch.bernoulli(torch.full_like(x, keep))` (or `ones_like(x) * keep`),
  `torch.empty_like(x).bernoulli_(keep)` (`zeros_like`, `x.new_empty(x.shape)`, `x.new(x.size())`),
  `torch.bernoulli(x, keep)`; negated with `1 - m`, `~m`, `m.logical_not()`, `m == 0`; cast freely
  (`.float()`, `.bool()`, `.to(...)`, `.type_as(...)`);
- the scale: the remaining factors, whose product must be 1 / keep (`/ (1 - p)`, `* (1.0 / (1 - p))`, a
  temporary or `ctx.scale` holding it, or the constant for a constant p).

The mask must be drawn for the input's own shape (`rand_like(x)` of the same `x`), and keep = 1 - p must
match the scale exactly; anything else is not a match. The drop probability comes back as source: the
`p` of `1 - p`, `1 - keep` for a keep probability, or the number for a constant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

from opadvisor.rewrite import _budget
from opadvisor.rewrite._algebra import CONSTANTS, Converter, Poly, close, recip, same_poly
from opadvisor.rewrite._match import bind_args, code, is_method, is_zero, qualified

CAST_METHODS = frozenset(
    {"float", "half", "bfloat16", "double", "bool", "byte", "to", "type_as", "type", "long", "int"}
)
LIKE_FACTORIES = frozenset({"torch.empty_like", "torch.zeros_like", "torch.ones_like"})
RAND_FUNCS = frozenset({"torch.rand_like", "torch.rand"})


@dataclass
class DropoutMatch:
    x: cst.BaseExpression  # the input (a node of the user's expression)
    p: cst.BaseExpression  # the drop probability (user nodes, or built)
    p_text: str


@dataclass
class _Mask:
    keep: bool  # True: 1 where the element is kept
    keep_prob: Poly  # probability of keeping an element
    ref: str  # source text of the tensor whose shape it was drawn for
    prob_node: cst.BaseExpression  # the probability argument as written


class DropoutMatcher:
    def __init__(
        self,
        codemod: cst.MetadataDependent,
        resolve: Callable[[cst.BaseExpression], cst.BaseExpression | None] | None = None,
    ) -> None:
        self.codemod = codemod
        self.resolve = resolve or (lambda _n: None)
        self.conv = Converter(codemod, resolve)  # type: ignore[arg-type]

    # ---- looking through temporaries and casts ---------------------------------------------------------
    def deref(self, node: cst.BaseExpression) -> cst.BaseExpression:
        """What a name stands for, through temporaries (each node followed once: a cycle ends there)."""
        seen: set[int] = set()
        while isinstance(node, (cst.Name, cst.Attribute)) and id(node) not in seen:
            _budget.check()
            seen.add(id(node))
            bound = self.resolve(node)
            if bound is None:
                return node
            node = bound
        return node

    def _strip_casts(self, node: cst.BaseExpression) -> cst.BaseExpression:
        node = self.deref(node)
        seen: set[int] = set()
        while (
            isinstance(node, cst.Call)
            and id(node) not in seen
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in CAST_METHODS
            and is_method(self.codemod, node.func)
        ):
            seen.add(id(node))
            node = self.deref(node.func.value)
        return node

    # ---- the product ------------------------------------------------------------------------------------
    def factors(
        self, node: cst.BaseExpression, inverted: bool = False
    ) -> list[tuple[cst.BaseExpression, bool]]:
        """The factors of a product (`*` and `/`, `/` inverting), temporaries not looked into."""
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Multiply, cst.Divide)):
            right_inv = inverted != isinstance(node.operator, cst.Divide)
            return self.factors(node.left, inverted) + self.factors(node.right, right_inv)
        return [(node, inverted)]

    def match(self, expr: cst.BaseExpression, same_shape: str | None = None) -> DropoutMatch | None:
        """The dropout `expr` computes, or None. `same_shape`: the text of a tensor known to have the data's
        shape, whose mask counts as drawn for it (a backward's gradient and its forward's input)."""
        data: cst.BaseExpression | None = None
        mask: _Mask | None = None
        scale = Poly.const(1.0)
        pending = self.factors(expr)
        while pending:
            node, inverted = pending.pop(0)
            found = self.mask(node)
            if found is not None:
                if inverted or not found.keep or mask is not None:
                    return None
                mask = found
                continue
            factor = self._scale(node)
            if factor is None and not inverted:
                kind = self._data(node)
                if kind is None or data is not None:
                    return None
                data, inner, attached = kind
                if attached is not None:
                    if mask is not None:
                        return None
                    mask = attached
                pending.extend(inner)
                continue
            if factor is None and isinstance(node, (cst.Name, cst.Attribute)):
                factor = self.conv.poly(node)  # `/ keep`: a divisor is never the data
            if factor is None:
                return None
            if inverted:
                factor = recip(factor)
                if factor is None:
                    return None
            scale = scale * factor
        if data is None or mask is None or mask.ref not in (code(data), same_shape):
            return None
        if not _is_reciprocal(scale, mask.keep_prob):
            return None
        return self._result(data, mask)

    def _scale(self, node: cst.BaseExpression) -> Poly | None:
        """A factor of the scale: a number, or an expression / temporary the algebra reads that is not a
        bare variable (a bare name is the data, or unknown)."""
        if isinstance(node, (cst.Name, cst.Attribute)):
            bound = self.resolve(node)
            return None if bound is None else self.conv.poly(bound)
        if isinstance(node, cst.Call) and self._data(node) is not None:
            return None
        return self.conv.poly(node)

    def _data(self, node: cst.BaseExpression):
        """(x, factors inside the data term, attached mask) when `node` is the data term, else None."""
        if isinstance(node, (cst.Name, cst.Attribute)):
            constant = any(q in CONSTANTS for q in qualified(self.codemod, node))
            return None if constant or not _leaf(node) else (node, [], None)
        if not isinstance(node, cst.Call):
            return None
        names = qualified(self.codemod, node.func)
        if (
            isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "masked_fill"
            and is_method(self.codemod, node.func)
        ):
            args = bind_args(node, ("mask", "value"), required=2)
            if args is None or not is_zero(args["value"].value):
                return None
            return self._data_with(node.func.value, args["mask"].value, negate=True)
        if "torch.masked_fill" in names:
            args = bind_args(node, ("input", "mask", "value"), required=3)
            if args is None or not is_zero(args["value"].value):
                return None
            return self._data_with(args["input"].value, args["mask"].value, negate=True)
        if "torch.where" in names:
            args = bind_args(node, ("condition", "input", "other"), required=3)
            if args is None or not self._zero_like(args["other"].value):
                return None
            return self._data_with(args["input"].value, args["condition"].value, negate=False)
        return None

    def _data_with(self, value: cst.BaseExpression, mask_node: cst.BaseExpression, negate: bool):
        mask = self.mask(mask_node)
        if mask is None or mask.keep == negate:  # masked_fill wants a drop mask, where a keep mask
            return None
        inner = self.factors(value)
        xs = [
            f
            for f in inner
            if not f[1] and isinstance(f[0], (cst.Name, cst.Attribute)) and self._scale(f[0]) is None
        ]
        if len(xs) != 1 or self._data(xs[0][0]) is None:
            return None
        x = xs[0][0]
        rest = [f for f in inner if f is not xs[0]]
        return x, rest, _Mask(True, mask.keep_prob, mask.ref, mask.prob_node)

    def _zero_like(self, node: cst.BaseExpression) -> bool:
        if is_zero(node):
            return True
        node = self.deref(node)
        return isinstance(node, cst.Call) and "torch.zeros_like" in qualified(self.codemod, node.func)

    # ---- masks --------------------------------------------------------------------------------------------
    def mask(self, node: cst.BaseExpression) -> _Mask | None:
        node = self._strip_casts(node)
        flipped = self._negation(node)
        if flipped is not None:
            inner = self.mask(flipped)
            return (
                None if inner is None else _Mask(not inner.keep, inner.keep_prob, inner.ref, inner.prob_node)
            )
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            return self._threshold(node)
        return self._bernoulli(node)

    def _negation(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.BitInvert):
            return node.expression
        if (
            isinstance(node, cst.BinaryOperation)
            and isinstance(node.operator, cst.Subtract)
            and (c := self.conv.poly(node.left)) is not None
            and c.constant() == 1.0
        ):
            return node.right
        if isinstance(node, cst.Call):
            names = qualified(self.codemod, node.func)
            if "torch.logical_not" in names and len(node.args) == 1:
                return node.args[0].value
            if isinstance(node.func, cst.Attribute) and is_method(self.codemod, node.func):
                if node.func.attr.value == "logical_not" and not node.args:
                    return node.func.value
                if node.func.attr.value == "eq" and len(node.args) == 1 and is_zero(node.args[0].value):
                    return node.func.value
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            target = node.comparisons[0]
            if isinstance(target.operator, cst.Equal) and is_zero(target.comparator):
                return node.left
        return None

    def _threshold(self, node: cst.Comparison) -> _Mask | None:
        target = node.comparisons[0]
        op = target.operator
        left, right = node.left, target.comparator
        ref = self._uniform(left)
        if ref is not None:
            above = isinstance(op, (cst.GreaterThan, cst.GreaterThanEqual))
            below = isinstance(op, (cst.LessThan, cst.LessThanEqual))
            bound = right
        else:
            ref = self._uniform(right)
            if ref is None:
                return None
            above = isinstance(op, (cst.LessThan, cst.LessThanEqual))  # p < rand: rand above p
            below = isinstance(op, (cst.GreaterThan, cst.GreaterThanEqual))
            bound = left
        t = self.conv.poly(bound)
        if t is None or not (above or below):
            return None
        # rand > t keeps with probability 1 - t; rand < t with probability t
        keep_prob = Poly.const(1.0) - t if above else t
        return _Mask(True, keep_prob, ref, bound)

    def _uniform(self, node: cst.BaseExpression) -> str | None:
        """The text of x when `node` draws uniform [0, 1) numbers of x's shape, else None."""
        node = self._strip_casts(node)
        if not isinstance(node, cst.Call):
            return None
        names = qualified(self.codemod, node.func)
        if "torch.rand_like" in names and node.args and node.args[0].keyword is None:
            return code(self.deref(node.args[0].value)) if _leaf(self.deref(node.args[0].value)) else None
        if "torch.rand" in names and node.args and node.args[0].keyword is None:
            return self._shape_of(node.args[0])
        if isinstance(node.func, cst.Attribute) and node.func.attr.value == "uniform_" and not node.args:
            return self._like(node.func.value)
        return None

    def _bernoulli(self, node: cst.BaseExpression) -> _Mask | None:
        if not isinstance(node, cst.Call):
            return None
        names = qualified(self.codemod, node.func)
        if "torch.bernoulli" in names:
            args = bind_args(node, ("input", "p"))
            if args is None:
                return None
            if "p" in args:  # torch.bernoulli(x, keep): x's shape, probability keep
                ref = self.deref(args["input"].value)
                prob = self.conv.poly(args["p"].value)
                if not _leaf(ref) or prob is None:
                    return None
                return _Mask(True, prob, code(ref), args["p"].value)
            return self._filled(args["input"].value)
        if (
            isinstance(node.func, cst.Attribute)
            and node.func.attr.value == "bernoulli_"
            and is_method(self.codemod, node.func)
        ):
            args = bind_args(node, ("p",))
            ref = self._like(node.func.value)
            prob = None if args is None else self.conv.poly(args["p"].value)
            if ref is None or prob is None:
                return None
            return _Mask(True, prob, ref, args["p"].value)  # type: ignore[index]
        return None

    def _filled(self, node: cst.BaseExpression) -> _Mask | None:
        """torch.full_like(x, keep), torch.ones_like(x) * keep, keep * torch.ones_like(x)."""
        node = self.deref(node)
        if isinstance(node, cst.Call) and "torch.full_like" in qualified(self.codemod, node.func):
            args = bind_args(node, ("input", "fill_value"), required=2)
            ref = None if args is None else self.deref(args["input"].value)
            prob = None if args is None else self.conv.poly(args["fill_value"].value)
            if ref is None or not _leaf(ref) or prob is None:
                return None
            return _Mask(True, prob, code(ref), args["fill_value"].value)  # type: ignore[index]
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
            for ones, value in ((node.left, node.right), (node.right, node.left)):
                ref = self._like(ones, only=("torch.ones_like",))
                prob = self.conv.poly(value)
                if ref is not None and prob is not None:
                    return _Mask(True, prob, ref, value)
        return None

    def _like(self, node: cst.BaseExpression, only: tuple[str, ...] = tuple(LIKE_FACTORIES)) -> str | None:
        """The text of x for a fresh tensor of x's shape: torch.empty_like(x) (zeros_like, ones_like),
        x.new_empty(x.shape) / x.new(x.size()), torch.empty(x.shape, ...)."""
        node = self.deref(node)
        if not isinstance(node, cst.Call):
            return None
        names = qualified(self.codemod, node.func)
        if names & set(only) and node.args and node.args[0].keyword is None:
            ref = self.deref(node.args[0].value)
            return code(ref) if _leaf(ref) else None
        if only != tuple(LIKE_FACTORIES):
            return None
        if "torch.empty" in names and node.args:
            return self._shape_of(node.args[0])
        if (
            isinstance(node.func, cst.Attribute)
            and node.func.attr.value in ("new_empty", "new")
            and node.args
        ):
            return self._shape_of(node.args[0])
        return None

    def _shape_of(self, arg: cst.Arg) -> str | None:
        """x for `x.shape`, `x.size()`, `*x.shape` (as a shape argument)."""
        value = self.deref(arg.value)
        if isinstance(value, cst.Attribute) and value.attr.value == "shape" and _leaf(value.value):
            return code(value.value)
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Attribute)
            and value.func.attr.value == "size"
            and not value.args
            and _leaf(value.func.value)
        ):
            return code(value.func.value)
        return None

    # ---- the probability, as source --------------------------------------------------------------------
    def _result(self, data: cst.BaseExpression, mask: _Mask) -> DropoutMatch | None:
        keep = mask.keep_prob
        c = keep.constant()
        if c is not None:
            value = round(1.0 - c, 12)
            node: cst.BaseExpression = (
                cst.Float(repr(value)) if value != int(value) else cst.Integer(str(int(value)))
            )
            return DropoutMatch(data, node, code(node))
        drop = Poly.const(1.0) - keep
        if len(drop.terms) == 1 and drop.terms[0][1] == 1.0 and len(drop.terms[0][0]) == 1:
            ((atom, power),) = drop.terms[0][0]
            if atom[0] == "var" and power == 1 and atom[1] in self.conv.leaves:
                node = self.conv.leaves[atom[1]]
                return DropoutMatch(data, node, code(node))
        if len(keep.terms) == 1 and keep.terms[0][1] == 1.0 and len(keep.terms[0][0]) == 1:
            ((atom, power),) = keep.terms[0][0]
            if atom[0] == "var" and power == 1 and atom[1] in self.conv.leaves:
                node = cst.parse_expression(f"1 - {atom[1]}")
                return DropoutMatch(data, node, code(node))
        return None


def _is_reciprocal(scale: Poly, keep: Poly) -> bool:
    c = keep.constant()
    if c is not None:
        s = scale.constant()
        return s is not None and c != 0 and close(s * c, 1.0)
    coeffs = scale.coeffs()
    if len(coeffs) != 1:
        return False
    ((mono, k),) = coeffs.items()
    if not close(k, 1.0) or len(mono) != 1 or mono[0][1] != 1:
        return False
    atom = mono[0][0]
    return atom[0] == "fn" and atom[1] == "recip" and same_poly(atom[2], keep)


def _leaf(node: cst.BaseExpression) -> bool:
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)
