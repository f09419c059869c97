"""A small algebra over Python expressions written with torch, math and numpy: enough to tell that two
spellings compute the same function.

An expression becomes a `Poly`: a sum of coefficient x monomial, each monomial a product of atoms raised
to integer powers. Atoms are leaf variables (a name or attribute chain such as `x` or `self.p`, by its
source text) and functions applied to a Poly (tanh, erf, sigmoid, exp, and `recip`, 1/P). Constants
fold (`math.sqrt(2 / math.pi)`, `(2 / np.pi) ** 0.5`, `0.7978845608`), products distribute, integer
powers expand (`x ** 3`, `torch.pow(x, 3.0)`, `x * x * x` are one monomial), and `1 / (1 + exp(-P))`
is sigmoid(P). So

    0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    x * 0.5 * (1 + (0.7978845608 * (x + 0.044715 * x * x * x)).tanh())

give the same Poly: 0.5 x + 0.5 x tanh(0.79788 x + 0.035677 x^3). `Converter.poly(node)` returns None
for anything outside the algebra (a call it does not know, a variable exponent, an in-place op), so a
match is only ever claimed for what was understood completely. Names bound earlier in the block can be
looked through (`resolve`), which is how a chain split over temporaries is read as one expression.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst

from opadvisor.rewrite import _budget
from opadvisor.rewrite._match import bind_args, code, is_method, is_torch_namespace, qualified
from opadvisor.rules.patterns import GELU_ERF, GELU_TANH, SIGMOID_GATE, SILU

Atom = tuple  # ("var", text) | ("fn", name, Poly)
Monomial = tuple[tuple[Atom, int], ...]  # sorted by the atom's repr

MAX_POWER = 8
CONSTANTS = {
    "math.pi": math.pi,
    "numpy.pi": math.pi,
    "torch.pi": math.pi,
    "math.e": math.e,
    "numpy.e": math.e,
    "math.tau": math.tau,
}
CONST_FUNCS: dict[str, Callable[[float], float]] = {
    "math.sqrt": math.sqrt,
    "numpy.sqrt": math.sqrt,
    "math.exp": math.exp,
    "numpy.exp": math.exp,
    "math.log": math.log,
    "numpy.log": math.log,
}
# torch functions of one tensor -> the atom they make
UNARY_FUNCS = {
    "torch.tanh": "tanh",
    "torch.nn.functional.tanh": "tanh",
    "torch.erf": "erf",
    "torch.special.erf": "erf",
    "torch.sigmoid": "sigmoid",
    "torch.nn.functional.sigmoid": "sigmoid",
    "torch.special.expit": "sigmoid",
    "torch.exp": "exp",
}
UNARY_METHODS = {"tanh": "tanh", "erf": "erf", "sigmoid": "sigmoid", "exp": "exp"}


@dataclass(frozen=True)
class Poly:
    terms: tuple[tuple[Monomial, float], ...] = ()

    # ---- construction ------------------------------------------------------------------------------------
    @staticmethod
    def const(c: float) -> Poly:
        return Poly((((), float(c)),)) if c != 0 else Poly()

    @staticmethod
    def atom(a: Atom) -> Poly:
        return Poly(((((a, 1),), 1.0),))

    @staticmethod
    def _make(acc: dict[Monomial, float]) -> Poly:
        return Poly(tuple(sorted(((m, c) for m, c in acc.items() if c != 0.0), key=lambda t: repr(t[0]))))

    # ---- arithmetic ---------------------------------------------------------------------------------------
    def __add__(self, other: Poly) -> Poly:
        acc = dict(self.terms)
        for m, c in other.terms:
            acc[m] = acc.get(m, 0.0) + c
        return Poly._make(acc)

    def __neg__(self) -> Poly:
        return Poly(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        acc: dict[Monomial, float] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = _mono_mul(m1, m2)
                acc[m] = acc.get(m, 0.0) + c1 * c2
        return Poly._make(acc)

    def scaled(self, c: float) -> Poly:
        return Poly._make({m: v * c for m, v in self.terms})

    # ---- queries ------------------------------------------------------------------------------------------
    def constant(self) -> float | None:
        """The value when the Poly is a constant (0 for the empty Poly), else None."""
        if not self.terms:
            return 0.0
        if len(self.terms) == 1 and self.terms[0][0] == ():
            return self.terms[0][1]
        return None

    def variables(self) -> set[str]:
        """Every leaf variable, inside function arguments too."""
        out: set[str] = set()
        for m, _ in self.terms:
            for a, _ in m:
                if a[0] == "var":
                    out.add(a[1])
                else:
                    out |= a[2].variables()
        return out

    def coeffs(self) -> dict[Monomial, float]:
        return dict(self.terms)


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    acc: dict[Atom, int] = {}
    for atom, k in (*a, *b):
        acc[atom] = acc.get(atom, 0) + k
    return tuple(sorted(acc.items(), key=lambda t: repr(t[0])))


def var(text: str) -> Atom:
    return ("var", text)


def fn(name: str, arg: Poly) -> Atom:
    return ("fn", name, arg)


def recip(p: Poly) -> Poly | None:
    """1 / p: a constant's reciprocal, sigmoid(-R) for 1 + exp(R), else the `recip` atom."""
    c = p.constant()
    if c is not None:
        return None if c == 0 else Poly.const(1.0 / c)
    coeffs = p.coeffs()
    if len(coeffs) == 2 and coeffs.get(()) == 1.0:
        ((m, k),) = [(m, k) for m, k in coeffs.items() if m != ()]
        if k == 1.0 and len(m) == 1 and m[0][1] == 1 and m[0][0][0] == "fn" and m[0][0][1] == "exp":
            return Poly.atom(fn("sigmoid", -m[0][0][2]))
    return Poly.atom(fn("recip", p))


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def same_poly(a: Poly, b: Poly, rel: float = 1e-5) -> bool:
    """Equal up to a relative tolerance on every coefficient (monomials compared with the same tolerance
    inside function arguments)."""
    ta, tb = list(a.terms), list(b.terms)
    if len(ta) != len(tb):
        return False
    used = [False] * len(tb)
    for m, c in ta:
        for i, (m2, c2) in enumerate(tb):
            if not used[i] and _same_mono(m, m2, rel) and close(c, c2, rel):
                used[i] = True
                break
        else:
            return False
    return True


