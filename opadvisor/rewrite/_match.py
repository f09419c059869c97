"""Matching helpers shared by the codemods: qualified names, call arguments, scalar-looking expressions,
and what `self.<attr>` is (read from the class's `__init__`).

Names are resolved with libcst's `QualifiedNameProvider` (so `F.softmax`, `G.softmax` after
`from torch.nn import functional as G`, and `sm` after `from torch.nn.functional import softmax as sm` all
resolve to `torch.nn.functional.softmax`); a match checks `any()` of the candidates. Tensor methods
(`x.softmax(-1)`, `x.masked_fill(...)`) cannot be resolved by name and are matched by their shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ParentNodeProvider, QualifiedNameProvider

from opadvisor.rewrite._walk import Visitor

SOFTMAX_FUNCS = frozenset({"torch.nn.functional.softmax", "torch.softmax", "torch.special.softmax"})
SOFTMAX_MODULES = frozenset({"torch.nn.Softmax", "torch.nn.modules.activation.Softmax"})
DROPOUT_FUNCS = frozenset({"torch.nn.functional.dropout"})
TORCH_DROPOUT = frozenset({"torch.dropout"})  # torch.dropout(input, p, train): all positional
DROPOUT_MODULES = frozenset({"torch.nn.Dropout", "torch.nn.modules.dropout.Dropout"})
MASKED_FILL_FUNCS = frozenset({"torch.masked_fill"})
MATMUL_FUNCS = frozenset({"torch.matmul", "torch.bmm"})
TRANSPOSE_FUNCS = frozenset({"torch.transpose"})
LINEAR_CLASSES = frozenset({"torch.nn.Linear", "torch.nn.modules.linear.Linear"})
EMBEDDING_CLASSES = frozenset({"torch.nn.Embedding", "torch.nn.modules.sparse.Embedding"})
TRIL_FUNCS = frozenset({"torch.tril"})
TRIU_FUNCS = frozenset({"torch.triu"})
ONES_FUNCS = frozenset({"torch.ones"})
AUTOCASTS = frozenset(
    {"torch.autocast", "torch.cuda.amp.autocast", "torch.amp.autocast", "torch.cpu.amp.autocast"}
)

_EMPTY = cst.Module([])


def code(node: cst.CSTNode) -> str:
    """Source text of a node (as it would print inside a module with default settings)."""
    return _EMPTY.code_for_node(node)


def qualified(visitor: cst.MetadataDependent, node: cst.CSTNode) -> set[str]:
    try:
        return {q.name for q in visitor.get_metadata(QualifiedNameProvider, node, set())}
    except KeyError:  # a node built by the codemod (no metadata)
        return set()


def resolves_to(visitor: cst.MetadataDependent, node: cst.CSTNode, names: Iterable[str]) -> bool:
    """True when any of the node's qualified-name candidates is one of `names`."""
    wanted = set(names)
    return any(name in wanted for name in qualified(visitor, node))


def is_torch_namespace(visitor: cst.MetadataDependent, node: cst.CSTNode) -> bool:
    """True when `node` names torch or one of its modules (so `node.softmax` is a function, not a method)."""
    return any(name == "torch" or name.startswith("torch.") for name in qualified(visitor, node))


def is_method(visitor: cst.MetadataDependent, func: cst.BaseExpression) -> bool:
    """Whether a call's `func` is a method of a value (`x.tanh`, `f(x).pow`, `(a * b).sigmoid`), not a
    function of a torch module (`torch.tanh`, `F.gelu`)."""
    if not isinstance(func, cst.Attribute):
        return False
    value = func.value
    return not isinstance(value, (cst.Name, cst.Attribute)) or not is_torch_namespace(visitor, value)


def parent(visitor: cst.MetadataDependent, node: cst.CSTNode) -> cst.CSTNode | None:
    try:
        return visitor.get_metadata(ParentNodeProvider, node, None)
    except KeyError:
        return None


