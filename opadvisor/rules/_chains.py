"""The chain matcher: find sequences of ops, in the order they ran, inside one user function.

A *chain* is a list of `Link`s. Each link accepts ops by name (`names`) and by an optional predicate on
the op and the ops already bound (`test`: shapes, dtypes, scalar arguments); a link can be `optional`.
Between two bound ops only *pass-through* ops may run (`Chain.skip`: views, reshapes, casts, mask
preparation ...), at most `Chain.max_between` of them, from any function. Matching runs over each
thread's forward root ops in the order they ran (`ProfileIndex.sequences`), and every bound op must
belong to the same frame (one call of one user function, see _index.py): a chain never spans two
functions, and an op of another function that does real work between two links breaks the chain.

    from opadvisor.rules._chains import Chain, Link, find_chains, dims, numel

    SOFTMAX = Chain((
        Link("scale", frozenset({"aten::div", "aten::mul"}), optional=True, test=is_scalar_scale),
        Link("mask", frozenset({"aten::masked_fill"})),
        Link("softmax", frozenset({"aten::softmax"}),
             test=lambda op, b: same_shape(op, b["mask"])),
    ))
    for m in find_chains(index_of(profile), SOFTMAX):
        m.ops["softmax"]            # the bound op of a link (labels of unbound optional links are absent)
        m.order                     # bound ops in the order they ran
        m.lines()                   # (first line, last line) over the bound ops

Semantics: matches are searched left to right, start at the earliest op that can bind any leading link
(a leading optional link that cannot bind is skipped), prefer binding an optional link over skipping it,
and never overlap (the search resumes after the last op of a match). A chain's `swaps` name pairs of
adjacent links that may also run in the other order: each order is tried at a start, and the one binding
the most links wins (the declared order on a tie). Work is linear in the number of ops
for the chains rules use (a bounded look-ahead per start position).

The shape/dtype helpers below read the profile's `input_shapes` / `input_dtypes` / `scalars` lists and
return None (never raise) when the profile does not have the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opadvisor.profile.model import Op
from opadvisor.rules._index import Frame, ProfileIndex
from opadvisor.rules.patterns import Pattern

__all__ = [
    "Chain",
    "GEMM_OPS",
    "ChainMatch",
    "Link",
    "MASK_PREP_OPS",
    "PASS_THROUGH_OPS",
    "broadcastable",
    "declared_chain",
    "dims",
    "dtype_of",
    "find_chains",
    "in_dtype",
    "is_16bit",
    "matmul_mnk",
    "names",
    "norm_dtype",
    "numel",
    "out_shape",
    "scalar",
    "scalar_float",
    "shape",
]

Test = Callable[[Op, dict[str, Op]], bool]


def names(*ops: str) -> frozenset[str]:
    """`names("masked_fill", "masked_fill_")` -> frozenset({"aten::masked_fill", "aten::masked_fill_"})."""
    return frozenset(o if "::" in o else f"aten::{o}" for o in ops)


# Ops that do not change values (views, reshapes), or only move/cast them, that may run between two links.
PASS_THROUGH_OPS: frozenset[str] = names(
    "view",
    "reshape",
    "_unsafe_view",
    "_reshape_alias",
    "transpose",
    "permute",
    "t",
    "expand",
    "expand_as",
    "unsqueeze",
    "squeeze",
    "flatten",
    "unflatten",
    "slice",
    "select",
    "narrow",
    "as_strided",
    "contiguous",
    "clone",
    "detach",
    "alias",
    "lift_fresh",
    "to",
    "_to_copy",
    "type_as",
    "size",
    "stride",
    "numel",
    "split",
    "chunk",
    "unbind",
    "view_as",
    "resolve_conj",
    "resolve_neg",
    "empty",
    "empty_like",
)
# Matrix products as the profile names them (root ops such as aten::linear / aten::matmul, and the
# aten::mm / addmm / bmm they dispatch to, which backward nodes run directly).
GEMM_OPS: frozenset[str] = names(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "mv",
    "addmv",
    "_scaled_mm",
)
# Ops that usually build a mask from another tensor (`mask == 0`, `~mask`, `mask.bool()`).
MASK_PREP_OPS: frozenset[str] = names(
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_not",
    "bitwise_not",
    "__invert__",
    "__and__",
    "__or__",
    "logical_and",
    "logical_or",
    "bitwise_and",
    "bitwise_or",
    "tril",
    "triu",
    "ones",
    "ones_like",
    "zeros",
    "zeros_like",
    "full",
    "full_like",
    "arange",
    "where",
    "rsub",
    "scalar_tensor",
    "tensor",
)


def _default_skip(op: Op) -> bool:
    return op.name in PASS_THROUGH_OPS


@dataclass(frozen=True)
class Link:
    """One element of a chain: an op named one of `names`, for which `test(op, bound)` holds."""

    label: str
    names: frozenset[str]
    optional: bool = False
    test: Test | None = None

    def accepts(self, op: Op, bound: dict[str, Op]) -> bool:
        if op.name not in self.names:
            return False
        if self.test is None:
            return True
        try:
            return bool(self.test(op, bound))
        except (IndexError, KeyError, TypeError, ValueError):  # a missing shape/scalar: no match
            return False


@dataclass(frozen=True)
class Chain:
    links: tuple[Link, ...]
    skip: Callable[[Op], bool] = _default_skip  # may run between two bound ops
    max_between: int = 8
    swaps: tuple[frozenset[str], ...] = ()  # pairs of adjacent links (by label) that may run either way

    def orders(self) -> list[tuple[Link, ...]]:
        """The link orders to try: the declared one, then each with one `swaps` pair swapped."""
        out = [self.links]
        labels = [link.label for link in self.links]
        for pair in self.swaps:
            i, j = sorted(labels.index(label) for label in pair)
            order = list(self.links)
            order[i], order[j] = order[j], order[i]
            out.append(tuple(order))
        return out


StepOps = dict[str, tuple[frozenset[str], Test]]  # a declared step -> (the ops it runs as, their test)


def declared_chain(pattern: Pattern, step_ops: StepOps, **options: Any) -> Chain:
    """The chain of a declared pattern (`rules/patterns.py`: its steps, order, optional ones and swaps),
    each step binding the ops `step_ops` names for it; `options`: Chain's skip and max_between."""
    links = tuple(
        Link(s.name, step_ops[s.name][0], optional=s.optional, test=step_ops[s.name][1])
        for s in pattern.steps
    )
    return Chain(links, swaps=pattern.swaps, **options)