def _same_mono(a: Monomial, b: Monomial, rel: float) -> bool:
    if len(a) != len(b):
        return False
    for (x, k), (y, j) in zip(a, b, strict=True):
        if k != j or x[0] != y[0]:
            return False
        if x[0] == "var" and x[1] != y[1]:
            return False
        if x[0] == "fn" and (x[1] != y[1] or not same_poly(x[2], y[2], rel)):
            return False
    return True


# ---- libcst -> Poly --------------------------------------------------------------------------------------------


class Converter:
    """Turn expressions into Polys for one codemod (names resolved through its metadata).

    `resolve(name_node)` may return the expression a name stands for (a temporary bound earlier in the
    block): the name is then read through it; None keeps the name as a variable.
    """

    def __init__(
        self,
        codemod: cst.MetadataDependent,
        resolve: Callable[[cst.Name], cst.BaseExpression | None] | None = None,
    ) -> None:
        self.codemod = codemod
        self.resolve = resolve or (lambda _n: None)
        self.leaves: dict[str, cst.BaseExpression] = {}  # variable text -> a node spelling it
        # id(node) -> its Poly: a temporary read twice (`b = a * a`, `c = b * b`, ...) is converted once,
        # not 2**n times; results cut by the depth limit are not kept (shallower, they may convert)
        self._memo: dict[int, tuple[cst.BaseExpression, Poly | None]] = {}  # holds the node: ids stay its
        self._cuts = 0

    def poly(self, node: cst.BaseExpression, depth: int = 0) -> Poly | None:
        if depth > 60:
            self._cuts += 1
            return None
        key = id(node)
        if key in self._memo:
            return self._memo[key][1]
        _budget.check()  # a chain read through temporaries: bounded by the analysis budget
        cuts = self._cuts
        try:
            result = self._poly(node, depth)
        except (ValueError, OverflowError, ZeroDivisionError):
            result = None
        if self._cuts == cuts:
            self._memo[key] = (node, result)
        return result

    def _poly(self, node: cst.BaseExpression, depth: int) -> Poly | None:
        if isinstance(node, (cst.Integer, cst.Float)):
            return Poly.const(float(node.evaluated_value))
        if isinstance(node, cst.UnaryOperation):
            inner = self.poly(node.expression, depth + 1)
            if inner is None or not isinstance(node.operator, (cst.Minus, cst.Plus)):
                return None
            return -inner if isinstance(node.operator, cst.Minus) else inner
        if isinstance(node, cst.BinaryOperation):
            return self._binary(node, depth)
        if isinstance(node, cst.Call):
            return self._call(node, depth)
        if isinstance(node, (cst.Name, cst.Attribute)):
            return self._leaf(node, depth)
        return None

    def _leaf(self, node: cst.Name | cst.Attribute, depth: int) -> Poly | None:
        names = qualified(self.codemod, node)
        for name in names:
            if name in CONSTANTS:
                return Poly.const(CONSTANTS[name])
        if isinstance(node, (cst.Name, cst.Attribute)) and _plain_leaf(node):
            bound = self.resolve(node)
            inner = None if bound is None else self.poly(bound, depth + 1)
            if inner is not None:  # a temporary the algebra reads; otherwise the name is a variable
                return inner
        if isinstance(node, cst.Attribute) and is_torch_namespace(self.codemod, node):
            return None  # torch.float32 and friends: not a value of the algebra
        if not _plain_leaf(node):
            return None
        text = code(node)
        self.leaves.setdefault(text, node)
        return Poly.atom(var(text))

    def _binary(self, node: cst.BinaryOperation, depth: int) -> Poly | None:
        left = self.poly(node.left, depth + 1)
        if left is None:
            return None
        op = node.operator
        if isinstance(op, cst.Power):
            return self._power(left, node.right, depth)
        right = self.poly(node.right, depth + 1)
        if right is None:
            return None
        if isinstance(op, cst.Add):
            return left + right
        if isinstance(op, cst.Subtract):
            return left - right
        if isinstance(op, cst.Multiply):
            return left * right
        if isinstance(op, cst.Divide):
            inv = recip(right)
            return None if inv is None else left * inv
        return None

    def _power(self, base: Poly, exponent: cst.BaseExpression, depth: int) -> Poly | None:
        e = self.poly(exponent, depth + 1)
        k = None if e is None else e.constant()
        if k is None:
            return None
        c = base.constant()
        if c is not None:
            return Poly.const(c**k)
        if k != int(k) or not 0 <= k <= MAX_POWER:
            return None
        out = Poly.const(1.0)
        for _ in range(int(k)):
            out = out * base
        return out

    def _call(self, node: cst.Call, depth: int) -> Poly | None:
        names = qualified(self.codemod, node.func)
        for name in names:
            if name in CONST_FUNCS and len(node.args) == 1 and not node.args[0].keyword:
                arg = self.poly(node.args[0].value, depth + 1)
                c = None if arg is None else arg.constant()
                return None if c is None else Poly.const(CONST_FUNCS[name](c))
            if name in UNARY_FUNCS:
                args = bind_args(node, ("input",))
                if args is None or len(args) != 1:
                    return None
                inner = self.poly(args["input"].value, depth + 1)
                return None if inner is None else _apply(UNARY_FUNCS[name], inner)
            if name in ("torch.pow", "torch.mul", "torch.add", "torch.sub", "torch.div", "torch.square",
                        "torch.neg", "torch.multiply", "torch.subtract", "torch.divide"):  # fmt: skip
                return self._torch_binary(name.rsplit(".", 1)[-1], node, depth)
        func = node.func
        if is_method(self.codemod, func):
            return self._method(func.attr.value, func.value, node, depth)
        return None

    def _torch_binary(self, what: str, node: cst.Call, depth: int) -> Poly | None:
        if what in ("square", "neg"):
            args = bind_args(node, ("input",))
            if args is None or len(args) != 1:
                return None
            x = self.poly(args["input"].value, depth + 1)
            return None if x is None else (x * x if what == "square" else -x)
        params = ("input", "exponent") if what == "pow" else ("input", "other")
        args = bind_args(node, params, required=2)
        if args is None or len(args) != 2:  # alpha=, rounding_mode=, out=: not modelled
            return None
        return self._apply_binary(what, args[params[0]].value, args[params[1]].value, depth)

    def _method(self, name: str, obj: cst.BaseExpression, node: cst.Call, depth: int) -> Poly | None:
        if name in UNARY_METHODS and not node.args:
            inner = self.poly(obj, depth + 1)
            return None if inner is None else _apply(UNARY_METHODS[name], inner)
        if name in ("square", "neg") and not node.args:
            x = self.poly(obj, depth + 1)
            return None if x is None else (x * x if name == "square" else -x)
        aliases = {"multiply": "mul", "subtract": "sub", "divide": "div"}
        name = aliases.get(name, name)
        if name in ("pow", "mul", "add", "sub", "div"):
            if len(node.args) != 1 or node.args[0].keyword is not None or node.args[0].star:
                return None
            return self._apply_binary(name, obj, node.args[0].value, depth)
        return None

    def _apply_binary(
        self, what: str, a: cst.BaseExpression, b: cst.BaseExpression, depth: int
    ) -> Poly | None:
        left = self.poly(a, depth + 1)
        if left is None:
            return None
        if what == "pow":
            return self._power(left, b, depth)
        right = self.poly(b, depth + 1)
        if right is None:
            return None
        if what == "mul":
            return left * right
        if what == "add":
            return left + right
        if what == "sub":
            return left - right
        inv = recip(right)
        return None if inv is None else left * inv


