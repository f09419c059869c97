"""Memory-bound regions: runs of elementwise / reduction / gather / cast ops inside one call of one function.

    from opadvisor.rules._regions import find_regions
    for site in find_regions(ix, owned):     # owned(op) -> True for ops another rule's pattern holds
        site.occurrences                       # [[Op, ...], ...]: the forward root ops of each run
        site.chain                             # "gelu_tanh" | "gelu_erf" | "silu" | "sigmoid_gate" |
                                               # "dropout" | "relpos_gather" | None (not recognised)

A *region* is a maximal run of forward root ops, in the order they ran on one thread, that belong to one
call of one function (told apart by the function's definition in the source, so two `forward`s of one
file are two functions) and do memory-bound work: no matrix product, convolution or attention kernel
inside (those end the run), and views (which launch nothing) neither join nor break it. Ops that another
rule's pattern holds end the run too: those rules own them. On a GPU profile an op does work when it
launches a kernel; on a CPU profile when it is not a view (a `.to()` / `.contiguous()` only when it
copied).

Runs of one site (the same function and lines, every layer and step) are grouped. `bytes_moved` estimates
what a single fused kernel must still read and write per run (see its docstring): with the device's
measured copy bandwidth that is the region's floor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opadvisor.profile.model import Op
from opadvisor.rules._chains import GEMM_OPS, PASS_THROUGH_OPS, dtype_of, names, norm_dtype, shape
from opadvisor.rules._index import ProfileIndex, module_related, owner_module
from opadvisor.rules._source import load_profiled_source, locate_each
from opadvisor.rules.patterns import (
    DROPOUT,
    GELU_ERF,
    GELU_TANH,
    REGION_CHAINS,
    RELPOS_GATHER,
    SIGMOID_GATE,
    SILU,
)

__all__ = [
    "Region",
    "Site",
    "bytes_moved",
    "chain_of",
    "find_regions",
    "is_compute",
    "merge_same_fix",
    "op_does_work",
]

# Matrix products and other compute-bound (or already fused) kernels: a region never holds one.
COMPUTE_OPS: frozenset[str] = GEMM_OPS | names(
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "cudnn_convolution",
    "einsum",
    "tensordot",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "lstm",
    "gru",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "rnn_tanh",
    "rnn_relu",
    "_cudnn_rnn",
)
# Ops that copy only sometimes (`x.to(x.dtype)`, `.contiguous()` of a contiguous tensor return x): on a
# CPU profile they count as work only when they ran a copy underneath.
COPY_IF_NEEDED: frozenset[str] = names("to", "contiguous", "type_as", "reshape", "_to_copy")
COPY_OPS: frozenset[str] = names("copy_", "clone", "_to_copy")
# Ops that launch nothing (a new view of the same memory, an allocation, a size query): the chains'
# pass-through ops, less those that copy.
VIEW_OPS: frozenset[str] = (PASS_THROUGH_OPS - COPY_IF_NEEDED - COPY_OPS) | names(
    "empty_strided", "new_empty", "is_nonzero", "dim"
)
RANDOM_OPS: frozenset[str] = names(
    "bernoulli", "bernoulli_", "rand", "rand_like", "uniform_", "randn_like", "normal_", "randint_like"
)
ITEMSIZE = {
    "float64": 8,
    "int64": 8,
    "float32": 4,
    "int32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass
class Region:
    """One run: the forward root ops that did memory-bound work, in order, in one call of `function`."""

    file: str
    function: str | None  # qualified name in the source ("MLP.forward"), else the profile's function name
    def_line: int | None  # line of the `def` (None when the source is not available)
    ops: list[Op] = field(default_factory=list)


@dataclass
class Site:
    """The runs of one region across layers and steps: one place in the source."""

    file: str
    function: str | None
    def_line: int | None
    line: int
    end_line: int
    occurrences: list[list[Op]] = field(default_factory=list)
    chain: str | None = None
    block: str | None = None  # a library block's site: the module path of its first instance


def op_does_work(ix: ProfileIndex, op: Op) -> bool:
    """Whether `op` ran real work: a kernel on a GPU profile; on a CPU profile, not a view (and a
    conditional copy only when it copied)."""
    if ix.gpu:
        return ix.kernel_count(op) > 0
    if op.name in VIEW_OPS:
        return False
    if op.name in COPY_IF_NEEDED:
        return any(d.name in COPY_OPS for d in ix.descendants(op))
    return "::" in op.name


def is_compute(op: Op) -> bool:
    """A matrix product / convolution / attention, an op outside aten (a fused kernel, a custom op), or an
    optimizer's multi-tensor update (fused_optimizer's business, and not a chain of one region)."""
    name = op.name
    return (
        name in COMPUTE_OPS
        or not name.startswith("aten::")
        or name.startswith(("aten::_foreach_", "aten::_fused_"))
    )


class _Identity:
    """Which function (by its definition in the source) each op's line belongs to; cached per file."""

    def __init__(self, ix: ProfileIndex) -> None:
        self.ix = ix
        self.sources: dict[str, object] = {}

    def source(self, path: str):
        if path not in self.sources:
            self.sources[path] = load_profiled_source(self.ix.profile, path)
        return self.sources[path]

    def of(self, op: Op) -> tuple[str, str | None, int | None] | None:
        if op.file is None:
            return None
        src = self.source(op.file)
        span = src.enclosing_function(op.line) if src is not None and op.line is not None else None
        if span is None:
            return op.file, op.function, None
        return op.file, span.qualname, span.line


