"""Finding softmax chains in a block of statements, for `fused_softmax` and `sdpa_attention`.

A chain is one value flowing through a few tensor ops around a softmax, within one statement or across
consecutive statements of a block, each rebinding a name the next one reads:

    scores = q @ k.transpose(-1, -2) / math.sqrt(d)          # qk, scale
    scores = scores.masked_fill(~mask, torch.finfo(...).min)  # mask (fill)      } "pre" steps
    probs = F.softmax(scores, dim=-1)                         # softmax
    probs = probs.masked_fill(~mask, 0.0)                     # zero             } "post" steps
    probs = self.dropout(probs)                               # dropout
    ctx = probs @ v                                           # pv

Each statement is a `Segment`: the steps it applies (in application order), the expression flowing into
it (`entry`: the Name that links it to the previous segment, or the chain's base), and the outermost op
node (`top`). The codemod picks the longest run of segments it can rewrite (`candidates`), and
`temps_problem` checks that the intermediate values it folds away are read nowhere else.

Grammar: the attention pattern declared in `rules/patterns.py` (the profile matcher reads the same
declaration): pre steps apply in its order, scale -> mask (for SDPA: qk -> scale -> mask), each at most
once; post steps in its order up to its swaps (zero and dropout either way), each at most once, then pv
for SDPA, which ends the chain. The source matcher adds its own step, `cast` (the probabilities cast back
after a float32 softmax, which the profile sees as a pass-through op), allowed anywhere after the softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import GlobalScope, PositionProvider, ScopeProvider

from opadvisor.rewrite import _edit as ed
from opadvisor.rewrite import _match as mt
from opadvisor.rewrite._bindings import block_index
from opadvisor.rewrite._blocks import BlockEdit, BlockRewriter
from opadvisor.rewrite.base import Target, target_facts
from opadvisor.rules.attention import AttentionFacts
from opadvisor.rules.patterns import (
    ATTENTION,
    DROPOUT,
    FUSED_SOFTMAX,
    MASK,
    PV,
    QK,
    SCALE,
    SOFTMAX,
    ZERO,
    Pattern,
)

CAST = "cast"  # the source matcher's own step (see the module's docstring)


@dataclass
class Step:
    kind: str  # qk | scale | mask | softmax | zero | dropout | pv
    node: cst.BaseExpression  # the expression applying the op
    input: cst.BaseExpression | None  # the flowing value it reads (None for qk)
    params: dict[str, cst.BaseExpression | None] = field(default_factory=dict)
    divide: bool = False  # scale given as a divisor
    problem: str | None = None  # recognised, but cannot be rewritten (the reason)


@dataclass
class Segment:
    index: int  # statement index in the block
    steps: list[Step]  # application order
    entry: cst.BaseExpression  # what flows in: a Name link to the previous segment, or the base
    top: cst.BaseExpression  # outermost op of this segment
    target: str | None  # the name this statement binds (pre/post segments always bind one)
    aug: bool = False  # the statement is `name op= value`


@dataclass
class Chain:
    segments: list[Segment]
    softmax_seg: int  # position in segments of the segment holding the softmax

    @property
    def first(self) -> int:
        return self.segments[0].index

    @property
    def last(self) -> int:
        return self.segments[-1].index

    @property
    def steps(self) -> list[Step]:
        return [s for seg in self.segments for s in seg.steps]

    def kinds(self) -> list[str]:
        return [s.kind for s in self.steps]

    def step(self, kind: str) -> Step | None:
        return next((s for s in self.steps if s.kind == kind), None)

    @property
    def base(self) -> cst.BaseExpression:
        return self.segments[0].entry

    @property
    def top(self) -> cst.BaseExpression:
        return self.segments[-1].top

    def sub(self, a: int, z: int) -> Chain:
        """Segments a..z (positions in self.segments)."""
        return Chain(self.segments[a : z + 1], self.softmax_seg - a)


def _accesses(scope: Any, name: str) -> list[Any]:
    """Every access of `name` in `scope`: its reads and the references of its assignments, once each."""
    accesses: dict[int, Any] = {}
    for assignment in scope.assignments[name]:
        for ref in getattr(assignment, "references", ()):
            accesses[id(ref.node)] = ref
    for access in scope.accesses[name]:
        accesses[id(access.node)] = access
    return list(accesses.values())


def _small(stmt: cst.CSTNode) -> cst.BaseSmallStatement | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        return stmt.body[0]
    return None


def _assign_name(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """(name, value) for `name = value` (one plain-name target)."""
    small = _small(stmt)
    if (
        isinstance(small, cst.Assign)
        and len(small.targets) == 1
        and isinstance(small.targets[0].target, cst.Name)
    ):
        return small.targets[0].target.value, small.value
    return None


class ChainFinder:
    """Finds chains in one block; `codemod` supplies metadata (names, parents, positions, scopes)."""

    def __init__(self, codemod: cst.MetadataDependent, stmts: Sequence[cst.CSTNode], *, sdpa: bool) -> None:
        self.cm = codemod
        self.stmts = list(stmts)
        self.sdpa = sdpa
        self.pattern: Pattern = ATTENTION if sdpa else FUSED_SOFTMAX
        self.pre_kinds = tuple(reversed(self.pattern.before()))  # inward from the softmax
        self._class_infos: dict[int, mt.ClassInfo] = {}
        # What the profile saw at the site being matched (None: static mode, the source alone decides):
        # steps it did not see are not folded, and operands must be of the kind it saw.
        self.facts: AttentionFacts | None = None
        self.refused: list[tuple[str, cst.CSTNode, str]] = []  # (kind, node, why it was not folded)

    def with_facts(self, facts: AttentionFacts | None) -> None:
        self.facts = facts
        self.refused = []

    def allows(self, kind: str) -> bool:
        """Whether a step of this kind may be folded: a scale or mask only where the profile saw one (an
        arithmetic op the source alone cannot tell from others: a per-head tensor, a position bias).
        Calls the source names (dropout, softmax, masked_fill(0), the products) need no profile: an
        inactive dropout runs no op to see."""
        return self.facts is None or kind not in self.pattern.arithmetic() or self.facts.has(kind)

    def scale_problem(self, factor: cst.BaseExpression) -> str | None:
        """Why `factor` cannot be passed as a Python-number scale, or None."""
        scale = self.facts.scale if self.facts is not None else None
        if scale is not None and scale.kind == "number":
            return None
        if scale is not None and scale.is_tensor:
            return f"the scale `{mt.code(factor)}` is {scale.words()} (as profiled), not a Python number"
        if mt.tensor_valued(self.cm, factor, self.class_value):
            return f"the scale `{mt.code(factor)}` is a tensor, not a Python number"
        return None

    def mask_problem(self, mask: cst.BaseExpression, additive: bool) -> str | None:
        """Why `mask` cannot be passed as the fused call's mask, or None."""
        profiled = self.facts.mask if self.facts is not None else None
        if additive and (profiled is not None and profiled.dtype == "bool" or _reads_as_bool(self.cm, mask)):
            return (
                f"the mask `{mt.code(mask)}` is bool and added to the scores (each True adds 1.0), which a "
                "fused call would read as a masked_fill mask"
            )
        return None

    # ---- what `self.X` is ---------------------------------------------------------------------------
    def module_kind(self, func: cst.BaseExpression) -> tuple[str | None, cst.Call | None]:
        """For `self.X`: ("dropout" | "softmax" | None, the constructor call in __init__)."""
        attr = mt.self_attr(func)
        if attr is None:
            return None, None
        cls = mt.enclosing_class(self.cm, func)
        if cls is None:
            return None, None
        info = self._class_infos.get(id(cls))
        if info is None:
            info = self._class_infos[id(cls)] = mt.class_info(cls)
        value = info.value(attr)
        if not isinstance(value, cst.Call):
            return None, None
        if mt.resolves_to(self.cm, value.func, mt.DROPOUT_MODULES):
            return DROPOUT, value
        if mt.resolves_to(self.cm, value.func, mt.SOFTMAX_MODULES):
            return SOFTMAX, value
        return None, None

    def class_value(self, func: cst.BaseExpression) -> cst.BaseExpression | None:
        """What `__init__` assigns to `self.X` (module, buffer or value), None when unknown."""
        attr = mt.self_attr(func)
        cls = mt.enclosing_class(self.cm, func) if attr else None
        if cls is None or attr is None:
            return None
        info = self._class_infos.get(id(cls))
        if info is None:
            info = self._class_infos[id(cls)] = mt.class_info(cls)
        return info.value(attr)

    # ---- single ops --------------------------------------------------------------------------------
    def _method(self, node: cst.BaseExpression, name: str) -> bool:
        """`<tensor>.name(...)`: not a torch function, and not `self.name(...)` (a submodule)."""
        return (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value == name
            and not mt.is_torch_namespace(self.cm, node.func.value)
            and not m.matches(node.func.value, m.Name("self"))
        )

    def _masked_fill(
        self, node: cst.BaseExpression
    ) -> tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression] | None:
        """(input, mask, value) of `x.masked_fill(m, v)` / `torch.masked_fill(x, m, v)`."""
        if self._method(node, "masked_fill"):
            args = mt.bind_args(node, ("mask", "value"), required=2)  # type: ignore[arg-type]
            if args:
                return node.func.value, args["mask"].value, args["value"].value  # type: ignore[union-attr]
        elif isinstance(node, cst.Call) and mt.resolves_to(self.cm, node.func, mt.MASKED_FILL_FUNCS):
            args = mt.bind_args(node, ("input", "mask", "value"), required=3)
            if args:
                return args["input"].value, args["mask"].value, args["value"].value
        return None

    def _matmul(self, node: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
            return node.left, node.right
        if isinstance(node, cst.Call) and mt.resolves_to(self.cm, node.func, mt.MATMUL_FUNCS):
            args = mt.bind_args(node, ("input", "other"), required=2) or mt.bind_args(
                node, ("input", "mat2"), required=2
            )
            if args:
                return args["input"].value, (args.get("other") or args["mat2"]).value
        return None

    def _transposed(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        """K for `K.transpose(-2, -1)`, `K.transpose(-1, -2)`, `K.mT`, `torch.transpose(K, -2, -1)`."""
        node = mt.unparen(node) if not isinstance(node, cst.Name) else node
        if m.matches(node, m.Attribute(attr=m.Name("mT"))):
            return node.value  # type: ignore[union-attr]
        dims: tuple[cst.BaseExpression | None, cst.BaseExpression | None] = (None, None)
        source: cst.BaseExpression | None = None
        if self._method(node, "transpose"):
            args = mt.bind_args(node, ("dim0", "dim1"), required=2)  # type: ignore[arg-type]
            if args:
                source, dims = node.func.value, (args["dim0"].value, args["dim1"].value)  # type: ignore[union-attr]
        elif isinstance(node, cst.Call) and mt.resolves_to(self.cm, node.func, mt.TRANSPOSE_FUNCS):
            args = mt.bind_args(node, ("input", "dim0", "dim1"), required=3)
            if args:
                source, dims = args["input"].value, (args["dim0"].value, args["dim1"].value)
        wanted = [{-1, -2}]
        rank = len(self.facts.scores_shape) if self.facts is not None and self.facts.scores_shape else None
        if rank is not None:  # `k.transpose(2, 3)` on the 4-D keys the profile saw
            wanted.append({rank - 1, rank - 2})
        if source is not None and {mt.int_value(dims[0]), mt.int_value(dims[1])} in wanted:
            return source
        return None

    def _is_op(self, node: cst.BaseExpression) -> bool:
        """Whether node computes a tensor in the chain's way (a masked_fill, a matrix product, or arithmetic
        on one), so it is the flowing side of a binary op rather than a factor or a mask."""
        if self._masked_fill(node) is not None or self._matmul(node) is not None:
            return True
        if isinstance(node, cst.BinaryOperation):
            return self._is_op(node.left) or self._is_op(node.right)
        return False

    def peel_pre(self, node: cst.BaseExpression, kind: str, prefer: frozenset[str]) -> Step | None:
        if self.allows(kind):
            step = self._peel_pre(node, kind, prefer)
        elif kind == MASK:
            # a call to this file's mask-adding helper is read from the source, as dropout is: its add ran in
            # the helper's own frame, where the profile's chain (one function's ops) does not bind it
            step = self._helper_mask(node, prefer)
        else:
            return None
        if step is None:
            return None
        problem = None
        if kind == SCALE:
            problem = self.scale_problem(step.params["factor"])  # type: ignore[arg-type]
        elif kind == MASK:
            problem = self.mask_problem(step.params["mask"], step.params.get("fill") is None)  # type: ignore[arg-type]
        if problem is not None:
            self.refused.append((kind, step.node, problem))
            return None
        return step

    def _peel_pre(self, node: cst.BaseExpression, kind: str, prefer: frozenset[str]) -> Step | None:
        if kind == MASK:
            fill = self._masked_fill(node)
            if fill is not None:
                return Step(MASK, node, fill[0], {"mask": fill[1], "fill": fill[2]})
            if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
                flow, other = node.left, node.right
                if (isinstance(node.right, cst.Name) and node.right.value in prefer) or (
                    self._is_op(node.right) and not self._is_op(node.left)
                ):
                    flow, other = node.right, node.left
                if (isinstance(other, cst.Name) and other.value in prefer) or mt.number_value(
                    other
                ) is not None:
                    return None
                return Step(MASK, node, flow, {"mask": other, "fill": None})
            return self._helper_mask(node, prefer)
        if kind == SCALE:
            if not isinstance(node, cst.BinaryOperation):
                return None
            if isinstance(node.operator, cst.Divide):
                if mt.is_scalarish(node.right, prefer):
                    return Step(SCALE, node, node.left, {"factor": node.right}, divide=True)
                return None
            if isinstance(node.operator, cst.Multiply):
                left_ok = mt.is_scalarish(node.left, prefer) and not self._is_op(node.left)
                right_ok = mt.is_scalarish(node.right, prefer) and not self._is_op(node.right)
                if right_ok and left_ok:  # two names: only a literal-looking side is surely the factor
                    right_ok = not isinstance(mt.unparen(node.right), cst.Name | cst.Attribute)
                    left_ok = not right_ok and not isinstance(mt.unparen(node.left), cst.Name | cst.Attribute)
                if right_ok:  # `x * c`
                    return Step(SCALE, node, node.left, {"factor": node.right})
                if left_ok:  # `c * x`
                    return Step(SCALE, node, node.right, {"factor": node.left})
            return None
        if kind == QK:
            mm = self._matmul(node)
            if mm is None:
                return None
            k = self._transposed(mm[1])
            if k is None:
                return None
            return Step(QK, node, None, {"q": mm[0], "k": k})
        raise ValueError(kind)

    def _helper_mask(self, node: cst.BaseExpression, prefer: frozenset[str]) -> Step | None:
        """timm's `attn = maybe_add_mask(attn, attn_bias)`: see `_mask_helper_call`."""
        helper = _mask_helper_call(self.cm, node, prefer)
        return None if helper is None else Step(MASK, node, helper[0], {"mask": helper[1], "fill": None})

    def peel_softmax(self, node: cst.BaseExpression) -> Step | None:
        """The softmax step of `node`, its input with an upcast (`x.float()`) peeled off and recorded as
        `params["upcast"]`, as is `dtype=torch.float32` (the fused call computes in float32 and returns the
        input's dtype: the rewrite then needs the result cast back, see `upcast_problem`)."""
        step = self._softmax_call(node)
        if step is None or step.input is None:
            return step
        inner = _float32_cast(self.cm, step.input)
        if inner is not None:
            step.input = inner
            step.params["upcast"] = cst.Name("True")
        return step

    def _softmax_call(self, node: cst.BaseExpression) -> Step | None:
        if not isinstance(node, cst.Call):
            return None
        args: dict[str, cst.Arg] | None = None
        source: cst.BaseExpression | None = None
        if mt.resolves_to(self.cm, node.func, {"torch.nn.functional.softmax"}):
            args = mt.bind_args(node, ("input", "dim", "_stacklevel", "dtype"))
        elif mt.resolves_to(self.cm, node.func, {"torch.softmax", "torch.special.softmax"}):
            args = mt.bind_args(node, ("input", "dim", "dtype"))
        elif self._method(node, "softmax"):
            args = mt.bind_args(node, ("dim", "dtype"), required=0)
            source = node.func.value  # type: ignore[union-attr]
        elif self._softmax_wrapper(node.func):
            args = mt.bind_args(node, ("input", "dim", "onnx_trace"))
            if args is None or "dim" not in args:
                return None
            step = Step(SOFTMAX, node, args["input"].value, {"dim": args["dim"].value})
            step.params["upcast"] = cst.Name("True")
            return step
        elif (upcast := self._softmax_attribute(node.func)) is not None:
            args = mt.bind_args(node, ("input", "dim"))
            if args is None or "dim" not in args:
                return None
            step = Step(SOFTMAX, node, args["input"].value, {"dim": args["dim"].value})
            if upcast:
                step.params["upcast"] = cst.Name("True")
            return step
        else:
            return self._softmax_module(node)
        if args is None:
            return None
        step = Step(SOFTMAX, node, source if source is not None else args["input"].value, {})
        step.params["dim"] = args["dim"].value if "dim" in args else None
        if "dim" not in args:
            step.problem = "the softmax has no explicit dim"
        elif "dtype" in args:
            if _is_float32(self.cm, args["dtype"].value):
                step.params["upcast"] = cst.Name("True")
            else:
                step.problem = "the softmax casts with dtype=, which the fused kernel does not do"
        return step

    def _softmax_wrapper(self, func: cst.BaseExpression) -> bool:
        """`func` names a function of this module that only returns a float32 softmax of its first argument
        over its `dim` argument (fairseq's `softmax(x, dim, onnx_trace=False)`): each return is
        `F.softmax(x.float(), dim=dim)` or `F.softmax(x, dim=dim, dtype=torch.float32)`."""
        if not isinstance(func, cst.Name):
            return False
        module = self.cm.context.wrapper.module if self.cm.context.wrapper is not None else None  # type: ignore[attr-defined]
        defs = [
            d
            for d in (module.body if module is not None else [])
            if isinstance(d, cst.FunctionDef) and d.name.value == func.value
        ]
        if len(defs) != 1:
            return False
        params = [p.name.value for p in defs[0].params.params]
        if len(params) < 2 or params[1] != "dim":
            return False
        returns = mt.nodes_of(defs[0].body, cst.Return)
        others = [
            st
            for st in mt.nodes_of(defs[0].body, cst.BaseSmallStatement)
            if not isinstance(st, cst.Return | cst.Expr)
        ]
        return (
            bool(returns)
            and not others
            and all(self._float32_softmax_of(r.value, params[0]) for r in returns)
        )

    def _softmax_attribute(self, func: cst.BaseExpression) -> bool | None:
        """For `self.attn_fn` that __init__ sets to a softmax function (x-transformers:
        `partial(F.softmax, dtype=torch.float32) if not qk_norm else F.softmax`): whether some branch
        computes in float32; None when it is not such a function."""
        value = self.class_value(func) if mt.self_attr(func) else None
        if value is None:
            return None
        upcast = False
        for branch in (value.body, value.orelse) if isinstance(value, cst.IfExp) else (value,):
            branch = mt.unparen(branch)
            if mt.resolves_to(self.cm, branch, mt.SOFTMAX_FUNCS):
                continue
            if not (
                isinstance(branch, cst.Call)
                and mt.resolves_to(self.cm, branch.func, {"functools.partial"})
                and len(branch.args) == 2
                and branch.args[0].keyword is None
                and mt.resolves_to(self.cm, branch.args[0].value, mt.SOFTMAX_FUNCS)
                and m.matches(branch.args[1].keyword, m.Name("dtype"))
                and _is_float32(self.cm, branch.args[1].value)
            ):
                return None
            upcast = True
        return upcast

    def _float32_softmax_of(self, node: cst.BaseExpression | None, name: str) -> bool:
        step = self._softmax_call(node) if node is not None else None
        if (
            step is None
            or step.problem
            or "upcast" not in step.params
            and _float32_cast(self.cm, step.input) is None
        ):
            return False
        flowing = _float32_cast(self.cm, step.input) or step.input
        return m.matches(flowing, m.Name(name)) and m.matches(step.params.get("dim"), m.Name("dim"))

    def _softmax_module(self, node: cst.Call) -> Step | None:
        """`self.softmax(x)` with `self.softmax = nn.Softmax(dim=...)` in __init__, or `nn.Softmax(dim=-1)(x)`."""
        ctor: cst.Call | None
        if isinstance(node.func, cst.Call) and mt.resolves_to(self.cm, node.func.func, mt.SOFTMAX_MODULES):
            ctor = node.func
        else:
            kind, ctor = self.module_kind(node.func)
            if kind != SOFTMAX:
                return None
        if ctor is None:
            return None
        call_args = mt.bind_args(node, ("input",))
        ctor_args = mt.bind_args(ctor, ("dim",), required=0)
        if call_args is None or ctor_args is None:
            return None
        dim = ctor_args.get("dim")
        step = Step(SOFTMAX, node, call_args["input"].value, {"dim": dim.value if dim else None})
        if dim is None:
            step.problem = "the nn.Softmax module has no explicit dim"
        return step

    def peel_post(self, node: cst.BaseExpression, kind: str) -> Step | None:
        if not self.allows(kind):
            return None
        return self._peel_post(node, kind)

    def _cast_to_named_dtype(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        """Y for `.type(dtype)` / `.to(dtype)` where the function binds `dtype = Y.dtype` once
        (x-transformers keeps the input's dtype in a name before its float32 softmax)."""
        if not (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in ("type", "to")
            and len(node.args) == 1
            and node.args[0].keyword is None
            and isinstance(node.args[0].value, cst.Name)
        ):
            return None
        values = mt.local_values(self.cm, node.args[0].value)
        if len(values) == 1 and m.matches(values[0], m.Attribute(attr=m.Name("dtype"))):
            return values[0].value  # type: ignore[attr-defined]
        return None

    def _peel_post(self, node: cst.BaseExpression, kind: str) -> Step | None:
        if kind == CAST:
            target = _cast_back(node) or self._cast_to_named_dtype(node)
            if target is None:
                return None
            return Step(CAST, node, node.func.value, {"to": target})  # type: ignore[union-attr]
        if kind == ZERO:
            fill = self._masked_fill(node)
            if fill is not None and mt.is_zero(fill[2]):
                return Step(ZERO, node, fill[0], {"mask": fill[1]})
            return None
        if kind == DROPOUT:
            if not isinstance(node, cst.Call):
                return None
            if mt.resolves_to(self.cm, node.func, mt.DROPOUT_FUNCS):
                args = mt.bind_args(node, ("input", "p", "training", "inplace"))
                if args is None:
                    return None
                p = args["p"].value if "p" in args else cst.Float("0.5")
                training = args["training"].value if "training" in args else None
                return Step(DROPOUT, node, args["input"].value, {"p": p, "training": training})
            if mt.resolves_to(self.cm, node.func, mt.TORCH_DROPOUT):
                args = mt.bind_args(node, ("input", "p", "train"), required=3)
                if args is None:
                    return None
                return Step(
                    DROPOUT,
                    node,
                    args["input"].value,
                    {"p": args["p"].value, "training": args["train"].value},
                )
            kind_, _ctor = self.module_kind(node.func)
            if kind_ == DROPOUT:
                args = mt.bind_args(node, ("input",))
                if args is None:
                    return None
                return Step(DROPOUT, node, args["input"].value, {"module": node.func})
            return None
        if kind == PV:
            mm = self._matmul(node)
            if mm is None:
                return None
            return Step(PV, node, mm[0], {"v": mm[1]})
        raise ValueError(kind)

    # ---- walking a statement ---------------------------------------------------------------------------
    def enclosing_op(self, node: cst.BaseExpression) -> cst.BaseExpression | None:
        """The Call / BinaryOperation that takes `node` as an operand, argument or method receiver."""
        parent = mt.parent(self.cm, node)
        if isinstance(parent, cst.Arg):
            parent = mt.parent(self.cm, parent)
        elif isinstance(parent, cst.Attribute) and parent.value is node:
            call = mt.parent(self.cm, parent)
            parent = call if isinstance(call, cst.Call) and call.func is parent else None
        if isinstance(parent, cst.Call | cst.BinaryOperation):
            return parent
        return None

    def _extend_up(self, node: cst.BaseExpression, used: set[str]) -> tuple[list[Step], cst.BaseExpression]:
        """Post steps applied on top of `node` inside its statement; returns (steps, new top)."""
        steps: list[Step] = []
        current = node
        while True:
            op = self.enclosing_op(current)
            if op is None:
                return steps, current
            step = None
            for kind in self.post_kinds(used):
                candidate = self.peel_post(op, kind)
                if candidate is not None and candidate.input is current:
                    step = candidate
                    break
            if step is None:
                return steps, current
            steps.append(step)
            used.add(step.kind)
            current = op
            if step.kind == PV:  # the product ends the chain
                return steps, current

    def post_kinds(self, used: set[str]) -> tuple[str, ...]:
        """The steps that may be applied next after the softmax, once the `used` ones were: a cast not
        yet met, then what the declared pattern allows next."""
        declared = self.pattern.next_after([k for k in used if k != CAST])
        return declared if CAST in used else (CAST, *declared)

    def _peel_down(
        self, node: cst.BaseExpression, start: int, prefer: frozenset[str]
    ) -> tuple[list[Step], cst.BaseExpression, int]:
        """Pre steps under node (outermost first); returns (steps, what is left, next grammar position)."""
        steps: list[Step] = []
        pos = start
        current = node
        while pos < len(self.pre_kinds):
            for offset, kind in enumerate(self.pre_kinds[pos:]):
                step = self.peel_pre(current, kind, prefer)
                if step is not None:
                    steps.append(step)
                    pos += offset + 1
                    break
            else:
                break
            if step.input is None:  # qk: nothing flows into it
                break
            current = step.input
        return steps, current, pos

    def _in_nested_scope(self, node: cst.CSTNode, stmt: cst.CSTNode) -> bool:
        return mt.inside(
            self.cm, node, (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp), stmt
        )

    def _target_of_top(self, top: cst.BaseExpression, stmt: cst.CSTNode) -> str | None:
        assign = _assign_name(stmt)
        if assign is not None and assign[1] is top:
            return assign[0]
        return None

    def _reads_of(self, name: str, stmt: cst.CSTNode) -> list[cst.Name]:
        small = _small(stmt)
        if small is None:
            return []
        roots: list[cst.CSTNode]
        if isinstance(small, cst.Assign):
            roots = [small.value]
        elif (
            isinstance(small, cst.AugAssign | cst.Expr | cst.Return)
            and getattr(small, "value", None) is not None
        ):
            roots = [small.value]  # type: ignore[list-item]
        else:
            return []
        out = []
        for root in roots:
            for n in mt.names_in(root):
                par = mt.parent(self.cm, n)
                if n.value != name:
                    continue
                if isinstance(par, cst.Attribute) and par.attr is n:
                    continue
                if isinstance(par, cst.Arg) and par.keyword is n:
                    continue
                out.append(n)
        return out

    # ---- whole chains ---------------------------------------------------------------------------------
    def softmax_calls(self, stmt: cst.CSTNode) -> list[Step]:
        small = _small(stmt)
        if small is None:
            return []
        return [s for s in (self.peel_softmax(c) for c in mt.nodes_of(small, cst.Call)) if s is not None]

    def chain_at(self, index: int, softmax: Step, lower: int, link: bool) -> Chain:
        """The longest chain around `softmax` in statement `index` (not reaching above statement `lower`)."""
        stmt = self.stmts[index]
        link = link and not self._in_nested_scope(softmax.node, stmt)
        # inside the softmax statement
        assert softmax.input is not None
        prefer = self._prefer(index)
        pre, entry, pos = self._peel_down(softmax.input, 0, prefer)
        used: set[str] = set()
        post, top = self._extend_up(softmax.node, used)
        segments = [
            Segment(index, [*reversed(pre), softmax, *post], entry, top, self._target_of_top(top, stmt))
        ]
        if link:
            self._extend_backwards(segments, index, lower, entry, pos)
            self._extend_forwards(segments, index, used)
        softmax_seg = next(n for n, seg in enumerate(segments) if seg.index == index)
        return Chain(segments, softmax_seg)

    def _extend_backwards(
        self, segments: list[Segment], index: int, lower: int, entry: cst.BaseExpression, pos: int
    ) -> None:
        """Prepend the statements above `index` (down to `lower`) that compute what flows into the chain."""
        i = index
        while (
            isinstance(entry, cst.Name)
            and i - 1 >= lower
            and pos < len(self.pre_kinds)
            and (segments[0].steps[0].kind != QK)
        ):
            prev = self.stmts[i - 1]
            small = _small(prev)
            if (
                isinstance(small, cst.AugAssign)
                and isinstance(small.target, cst.Name)
                and small.target.value == entry.value
            ):
                step = self._aug_step(small, entry, pos)
                if step is None:
                    break
                pos = self.pre_kinds.index(step.kind) + 1
                segments.insert(0, Segment(i - 1, [step], small.target, small.value, entry.value, aug=True))
                entry = small.target
                i -= 1
                continue
            conditional = self._conditional_mask(i - 1, entry, pos)
            if conditional is not None:
                segments.insert(0, conditional)
                pos = self.pre_kinds.index(MASK) + 1
                i -= 1
                continue
            assign = _assign_name(prev)
            if assign is None or assign[0] != entry.value:
                break
            steps, inner, new_pos = self._peel_down(assign[1], pos, self._prefer(i - 1))
            if not steps:
                break
            if self._in_nested_scope(inner, prev):
                break
            segments.insert(0, Segment(i - 1, list(reversed(steps)), inner, assign[1], assign[0]))
            entry, pos = inner, new_pos
            i -= 1
            if steps[-1].kind == QK:
                break

    def _aug_step(self, small: cst.AugAssign, entry: cst.Name, pos: int) -> Step | None:
        """`x += mask`, `x *= scale`, `x /= scale` as the chain's step; None where it cannot be one (a
        refusal with a reason is recorded)."""
        kind = {cst.AddAssign: MASK, cst.MultiplyAssign: SCALE, cst.DivideAssign: SCALE}.get(
            type(small.operator)
        )
        if kind is None or kind not in self.pre_kinds[pos:] or not self.allows(kind):
            return None
        if kind == SCALE and not mt.is_scalarish(small.value, frozenset({entry.value})):
            return None
        problem = self.scale_problem(small.value) if kind == SCALE else self.mask_problem(small.value, True)
        if problem is not None:
            self.refused.append((kind, small, problem))
            return None
        params = {"mask": small.value, "fill": None} if kind == MASK else {"factor": small.value}
        return Step(
            kind,
            small.value,
            small.target,
            params,
            divide=isinstance(small.operator, cst.DivideAssign),
        )

    def _extend_forwards(self, segments: list[Segment], index: int, used: set[str]) -> None:
        """Append the statements below `index` that post-process the chain's result."""
        j = index
        while j + 1 < len(self.stmts) and segments[-1].target is not None and PV not in used:
            name = segments[-1].target
            nxt = self.stmts[j + 1]
            reads = self._reads_of(name, nxt)
            if len(reads) != 1 or self._in_nested_scope(reads[0], nxt):
                break
            steps, top = self._extend_up(reads[0], used)
            if not steps:
                break
            segments.append(Segment(j + 1, steps, reads[0], top, self._target_of_top(top, nxt)))
            j += 1

    def _conditional_mask(self, index: int, entry: cst.Name, pos: int) -> Segment | None:
        """`if <test>: x = x + mask` (or `x += mask`, `x = x.masked_fill(m, v)`), with no else: the mask step,
        applied only when the test holds (`params["condition"]`), as a segment binding x. Folded even where
        the profile saw no mask (its run took the other branch); a bool mask added is still refused.

        The block may also name the mask first (`causal_mask = attention_mask[...]`, inlined: see
        `_inlinable`), and may add it to a view of x that it then undoes (BART/CLIP's 3-D scores:
        `x = x.view(b, h, t, s) + mask; x = x.view(b * h, t, s)`): `params["reshape"]` is the view the
        mask applies to, `params["restore"]` the view back (the last dim is the same in both)."""
        stmt = self.stmts[index]
        if not (
            isinstance(stmt, cst.If)
            and stmt.orelse is None
            and isinstance(stmt.body, cst.IndentedBlock)
            and MASK in self.pre_kinds[pos:]
        ):
            return None
        name = entry.value
        body = list(stmt.body.body)
        restore = _restoring_view(body[-1], name) if len(body) >= 2 else None
        if restore is not None:
            body = body[:-1]
        *preps, inner = body
        inlined = self._inlinable(preps, inner, index)
        step = self._mask_step(inner, name, allow_view=restore is not None) if inlined is not None else None
        if step is None or inlined is None:
            return None
        reshape = None if isinstance(step.input, cst.Name) else step.input
        if (reshape is None) != (restore is None) or not _same_last_dim(reshape, restore):
            return None
        bound = sorted(
            {n.value for view in (reshape, restore) if view is not None for n in mt.names_in(view)}
            & set(inlined)
        )
        if bound:
            # the fused call takes the view whether or not the test holds (Swin's `num_win = mask.shape[0]`)
            self.refused.append(
                (
                    MASK,
                    step.node,
                    f"the view of the scores reads `{bound[0]}`, which is set only under `if {mt.code(stmt.test)}:`",
                )
            )
            return None
        step.params.update(condition=stmt.test, reshape=reshape, restore=restore)
        if inlined:
            step.params["mask"] = _inline(step.params["mask"], inlined)  # type: ignore[arg-type]
            step.params["inlined"] = cst.Tuple([cst.Element(v) for v in inlined.values()])
        problem = self.mask_problem(step.params["mask"], step.params.get("fill") is None)  # type: ignore[arg-type]
        if problem is not None:
            self.refused.append((MASK, step.node, problem))
            return None
        return Segment(index, [step], cst.Name(name), step.node, name, aug=bool(step.params.get("aug")))

    def _mask_step(self, stmt: cst.BaseStatement, name: str, *, allow_view: bool) -> Step | None:
        """The mask step of `name += mask` or `name = <mask applied to name (or to a view of it)>`."""
        small = _small(stmt)
        if isinstance(small, cst.AugAssign) and isinstance(small.operator, cst.AddAssign):
            if isinstance(small.target, cst.Name) and small.target.value == name:
                step = Step(MASK, small.value, small.target, {"mask": small.value, "fill": None})
                step.params["aug"] = cst.Name("True")
                return step
            return None
        assign = _assign_name(stmt)
        if assign is None or assign[0] != name:
            return None
        step = self._peel_pre(assign[1], MASK, frozenset({name}))
        if step is None:
            return None
        flowing = step.input
        if allow_view and _view_of(flowing, name):
            return step
        return step if m.matches(flowing, m.Name(name)) else None

    def _inlinable(
        self, preps: Sequence[cst.BaseStatement], inner: cst.BaseStatement, index: int
    ) -> dict[str, cst.BaseExpression] | None:
        """`name = value` statements before the mask step in the `if` block (Llama's `causal_mask =
        attention_mask[...]`) whose names only the mask step reads: name -> value, to inline; None when
        a statement is something else or its name is read elsewhere."""
        out: dict[str, cst.BaseExpression] = {}
        later = [n.value for stmt in self.stmts[index + 1 :] for n in mt.names_in(stmt)]
        for prep in preps:
            assign = _assign_name(prep)
            if assign is None or assign[0] in out or assign[0] in later:
                return None
            if sum(n.value == assign[0] for n in mt.names_in(inner)) != 1:
                return None
            out[assign[0]] = assign[1]
        return out

    def _prefer(self, index: int) -> frozenset[str]:
        """Names that hold the flowing tensor around statement `index` (its target, the previous one's)."""
        names = set()
        for k in (index, index - 1):
            if 0 <= k < len(self.stmts):
                small = _small(self.stmts[k])
                if (
                    isinstance(small, cst.Assign)
                    and len(small.targets) == 1
                    and isinstance(small.targets[0].target, cst.Name)
                ):
                    names.add(small.targets[0].target.value)
                if isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name):
                    names.add(small.target.value)
        return frozenset(names)

    def candidates(self, chain: Chain) -> list[Chain]:
        """Sub-chains around the softmax, longest first (the codemod takes the first it can rewrite)."""
        n = len(chain.segments)
        s = chain.softmax_seg
        subs = [(a, z) for a in range(0, s + 1) for z in range(n - 1, s - 1, -1)]
        subs.sort(key=lambda az: (-(az[1] - az[0]), az[0]))
        return [chain.sub(a, z) for a, z in subs]

    # ---- safety of folding the temporaries ----------------------------------------------------------------
    def pos(self, node: cst.CSTNode) -> tuple[tuple[int, int], tuple[int, int]]:
        p = self.cm.get_metadata(PositionProvider, node)
        return (p.start.line, p.start.column), (p.end.line, p.end.column)

    def fresh_before(self, chain: Chain) -> bool:
        """For a chain starting with `x op= ...`: x was last bound, earlier in the block, to a new tensor
        (`x = q @ k.T`, not a name or attribute it may share with something else), and nothing between
        read it except for its dtype, device or shape (T5's `scores += position_bias` after the bias is
        built from `scores.device`)."""
        first = chain.segments[0]
        if not first.aug or first.target is None:
            return not first.aug
        bound = block_index(self.stmts).simple_before(first.target, first.index)
        if bound is None or bound.value is None:
            return False
        for stmt in self.stmts[bound.index + 1 : first.index]:
            if any(
                n.value == first.target and not _metadata_read(self.cm, n) and not _attribute_name(self.cm, n)
                for n in mt.names_in(stmt)
            ):
                return False
        return not isinstance(bound.value, cst.Name | cst.Attribute | cst.Subscript)

    def temps_problem(
        self,
        chain: Chain,
        carried: Sequence[cst.CSTNode],
        meta_name: str | None = None,
        keep_first: bool = False,
    ) -> tuple[str, int, bool] | None:
        """A read that folding would break: (name, line, it is in a return), else None.

        Folded away: the value each segment but the last binds (the first one's too when it is kept as
        `name = base`, since it then holds the base). A read of such a value is fine when it is the link to
        the next segment, when it lies in code the rewrite drops, or (for `meta_name`, the name the rewrite
        reads the chain's input from, which keeps dtype, device and shape) when it reads only
        `.dtype`/`.device`/`.shape`/`.size()`/`.dim()`/`.ndim` inside a carried expression.
        """
        segments = chain.segments
        final = segments[-1].target
        folded = {seg.target for seg in segments[:-1] if seg.target}
        if not folded:
            return None
        links = {id(seg.entry) for seg in segments[1:]}
        first_stmt = self.stmts[segments[0].index]
        last_stmt = self.stmts[segments[-1].index]
        chain_stmts = [self.stmts[seg.index] for seg in segments]
        start = self.pos(_small(first_stmt) or first_stmt)[0]
        end = self.pos(_small(last_stmt) or last_stmt)[1]
        scope = self.cm.get_metadata(ScopeProvider, _small(first_stmt) or first_stmt)
        in_loop = mt.inside(self.cm, first_stmt, (cst.For, cst.While), _function_of(self.cm, first_stmt))
        for name in sorted(folded):
            if scope is None:
                continue
            for access in _accesses(scope, name):
                node = access.node
                if id(node) in links:
                    continue
                (line, col), _ = self.pos(node)
                in_chain = any(mt.contains(s, node) for s in chain_stmts)
                if (
                    in_chain
                    and mt.contains(first_stmt, node)
                    and (not keep_first or mt.contains(segments[0].entry, node))
                ):
                    continue  # the first statement reads what was bound before the chain, and still is
                if in_chain:
                    if self._breaks_carried(node, carried, name == meta_name):
                        return name, line, False
                    continue
                if name == final:
                    continue
                if access.scope is not scope:
                    return name, line, _in_return(self.cm, node)
                if (line, col) < start:
                    if in_loop:
                        return name, line, False
                    continue
                if (line, col) > end and self._rebound_before(name, segments[-1].index, (line, col)):
                    continue
                return name, line, _in_return(self.cm, node)
        return None

    def _breaks_carried(self, node: cst.CSTNode, carried: Sequence[cst.CSTNode], is_meta: bool) -> bool:
        """Whether a read of a folded value inside the chain breaks the rewrite: it lies in a carried
        expression, and is not a metadata read (`.dtype`, `.shape` ...) of the name the rewrite reads from."""
        carrier = next((c for c in carried if mt.contains(c, node)), None)
        if carrier is None:
            return False
        return not (is_meta and _metadata_read(self.cm, node))

    def _rebound_before(self, name: str, after_index: int, where: tuple[int, int]) -> bool:
        bound = block_index(self.stmts).simple_after(name, after_index)
        return bound is not None and self.pos(_small(self.stmts[bound.index]))[1] <= where


FLOAT32 = frozenset({"torch.float32", "torch.float"})
CAST_METHODS = frozenset({"type_as", "to", "type"})


def _is_float32(cm: cst.MetadataDependent, node: cst.BaseExpression) -> bool:
    return mt.resolves_to(cm, node, FLOAT32)


def _float32_cast(cm: cst.MetadataDependent, node: cst.BaseExpression) -> cst.BaseExpression | None:
    """X for `X.float()`, `X.to(torch.float32)`, `X.to(dtype=torch.float32)`, `X.type(torch.float32)`."""
    node = mt.unparen(node)
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)):
        return None
    method, args = node.func.attr.value, node.args
    if method == "float" and not args:
        return node.func.value
    if method in ("to", "type") and len(args) == 1 and _is_float32(cm, args[0].value):
        if args[0].keyword is None or args[0].keyword.value == "dtype":
            return node.func.value
    return None