def unparen(node: cst.BaseExpression) -> cst.BaseExpression:
    """The same expression without its own outer parentheses (an empty tuple keeps them: they are it)."""
    if isinstance(node, cst.Tuple) and not node.elements and len(node.lpar) == 1:
        return node
    if getattr(node, "lpar", None):
        return node.with_changes(lpar=[], rpar=[])
    return node


def bind_args(call: cst.Call, params: Sequence[str], *, required: int = 1) -> dict[str, cst.Arg] | None:
    """Map a call's arguments to parameter names; None when it uses */** or arguments we do not know."""
    bound: dict[str, cst.Arg] = {}
    positional = True
    for i, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is None:
            if not positional or i >= len(params):
                return None
            bound[params[i]] = arg
        else:
            positional = False
            name = arg.keyword.value
            if name not in params or name in bound:
                return None
            bound[name] = arg
    if any(p not in bound for p in params[:required]):
        return None
    return bound


def int_value(node: cst.BaseExpression | None) -> int | None:
    """The value of an integer literal (with an optional minus sign), else None."""
    if node is None:
        return None
    node = unparen(node)
    if isinstance(node, cst.Integer):
        return int(node.evaluated_value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        inner = int_value(node.expression)
        return None if inner is None else -inner
    return None


def number_value(node: cst.BaseExpression | None) -> float | None:
    """The value of an int/float literal, `float("-inf")`-style spellings, or `-x` of those; else None."""
    if node is None:
        return None
    node = unparen(node)
    if isinstance(node, cst.Integer | cst.Float):
        return float(node.evaluated_value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus | cst.Plus):
        inner = number_value(node.expression)
        if inner is None:
            return None
        return -inner if isinstance(node.operator, cst.Minus) else inner
    if m.matches(node, m.Call(func=m.Name("float"), args=[m.Arg(m.SimpleString())])):
        text = node.args[0].value.evaluated_value.strip().lower()  # type: ignore[union-attr]
        try:
            return float(text)
        except ValueError:
            return None
    if m.matches(
        node, m.Attribute(value=m.Name("math") | m.Name("torch") | m.Name("np"), attr=m.Name("inf"))
    ):
        return float("inf")
    return None


def is_neg_inf(node: cst.BaseExpression) -> bool:
    value = number_value(node)
    return value is not None and value == float("-inf")


def is_finfo_min(node: cst.BaseExpression) -> bool:
    """`torch.finfo(<anything>).min` (also with a minus on .max)."""
    node = unparen(node)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        return m.matches(
            unparen(node.expression),
            m.Attribute(value=m.Call(func=m.Attribute(attr=m.Name("finfo"))), attr=m.Name("max")),
        )
    return m.matches(
        node, m.Attribute(value=m.Call(func=m.Attribute(attr=m.Name("finfo"))), attr=m.Name("min"))
    )


def is_zero(node: cst.BaseExpression) -> bool:
    return number_value(node) == 0.0


_SCALAR_ATTRS = {"shape", "ndim"}
_NON_SCALAR_ATTRS = {"T", "mT", "H", "mH", "weight", "data"}


def is_scalarish(node: cst.BaseExpression, tensor_names: frozenset[str] = frozenset()) -> bool:
    """An expression that reads as a Python number: literals, names, attributes, `math.*(...)`,
    `x.size(-1)`, `x.shape[-1]`, `d ** -0.5` and arithmetic of those. Names in `tensor_names` are not."""
    node = unparen(node)
    if isinstance(node, cst.Integer | cst.Float):
        return True
    if isinstance(node, cst.Name):
        return node.value not in tensor_names and node.value not in {"None", "True", "False"}
    if isinstance(node, cst.Attribute):
        if node.attr.value in _NON_SCALAR_ATTRS:
            return False
        base = node.value
        while isinstance(base, cst.Attribute):
            base = base.value
        return not (isinstance(base, cst.Name) and base.value in tensor_names)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus | cst.Plus):
        return is_scalarish(node.expression, tensor_names)
    if isinstance(node, cst.BinaryOperation) and isinstance(
        node.operator, cst.Add | cst.Subtract | cst.Multiply | cst.Divide | cst.FloorDivide | cst.Power
    ):
        return is_scalarish(node.left, tensor_names) and is_scalarish(node.right, tensor_names)
    if isinstance(node, cst.Subscript):  # x.shape[-1], x.size()[-1]
        return m.matches(
            node.value, m.Attribute(attr=m.Name("shape")) | m.Call(func=m.Attribute(attr=m.Name("size")))
        )
    if isinstance(node, cst.Call):
        func = node.func
        if m.matches(func, m.Name("float") | m.Name("int")):
            return True
        if m.matches(func, m.Attribute(value=m.Name("math"))):
            return True
        if m.matches(func, m.Attribute(attr=m.Name("size") | m.Name("dim") | m.Name("item"))):
            return True
    return False