@dataclass
class ChainMatch:
    frame: Frame
    ops: dict[str, Op]  # label -> bound op
    order: list[Op]  # bound ops in the order they ran
    span: list[Op] = field(default_factory=list)  # every op that ran from the first to the last bound op

    @property
    def first(self) -> Op:
        return self.order[0]

    @property
    def last(self) -> Op:
        return self.order[-1]

    def has(self, label: str) -> bool:
        return label in self.ops

    def ran(self, labels: Sequence[str]) -> list[str]:
        """The bound labels among `labels`, in the order their ops ran (a chain's swaps may reorder them)."""
        label_of = {id(op): label for label, op in self.ops.items()}
        return [label_of[id(op)] for op in self.order if label_of.get(id(op)) in labels]

    def lines(self) -> tuple[int, int]:
        """(first, last) 1-based line over the bound ops that carry a line."""
        ls = [o.line for o in self.order if o.line is not None]
        return (min(ls), max(ls)) if ls else (0, 0)


def _match_at(
    ops: Sequence[Op],
    start: int,
    links: Sequence[Link],
    li: int,
    bound: dict[str, Op],
    chain: Chain,
    frame: Frame | None,
    frame_of: dict[int, Frame],
) -> list[int] | None:
    """Bind links[li:] to ops from `start` on (ops of `frame` only); the positions bound, or None.

    `frame` None means the first link: it must bind at `start` itself and fixes the frame.
    """
    if li == len(links):
        return []
    link = links[li]
    anchored = frame is None
    j = start
    limit = start if anchored else start + chain.max_between
    while j < len(ops) and j <= limit:
        op = ops[j]
        op_frame = frame_of.get(op.id)
        if (anchored and op_frame is not None) or (op_frame is frame and frame is not None):
            if link.accepts(op, bound):
                bound[link.label] = op
                rest = _match_at(ops, j + 1, links, li + 1, bound, chain, op_frame, frame_of)
                if rest is not None:
                    return [j, *rest]
                del bound[link.label]
        if anchored or not chain.skip(op):
            break
        j += 1
    if link.optional:
        return _match_at(ops, start, links, li + 1, bound, chain, frame, frame_of)
    return None