def _cast_back(node: cst.BaseExpression) -> cst.BaseExpression | None:
    """Y for a cast to another tensor's dtype: `.type_as(Y)`, `.to(Y.dtype)`, `.to(dtype=Y.dtype)`,
    `.type(Y.dtype)` (the probabilities cast back after a float32 softmax)."""
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)):
        return None
    if node.func.attr.value not in CAST_METHODS or len(node.args) != 1 or node.args[0].star:
        return None
    arg = node.args[0]
    if node.func.attr.value == "type_as":
        return arg.value if arg.keyword is None else None
    if arg.keyword is not None and arg.keyword.value != "dtype":
        return None
    if m.matches(arg.value, m.Attribute(attr=m.Name("dtype"))):
        return arg.value.value  # type: ignore[union-attr]
    return None


def upcast_problem(chain: Chain, facts: AttentionFacts | None) -> str | None:
    """A softmax in float32 whose result is not cast back (before anything else reads it): the fused call
    returns the scores' dtype, the original float32, unless the profile shows the scores are float32."""
    softmax = chain.step(SOFTMAX)
    if softmax is None or "upcast" not in softmax.params:
        return None
    if chain.step(CAST) is not None or (facts is not None and facts.scores_dtype == "float32"):
        return None
    return "the softmax runs in float32 and its float32 result is used as it is; the fused call keeps the scores' dtype"