def contains(root: cst.CSTNode, target: cst.CSTNode) -> bool:
    """Whether `target` (by identity) is `root` or inside it."""
    found = False

    class _Find(Visitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            nonlocal found
            if node is target:
                found = True
            return not found

    root.visit(_Find())
    return found


def names_in(root: cst.CSTNode) -> list[cst.Name]:
    """Every Name node under root (in source order)."""
    out: list[cst.Name] = []

    class _Names(Visitor):
        def visit_Name(self, node: cst.Name) -> None:
            out.append(node)

    root.visit(_Names())
    return out


def nodes_of(root: cst.CSTNode, kind: type | tuple[type, ...]) -> list:
    """Every node under `root` (itself included) that is a `kind`, in the order libcst visits them."""
    out: list = []

    class _Collect(Visitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, kind):
                out.append(node)
            return True

    root.visit(_Collect())
    return out


def self_attr(node: cst.BaseExpression) -> str | None:
    """`X` for the expression `self.X`, else None."""
    if m.matches(node, m.Attribute(value=m.Name("self"), attr=m.Name())):
        return node.attr.value  # type: ignore[union-attr]
    return None


@dataclass
class ClassInfo:
    """What a class's `__init__` assigns to `self.<attr>` (calls and buffers), read from the source."""

    values: dict[str, cst.BaseExpression | None] = field(
        default_factory=dict
    )  # None: assigned more than once

    def value(self, attr: str) -> cst.BaseExpression | None:
        return self.values.get(attr)


def class_info(classdef: cst.ClassDef) -> ClassInfo:
    info = ClassInfo()
    init = next(
        (s for s in classdef.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"),
        None,
    )
    if init is None:
        return info

    def record(attr: str, value: cst.BaseExpression) -> None:
        if attr in info.values and not (
            info.values[attr] is not None and info.values[attr].deep_equals(value)
        ):
            info.values[attr] = None
        else:
            info.values[attr] = value

    class _Init(Visitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is init

        def visit_Assign(self, node: cst.Assign) -> None:
            for target in node.targets:
                attr = self_attr(target.target)
                if attr is not None:
                    record(attr, node.value)

        def visit_Call(self, node: cst.Call) -> None:
            # self.register_buffer("name", value, ...)
            if m.matches(node.func, m.Attribute(value=m.Name("self"), attr=m.Name("register_buffer"))):
                args = bind_args(node, ("name", "tensor", "persistent"), required=2)
                if args and isinstance(args["name"].value, cst.SimpleString):
                    record(str(args["name"].value.evaluated_value), args["tensor"].value)

    init.visit(_Init())
    return info


def enclosing_class(visitor: cst.MetadataDependent, node: cst.CSTNode) -> cst.ClassDef | None:
    current = parent(visitor, node)
    while current is not None:
        if isinstance(current, cst.ClassDef):
            return current
        current = parent(visitor, current)
    return None


def inside(
    visitor: cst.MetadataDependent, node: cst.CSTNode, kinds: tuple[type, ...], stop: cst.CSTNode
) -> bool:
    """Whether an ancestor of node, below `stop`, is one of `kinds`."""
    current = parent(visitor, node)
    while current is not None and current is not stop:
        if isinstance(current, kinds):
            return True
        current = parent(visitor, current)
    return False


# ---- is this expression a tensor? (what the source shows, for static mode and unknown facts) ------------
TENSOR_FACTORIES = frozenset(
    {
        "torch.nn.Parameter",
        "torch.nn.parameter.Parameter",
        "torch.tensor",
        "torch.as_tensor",
        "torch.ones",
        "torch.zeros",
        "torch.full",
        "torch.empty",
        "torch.rand",
        "torch.randn",
        "torch.arange",
        "torch.log",
        "torch.exp",
        "torch.clamp",
        "torch.sqrt",
        "torch.rsqrt",
        "torch.sigmoid",
        "torch.tanh",
        "torch.softplus",
    }
)
_NUMBER_METHODS = {"size", "dim", "item", "numel", "__float__", "__int__"}


def tensor_valued(
    visitor: cst.MetadataDependent,
    node: cst.BaseExpression,
    class_value: Callable[[cst.BaseExpression], cst.BaseExpression | None],
    depth: int = 0,
) -> bool:
    """True when the source shows `node` is a tensor: a torch call or tensor method (`.exp()`), an
    nn.Parameter / torch.tensor / buffer assigned to `self.X` in `__init__`, a local name bound to one of
    those. False means "not shown to be": a function parameter or an attribute of unknown origin."""
    node = unparen(node)
    if depth > 4:
        return False
    if isinstance(node, cst.Call):
        if m.matches(node.func, m.Name("float") | m.Name("int") | m.Attribute(value=m.Name("math"))):
            return False
        if any(n.startswith("torch.") for n in qualified(visitor, node.func)):
            return True
        if isinstance(node.func, cst.Attribute):
            if node.func.attr.value in _NUMBER_METHODS:
                return False
            return not m.matches(node.func.value, m.Name("self"))  # `t.exp()`; `self.fn(...)` is unknown
        return False
    if isinstance(node, cst.BinaryOperation):
        return any(tensor_valued(visitor, side, class_value, depth + 1) for side in (node.left, node.right))
    if isinstance(node, cst.UnaryOperation):
        return tensor_valued(visitor, node.expression, class_value, depth + 1)
    if isinstance(node, cst.Attribute):
        value = class_value(node) if self_attr(node) is not None else None
        return value is not None and tensor_valued(visitor, value, class_value, depth + 1)
    if isinstance(node, cst.Name):
        return any(tensor_valued(visitor, v, class_value, depth + 1) for v in local_values(visitor, node))
    return False


def local_values(visitor: cst.MetadataDependent, name: cst.Name) -> list[cst.BaseExpression]:
    """The values `name` is assigned (`name = value`) in its scope, as far as the source shows."""
    from libcst.metadata import ScopeProvider

    try:
        scope = visitor.get_metadata(ScopeProvider, name, None)
    except KeyError:
        return []
    if scope is None:
        return []
    values = []
    for assignment in scope.assignments[name.value]:
        target = getattr(assignment, "node", None)
        assign = parent(visitor, parent(visitor, target)) if target is not None else None
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and assign.targets[0].target is target:
            values.append(assign.value)
    return values


def jit_scripted(visitor: cst.MetadataDependent, node: cst.CSTNode) -> bool:
    """Whether `node` lies in a function (or class) that TorchScript compiles: `@torch.jit.script`,
    `@torch.jit.script_method`, or `@torch.jit.interface`."""
    scripted = {
        "torch.jit.script",
        "torch.jit.script_method",
        "torch.jit.interface",
        "torch.jit._script.script",
    }
    current = parent(visitor, node)
    while current is not None:
        if isinstance(current, cst.FunctionDef | cst.ClassDef):
            for decorator in current.decorators:
                target = decorator.decorator
                target = target.func if isinstance(target, cst.Call) else target
                if resolves_to(visitor, target, scripted):
                    return True
        current = parent(visitor, current)
    return False