def _leading_names(links: Sequence[Link]) -> frozenset[str]:
    """Names any leading link could bind: a cheap pre-filter per start position."""
    out: frozenset[str] = frozenset()
    for link in links:
        out |= link.names
        if not link.optional:
            break
    return out


def _best_at(
    ops: Sequence[Op], i: int, chain: Chain, orders: list[tuple[Link, ...]], frame_of: dict[int, Frame]
) -> tuple[list[int], dict[str, Op]] | None:
    """The match starting at ops[i] that binds the most links over the chain's orders (the declared order
    on a tie), as (positions, bound), or None."""
    best: tuple[list[int], dict[str, Op]] | None = None
    for links in orders:
        bound: dict[str, Op] = {}
        pos = _match_at(ops, i, links, 0, bound, chain, None, frame_of)
        if pos is not None and (best is None or len(pos) > len(best[0])):
            best = (pos, bound)
    return best


def match_sequence(ops: Sequence[Op], chain: Chain, frame_of: dict[int, Frame]) -> list[ChainMatch]:
    """Every non-overlapping match of `chain` in one thread's forward root ops, left to right."""
    out: list[ChainMatch] = []
    orders = chain.orders()
    first_names = frozenset().union(*(_leading_names(links) for links in orders))
    i = 0
    while i < len(ops):
        if ops[i].name not in first_names or ops[i].id not in frame_of:
            i += 1
            continue
        best = _best_at(ops, i, chain, orders, frame_of)
        if best is None:
            i += 1
            continue
        pos, bound = best
        order = [ops[p] for p in pos]
        out.append(ChainMatch(frame_of[order[0].id], dict(bound), order, list(ops[pos[0] : pos[-1] + 1])))
        i = pos[-1] + 1
    return out


def find_chains(index: ProfileIndex, chain: Chain, frames: Iterable[Frame] | None = None) -> list[ChainMatch]:
    """Every match of `chain` in the profile (only in `frames` when given), in the order they ran per thread."""
    keep = None if frames is None else {id(f) for f in frames}
    out: list[ChainMatch] = []
    for ops in index.sequences.values():
        for m in match_sequence(ops, chain, index.frame_of):
            if keep is None or id(m.frame) in keep:
                out.append(m)
    return out


# ---- shapes, dtypes and scalars of an op's inputs --------------------------------------------------

_DTYPES = {
    "float": "float32",
    "float32": "float32",
    "torch.float32": "float32",
    "double": "float64",
    "float64": "float64",
    "c10::half": "float16",
    "half": "float16",
    "float16": "float16",
    "torch.float16": "float16",
    "c10::bfloat16": "bfloat16",
    "bfloat16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "bool": "bool",
    "long int": "int64",
    "long": "int64",
    "int64": "int64",
    "int": "int32",
    "int32": "int32",
    "unsigned char": "uint8",
    "uint8": "uint8",
    "signed char": "int8",
    "int8": "int8",
    "short int": "int16",
    "int16": "int16",
    "c10::float8_e4m3fn": "float8_e4m3fn",
    "c10::float8_e5m2": "float8_e5m2",
}


def norm_dtype(name: str | None) -> str | None:
    """Profiler dtype names ("float", "c10::BFloat16", "long int") -> torch names ("float32", "bfloat16")."""
    if name is None or name == "":
        return None
    return _DTYPES.get(name.lower(), name)


def shape(op: Op, i: int) -> list[int] | None:
    """Shape of input i (a list of ints; [] for a 0-dim tensor), None when not a tensor or not recorded."""
    if i >= len(op.input_shapes):
        return None
    s = op.input_shapes[i]
    return list(s) if isinstance(s, list) else None


def dtype_of(op: Op, i: int) -> str | None:
    """Normalised dtype of input i, None when unknown."""
    return norm_dtype(op.input_dtypes[i]) if i < len(op.input_dtypes) else None