def cast_problem(chain: Chain, facts: AttentionFacts | None) -> str | None:
    """A cast after the softmax that the profile shows is not back to the scores' dtype."""
    cast = chain.step(CAST)
    if cast is None or facts is None or not facts.out_dtype or not facts.scores_dtype:
        return None
    if facts.out_dtype != facts.scores_dtype:
        return (
            f"`{mt.code(cast.node)}` casts the probabilities to {facts.out_dtype}, the scores are "
            f"{facts.scores_dtype} (as profiled); the fused call keeps the scores' dtype"
        )
    return None


def guarded(step: Step, value: cst.BaseExpression) -> tuple[cst.BaseExpression, list[cst.CSTNode]]:
    """The mask argument for a step applied only under `if <test>:` (`value if test else None`; just the
    name for `if mask is not None: ... mask`), and the original nodes it reuses."""
    test = step.params.get("condition")
    inlined = step.params.get("inlined")
    reused: list[cst.CSTNode] = (
        [el.value for el in inlined.elements] if isinstance(inlined, cst.Tuple) else []
    )
    if test is None:
        return value, reused
    if (
        isinstance(test, cst.Comparison)
        and len(test.comparisons) == 1
        and isinstance(test.comparisons[0].operator, cst.IsNot)
        and m.matches(test.comparisons[0].comparator, m.Name("None"))
        and mt.unparen(value).deep_equals(mt.unparen(test.left))
    ):
        return value, [test, *reused]
    if isinstance(test, cst.IfExp | cst.Lambda | cst.NamedExpr):
        test = ed.atomic(test)
    return ed.template("__v__ if __t__ else None", v=ed.atomic(value), t=test), [test, *reused]