def _apply(name: str, inner: Poly) -> Poly:
    c = inner.constant()
    if c is not None:
        value = {"tanh": math.tanh, "erf": math.erf, "exp": math.exp}.get(name)
        if value is not None:
            return Poly.const(value(c))
        if name == "sigmoid":
            return Poly.const(1.0 / (1.0 + math.exp(-c)))
    return Poly.atom(fn(name, inner))


def _plain_leaf(node: cst.BaseExpression) -> bool:
    """A name, or an attribute chain ending in a name (`self.p`): reading it has no side effect."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


# ---- activations ---------------------------------------------------------------------------------------------

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
QUICK_GELU = 1.702


def activation_of(p: Poly) -> tuple[str, str] | None:
    """(kind, variable) when `p` is one of the activations fuse_region rewrites, else None.

    kind, a name of `rules.patterns.REGION_CHAINS` (the profile's names for the same chains): "gelu_tanh"
    (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), "gelu_erf" (0.5 x (1 + erf(x / sqrt(2)))), "silu"
    (x sigmoid(x)), "sigmoid_gate" (x sigmoid(c x), only with c = 1.702: QuickGELU, the one it rewrites);
    constants within a relative 1e-5.
    """
    vs = p.variables()
    if len(vs) != 1:
        return None
    (x,) = vs
    xv = var(x)
    c = p.coeffs()
    if len(c) == 1:
        ((mono, k),) = c.items()
        if close(k, 1.0) and len(mono) == 2 and (xv, 1) in mono:
            other = next(a for a, e in mono if a != xv)
            power = dict(mono)[other]
            if power == 1 and other[0] == "fn" and other[1] == "sigmoid":
                scale = _linear_in(other[2], xv)
                if scale is not None and close(scale, 1.0):
                    return SILU, x
                if scale is not None and close(scale, QUICK_GELU):
                    return SIGMOID_GATE, x
        return None
    if len(c) != 2 or not close(c.get(((xv, 1),), 0.0), 0.5):
        return None
    ((mono, k),) = [(m, v) for m, v in c.items() if m != ((xv, 1),)]
    if not close(k, 0.5) or len(mono) != 2 or (xv, 1) not in mono:
        return None
    other = next(a for a, e in mono if a != xv)
    if dict(mono)[other] != 1 or other[0] != "fn":
        return None
    if other[1] == "tanh":
        want = Poly.atom(xv).scaled(SQRT_2_OVER_PI) + (Poly.atom(xv) * Poly.atom(xv) * Poly.atom(xv)).scaled(
            SQRT_2_OVER_PI * GELU_CUBIC
        )
        return (GELU_TANH, x) if same_poly(other[2], want) else None
    if other[1] == "erf":
        scale = _linear_in(other[2], xv)
        return (GELU_ERF, x) if scale is not None and close(scale, 1.0 / math.sqrt(2.0)) else None
    return None


def _linear_in(p: Poly, xv: Atom) -> float | None:
    """k when p is exactly k * x."""
    c = p.coeffs()
    if len(c) != 1:
        return None
    ((mono, k),) = c.items()
    return k if mono == ((xv, 1),) else None