def in_dtype(op: Op) -> str | None:
    """The dtype of the op's first tensor input with a known dtype."""
    for i in range(len(op.input_dtypes)):
        d = dtype_of(op, i)
        if d is not None and d != "Scalar" and (i >= len(op.input_shapes) or op.input_shapes[i] is not None):
            return d
    return None


def is_16bit(dtype: str | None) -> bool:
    return dtype in ("float16", "bfloat16")


def scalar(op: Op, i: int) -> Any:
    """The recorded value of non-tensor input i (fill value, dim, p ...), None when not recorded."""
    return op.scalars[i] if i < len(op.scalars) else None


def scalar_float(op: Op, i: int) -> float | None:
    """Input i as a float: numbers, bools, and strings such as "-inf" / "-Infinity"; None otherwise."""
    v = scalar(op, i)
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.replace("Infinity", "inf"))
        except ValueError:
            return None
    return None


def numel(s: Sequence[int] | None) -> int | None:
    return None if s is None else math.prod(s)


def broadcastable(small: Sequence[int] | None, big: Sequence[int] | None) -> bool:
    """True when `small` broadcasts to exactly `big` (numpy rules, `big` unchanged)."""
    if small is None or big is None or len(small) > len(big):
        return False
    return all(a in (1, b) for a, b in zip(reversed(small), reversed(big), strict=False))


def matmul_mnk(op: Op) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of a matrix-product op from its input shapes, None when they are not known.

    Handles aten::mm, addmm (bias, a, b), bmm, baddbmm (c, a, b), matmul (any rank, 1-D operands),
    linear (x [..., K], weight [N, K]) and addmv/mv. `batch` is the product of the batch dimensions.
    """
    n = op.name
    try:
        if n in ("aten::mm", "aten::bmm", "aten::matmul"):
            a, b = shape(op, 0), shape(op, 1)
        elif n in ("aten::addmm", "aten::baddbmm", "aten::addbmm"):
            a, b = shape(op, 1), shape(op, 2)
        elif n == "aten::linear":
            x, w = shape(op, 0), shape(op, 1)
            if x is None or w is None or len(w) != 2 or not x:
                return None
            return 1, math.prod(x[:-1]), w[0], x[-1]
        else:
            return None
        if a is None or b is None or not a or not b:
            return None
        if len(a) == 1:
            a = [1, a[0]]
        if len(b) == 1:
            b = [b[0], 1]
        if len(b) == 2 and len(a) > 2:  # [..., M, K] @ [K, N] runs as one GEMM over the folded rows
            a = [math.prod(a[:-1]), a[-1]]
        m, k = a[-2], a[-1]
        nn = b[-1]
        batch_a, batch_b = a[:-2], b[:-2]
        batch = max(math.prod(batch_a), math.prod(batch_b)) if (batch_a or batch_b) else 1
        return batch, m, nn, k
    except (TypeError, IndexError):
        return None


def out_shape(op: Op) -> list[int] | None:
    """Output shape of a matrix product (matmul/bmm/mm/linear ...) from its inputs; None when unknown.

    For elementwise and softmax-like ops the output has the shape of input 0: use `shape(op, 0)`.
    """
    n = op.name
    if n == "aten::linear":
        x, w = shape(op, 0), shape(op, 1)
        return None if x is None or w is None or len(w) != 2 else [*x[:-1], w[0]]
    if n in ("aten::mm", "aten::bmm", "aten::matmul"):
        a, b = shape(op, 0), shape(op, 1)
    elif n in ("aten::addmm", "aten::baddbmm"):
        a, b = shape(op, 1), shape(op, 2)
    else:
        return None
    if a is None or b is None or not a or not b:
        return None
    if len(a) == 1 and len(b) == 1:
        return []
    if len(a) == 1:
        return [*b[:-2], b[-1]]
    if len(b) == 1:
        return a[:-1]
    batch_a, batch_b = a[:-2], b[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a = [1] * (width - len(batch_a)) + batch_a
    batch_b = [1] * (width - len(batch_b)) + batch_b
    batch = [max(x, y) for x, y in zip(batch_a, batch_b, strict=True)]
    return [*batch, a[-2], b[-1]]


def dims(op: Op) -> int | None:
    """Rank of input 0, None when unknown."""
    s = shape(op, 0)
    return None if s is None else len(s)