VIEWS = frozenset({"view", "reshape"})


def _view_of(node: cst.BaseExpression | None, name: str) -> bool:
    """`name.view(...)` / `name.reshape(...)`."""
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value in VIEWS
        and m.matches(node.func.value, m.Name(name))
        and all(not a.star and a.keyword is None for a in node.args)
    )


def _restoring_view(stmt: cst.BaseStatement, name: str) -> cst.Call | None:
    """The view call of `name = name.view(...)`, else None."""
    assign = _assign_name(stmt)
    if assign is not None and assign[0] == name and _view_of(assign[1], name):
        return assign[1]  # type: ignore[return-value]
    return None


def _same_last_dim(reshape: cst.BaseExpression | None, restore: cst.Call | None) -> bool:
    """Both views end with the same size expression (the softmax's dim keeps its length and meaning)."""
    if reshape is None or restore is None:
        return True
    a, b = reshape.args, restore.args  # type: ignore[union-attr]
    return bool(a) and bool(b) and a[-1].value.deep_equals(b[-1].value)


def _inline(node: cst.BaseExpression, values: dict[str, cst.BaseExpression]) -> cst.BaseExpression:
    """`node` with each Name in `values` replaced by its value (parenthesised where it must be)."""
    mapping = {id(n): ed.atomic(values[n.value]) for n in mt.names_in(node) if n.value in values}
    return ed.replace_nodes(node, mapping)  # type: ignore[return-value]