def _runs(ix: ProfileIndex, owned: Callable[[Op], bool], ident: _Identity) -> list[Region]:
    """Every run of work ops in one function call, per (step, thread) sequence, in order."""
    out: list[Region] = []
    for ops in ix.sequences.values():
        current: Region | None = None
        key = None
        module = None
        for op in ops:
            if op.name in VIEW_OPS:
                continue
            me = ident.of(op)
            mod = owner_module(op)
            breaks = is_compute(op) or me is None or owned(op)
            if not breaks and op_does_work(ix, op):
                if current is None or me != key or not module_related(module, mod):
                    current = Region(me[0], me[1], me[2])
                    out.append(current)
                    key, module = me, mod
                current.ops.append(op)
            elif breaks:
                current, key, module = None, None, None
    return out


def find_regions(ix: ProfileIndex, owned: Callable[[Op], bool], min_ops: int = 2) -> list[Site]:
    """The sites of every run with at least `min_ops` work ops (forward), with their source lines."""
    ident = _Identity(ix)
    sites: dict[tuple, Site] = {}
    for region in _runs(ix, owned, ident):
        if len(region.ops) < min_ops:
            continue
        src = ident.source(region.file)
        spans = locate_each(src, region.ops) if src is not None else []
        spans = [s for s in spans if s is not None] or [
            (o.line, o.line) for o in region.ops if o.line is not None
        ]
        if not spans:
            continue
        line, end = min(s[0] for s in spans), max(s[1] for s in spans)
        key = (region.file, region.function, region.def_line, line, end)
        site = sites.get(key)
        if site is None:
            site = sites[key] = Site(region.file, region.function, region.def_line, line, end)
            site.chain = chain_of(region.ops)
        site.occurrences.append(region.ops)
    return list(sites.values())


# Chains whose fix rewrites the whole function's pattern at once (declared in rules/patterns.py).
WHOLE_FUNCTION_CHAINS = frozenset(c.name for c in REGION_CHAINS.values() if c.whole_function)


def merge_same_fix(sites: list[Site]) -> list[Site]:
    """Sites of one WHOLE_FUNCTION_CHAINS chain in one function become one site (lines and runs joined)."""
    out: list[Site] = []
    merged: dict[tuple, Site] = {}
    for site in sites:
        if site.chain not in WHOLE_FUNCTION_CHAINS:
            out.append(site)
            continue
        key = (site.file, site.function, site.def_line, site.chain)
        have = merged.get(key)
        if have is None:
            merged[key] = site
            out.append(site)
            continue
        have.line, have.end_line = min(have.line, site.line), max(have.end_line, site.end_line)
        if len(have.occurrences) == len(site.occurrences):
            have.occurrences = [a + b for a, b in zip(have.occurrences, site.occurrences, strict=True)]
        else:
            have.occurrences += site.occurrences
    return out