def _reads_as_bool(cm: cst.MetadataDependent, node: cst.BaseExpression, depth: int = 0) -> bool:
    """A mask expression that is bool by its form: a comparison, `~m`, `not`, `m.bool()`, or a local name
    bound to one."""
    node = mt.unparen(node)
    if isinstance(node, cst.Comparison):
        return True
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.BitInvert | cst.Not):
        return True
    if isinstance(node, cst.Name) and depth < 3:
        return any(_reads_as_bool(cm, v, depth + 1) for v in mt.local_values(cm, node))
    return m.matches(node, m.Call(func=m.Attribute(attr=m.Name("bool") | m.Name("logical_not"))))


def _mask_helper_call(
    cm: cst.MetadataDependent, node: cst.BaseExpression, prefer: frozenset[str]
) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
    """(scores, mask) of a call to a module-level function of this file that only adds a mask: its body
    one `return a + b`, or `return a if b is None else a + b` (timm's `maybe_add_mask(scores, attn_mask)`),
    called with two plain positional arguments. A mask that may be None is what the fused calls take
    (None: no mask). Anything else (a decorator, more statements, keywords) is not read through."""
    node = mt.unparen(node)
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and len(node.args) == 2):
        return None
    if any(a.keyword is not None or a.star for a in node.args):
        return None
    func = _module_function(cm, node.func)
    read = _add_mask_params(func) if func is not None else None
    if read is None:
        return None
    (scores_param, mask_param), either = read
    values = {p.name.value: a.value for p, a in zip(_function_params(func), node.args, strict=True)}
    scores, mask = values[scores_param], values[mask_param]
    if either and _flows(mask, prefer) and not _flows(scores, prefer):
        scores, mask = mask, scores  # `a + b` adds either way: the chain's own value is the scores
    return scores, mask


def _flows(node: cst.BaseExpression, prefer: frozenset[str]) -> bool:
    return isinstance(node, cst.Name) and node.value in prefer


# Decorators that return the function itself (they register it for torch.fx tracing: timm's helpers)
_IDENTITY_DECORATORS = frozenset({"torch.fx.wrap", "fx.wrap", "register_notrace_function"})


def _module_function(cm: cst.MetadataDependent, name: cst.Name) -> cst.FunctionDef | None:
    """The one `def NAME` at the top level of this module that `name` reads (undecorated, or only by
    _IDENTITY_DECORATORS), or None."""
    scope = cm.get_metadata(ScopeProvider, name, None)
    if scope is None:
        return None
    assignments = list(scope[name.value])
    if len(assignments) != 1:
        return None
    found = getattr(assignments[0], "node", None)
    if not isinstance(found, cst.FunctionDef) or found.asynchronous:
        return None
    if any(mt.code(d.decorator) not in _IDENTITY_DECORATORS for d in found.decorators):
        return None
    return found if isinstance(getattr(assignments[0], "scope", None), GlobalScope) else None


def _function_params(func: cst.FunctionDef) -> list[cst.Param]:
    return [*func.params.posonly_params, *func.params.params]


def _add_mask_params(func: cst.FunctionDef) -> tuple[tuple[str, str], bool] | None:
    """((scores parameter, mask parameter), either) of a two-parameter function whose body only returns
    the scores plus the mask, or the scores alone when the mask is None; `either`: a plain sum, where the
    call site tells which argument is the scores."""
    params = _function_params(func)
    star = isinstance(func.params.star_arg, cst.Param | cst.ParamStar)  # else MaybeSentinel (truthy)
    if len(params) != 2 or star or func.params.kwonly_params or func.params.star_kwarg is not None:
        return None
    a, b = (p.name.value for p in params)
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    if func.get_docstring(clean=False) is not None:
        body = body[1:]
    small = _small(body[0]) if len(body) == 1 else None
    if not isinstance(small, cst.Return) or small.value is None:
        return None
    value = mt.unparen(small.value)

    def added(x: str, y: str) -> m.BaseMatcherNode:
        return m.BinaryOperation(left=m.Name(x), operator=m.Add(), right=m.Name(y)) | m.BinaryOperation(
            left=m.Name(y), operator=m.Add(), right=m.Name(x)
        )

    if m.matches(value, added(a, b)):
        return (a, b), True
    for scores, mask in ((a, b), (b, a)):
        none = m.Name("None")
        is_none = m.Comparison(left=m.Name(mask), comparisons=[m.ComparisonTarget(m.Is(), none)])
        not_none = m.Comparison(left=m.Name(mask), comparisons=[m.ComparisonTarget(m.IsNot(), none)])
        if m.matches(
            value, m.IfExp(test=is_none, body=m.Name(scores), orelse=added(scores, mask))
        ) or m.matches(value, m.IfExp(test=not_none, body=added(scores, mask), orelse=m.Name(scores))):
            return (scores, mask), False
    return None