# ---- what the chain is -------------------------------------------------------------------------------------

_GELU_TANH = names("mul", "add", "pow", "tanh", "div", "mul_", "add_", "sub", "rsub")
_GELU_ERF = names("mul", "add", "div", "erf", "mul_", "add_", "sub", "rsub")
_DROPOUT_APPLY = names("masked_fill", "masked_fill_", "mul", "mul_", "div", "div_", "where")

# the recognised chains are declared in rules/patterns.py (the source rewrite reads the same table)
CHAIN_LABELS = {c.name: c.label for c in REGION_CHAINS.values()}


def chain_of(ops: Sequence[Op]) -> str | None:
    """The name of a recognised chain (see CHAIN_LABELS) from the ops' names and shapes, else None."""
    ns = [o.name for o in ops]
    present = set(ns)
    # one GELU: a single tanh (erf) among a handful of multiplies and adds (a cube: pow, or more multiplies)
    if ns.count("aten::tanh") == 1 and present <= _GELU_TANH and 5 <= len(ns) <= 10:
        return GELU_TANH
    if ns.count("aten::erf") == 1 and present <= _GELU_ERF and 3 <= len(ns) <= 7:
        return GELU_ERF
    if ns == ["aten::sigmoid", "aten::mul"] and shape(ops[0], 0) in (shape(ops[1], 0), shape(ops[1], 1)):
        return SILU
    if ns == ["aten::mul", "aten::sigmoid", "aten::mul"] and _scaled_by_scalar(ops[0]):
        return SIGMOID_GATE
    if present & RANDOM_OPS and present & _DROPOUT_APPLY:
        return DROPOUT
    if "aten::gather" in present and present & names("clamp", "clamp_", "clip"):
        return RELPOS_GATHER
    return None


def _scaled_by_scalar(op: Op) -> bool:
    s0, s1 = shape(op, 0), shape(op, 1)
    return (s0 == [] or s0 is None) != (s1 == [] or s1 is None)


# ---- the bytes a fused region must move ----------------------------------------------------------------------


def _itemsize(dtype: str | None) -> int:
    return ITEMSIZE.get(dtype or "", 4)


def _broadcast(shapes: Sequence[list[int]]) -> list[int]:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for k, n in enumerate(s, start=rank - len(s)):
            out[k] = max(out[k], n)
    return out


def _output(op: Op) -> tuple[list[int], str | None] | None:
    """(shape, dtype) of an op's output as far as its inputs tell: a gather has its index's shape, a
    comparison gives bool, everything else the broadcast of its tensor inputs in the first input's dtype."""
    tensors = [(s, dtype_of(op, i)) for i, s in enumerate(op.input_shapes) if isinstance(s, list)]
    if not tensors:
        return None
    if op.name == "aten::gather" and shape(op, 2) is not None:
        return shape(op, 2), dtype_of(op, 0)
    dtype = dtype_of(op, 0) or tensors[0][1]
    if op.name in names("eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or"):
        dtype = "bool"
    return _broadcast([s for s, _ in tensors]), norm_dtype(dtype)


def bytes_moved(ops: Sequence[Op]) -> tuple[int, int]:
    """(bytes read, bytes written) by one fused kernel doing what `ops` did in one run (forward).

    The profile records each op's input shapes, not which tensor is which, so this is an estimate: a
    tensor input counts as read from memory when no op of the run produced a tensor of its shape before
    (its own intermediates stay in registers); the last op's output is written. Tensors under 1/64 of the
    largest (biases, scalars, per-row statistics) are left out.
    """
    produced: set[tuple[int, ...]] = set()
    largest = max((math.prod(s) for o in ops for s in o.input_shapes if isinstance(s, list) and s), default=0)
    read = 0
    for op in ops:
        for i, s in enumerate(op.input_shapes):
            if not isinstance(s, list) or not s or math.prod(s) * 64 < largest:
                continue
            if tuple(s) in produced:
                continue
            read += math.prod(s) * _itemsize(dtype_of(op, i))
        out = _output(op)
        if out is not None:
            produced.add(tuple(out[0]))
    last = _output(ops[-1]) if ops else None
    written = math.prod(last[0]) * _itemsize(last[1]) if last is not None else 0
    return read, written