def _function_of(cm: cst.MetadataDependent, node: cst.CSTNode) -> cst.CSTNode | None:
    current = mt.parent(cm, node)
    while current is not None and not isinstance(current, cst.FunctionDef):
        current = mt.parent(cm, current)
    return current


def _attribute_name(cm: cst.MetadataDependent, name: cst.Name) -> bool:
    """`name` is the attribute in `obj.name` or a keyword (`f(name=...)`), not a read of the variable."""
    par = mt.parent(cm, name)
    return (isinstance(par, cst.Attribute) and par.attr is name) or (
        isinstance(par, cst.Arg) and par.keyword is name
    )


def _metadata_read(cm: cst.MetadataDependent, name: cst.Name) -> bool:
    par = mt.parent(cm, name)
    if isinstance(par, cst.Attribute) and par.value is name:
        if par.attr.value in {"dtype", "device", "shape", "ndim", "is_cuda"}:
            return True
        call = mt.parent(cm, par)
        return isinstance(call, cst.Call) and call.func is par and par.attr.value in {"size", "dim"}
    return False


def _in_return(cm: cst.MetadataDependent, node: cst.CSTNode) -> bool:
    current = mt.parent(cm, node)
    while current is not None and not isinstance(current, cst.BaseStatement):
        if isinstance(current, cst.Return | cst.Yield):
            return True
        current = mt.parent(cm, current)
    return False


class SoftmaxChainRewriter(BlockRewriter):
    """A codemod that rewrites the chain around each softmax of a block (fused_softmax, sdpa_attention).

    Walks the block's statements, finds every softmax, reads the chain around it (`ChainFinder`, with the
    attention's matrix products when `SDPA`), and asks the subclass for one edit per chain (`_edit_for`);
    statements an edit consumed are not matched again.
    """

    SDPA: bool = False

    def block_edits(self, stmts: Sequence[cst.BaseStatement], indent: str) -> list[BlockEdit]:
        finder = ChainFinder(self, stmts, sdpa=self.SDPA)
        edits: list[BlockEdit] = []
        lower = 0
        for index, stmt in enumerate(stmts):
            if index < lower:
                continue
            softmaxes = finder.softmax_calls(stmt)
            for softmax in softmaxes:
                link = len(softmaxes) == 1
                finder.with_facts(None)
                chain = finder.chain_at(index, softmax, lower, link)
                start, end = self.stmt_lines(stmts, chain.first, chain.last)
                target = self.target_for_lines(start, end)
                if target is None:
                    continue
                facts = target_facts(target, AttentionFacts)
                if facts is not None:
                    if not self._is_profiled_softmax(stmts, index, target):
                        continue  # another softmax in the finding's lines: not the chain the profile saw
                    finder.with_facts(facts)
                    chain = finder.chain_at(index, softmax, lower, link)
                anchor = _small(stmts[chain.first]) or stmts[chain.first]
                if mt.jit_scripted(self, anchor):
                    self.skip(
                        anchor,
                        "not rewritten: the function is compiled by TorchScript (@torch.jit.script), "
                        "which cannot compile the fused call",
                    )
                    continue
                skips = len(self.skipped)
                edit = self._edit_for(finder, stmts, chain, indent)
                if edit is not None or len(self.skipped) > skips:
                    self.reached(target)
                if edit is not None:
                    edits.append(edit)
                    lower = edit.last + 1
        return edits

    def unmatched_reason(
        self, target: Target, functions: list[tuple[str, int, int]], lines: list[str]
    ) -> str | None:
        softmax = target.step_line(SOFTMAX)
        if softmax is None:
            return None
        text = lines[softmax[0] - 1].strip() if 0 < softmax[0] <= len(lines) else ""
        return (
            f"not rewritten: the softmax at line {softmax[0]} (`{text}`) is not in a chain this rewrite reads "
            "(in one branch of an if/else, inside a function or module called there, or a form it does not know)"
        )

    def _is_profiled_softmax(self, stmts: Sequence[cst.BaseStatement], index: int, target: Target) -> bool:
        """Whether the softmax of statement `index` is the one the facts describe (by its line)."""
        profiled = target.step_line(SOFTMAX)
        if profiled is None:
            return True
        start, end = self.stmt_lines(stmts, index, index)
        return start <= profiled[1] and profiled[0] <= end

    def refused_words(self, finder: ChainFinder) -> str:
        """Why steps next to the chain were left out of it ("" when none were)."""
        return "; ".join(dict.fromkeys(why for _, _, why in finder.refused))

    def _edit_for(
        self, finder: ChainFinder, stmts: Sequence[cst.BaseStatement], chain: Chain, indent: str
    ) -> BlockEdit | None:
        raise NotImplementedError
