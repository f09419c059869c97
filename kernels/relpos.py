"""`disentangled_bias`: DeBERTa's relative-position scores (two gathers, a transpose, two scalings, a sum)
in one kernel each way.

DeBERTa's disentangled attention adds to the content scores a content->position term (for query i and key
j, the score of query i against the relative-position embedding of bucket ci[i, j]) and a
position->content term (key j against the bucket of j - i):

    c2p = torch.gather(c2p_att, -1, ci.expand(...))                     # [N, Sq, Sk]
    p2c = torch.gather(p2c_att, -1, pi.expand(...)).transpose(-1, -2)   # [N, Sq, Sk]
    score = c2p / scale + p2c / scale

Eagerly that is a gather, a division and an add per term forward (each a pass over [N, Sq, Sk]), and
backward a zero fill and an atomic scatter-add into the 16-bit gradient per gather. The kernels read
the two [N, S, 2k] score tables and write the sum once; backward scatter-adds the gradient into float32
buffers once and casts them. `reference_disentangled_bias` is that chain in PyTorch: what runs on CPU
(without Triton's interpreter), for small CUDA tensors and the tests' oracle.

Under torch.compile (COMPILE_PATH): "backward_op" (the default) traces the chain forward, which inductor
fuses with the scores' sum and mask, and the backward kernel (`opadvisor::disentangled_bias_bwd`); "custom_op"
traces the custom ops `opadvisor::disentangled_bias_fwd` / `_bwd`, the kernels both ways; "native" traces the
chain both ways. Measured on an H200 (DeBERTa-v3-base, batch 8, sequence 512, patched, then
`cuda_graphed(torch.compile(...))`): "native" 38.0 ms a step, inductor's backward of the two gathers alone
12.8 ms (a scatter-add with 16-bit atomics; the kernel: 4.2); "custom_op" 31.2 ms; "backward_op" 30.4 ms.
"""

from __future__ import annotations

import functools

import torch

from . import _backend, _dispatch
from . import _layout as layout
from ._launch import Launcher
from .softmax import triton_next_power_of_2

# Query rows per program and keys per tile (ROWS x BLOCK elements per step of a program's loop).
ROWS = 4
BLOCK = 512
# CUDA score tables with fewer elements run the PyTorch chain: not measured for this kernel; the value
# masked_softmax measured for the same autograd.Function host cost.
SMALL_NUMEL = 1 << 22
OP = "disentangled_bias"  # its name in the dispatch record and in warnings
COMPILE_PATHS = ("custom_op", "backward_op", "native")
COMPILE_PATH = "backward_op"  # under torch.compile; see the module doc
# The backward's scatter-adds: "atomic" (float32 atomics from each tile of queries, measured 4.2 ms at
# DeBERTa-v3-base's training size) or "runs" (a segmented sum per row, each index's sum stored once where the
# row's indices are monotone, as DeBERTa's are; atomics for a row that is not; see _relpos_triton). "runs"
# takes rows of at most RUNS_MAX keys (queries). Measured on an H200 (benchmarks/regions_kernels.py, the
# [96, 512, 512] bf16 scores forward and backward): "runs" 0.794 ms, "atomic" 0.626; so "atomic" stays.
BACKWARD = "atomic"
BACKWARDS = ("atomic", "runs")
RUNS_MAX = 2048
RUNS_COLS = 8  # keys per program of the p2c kernel (a column tile of [Sq, RUNS_COLS], 8 warps)


def disentangled_bias_backend(table: torch.Tensor) -> str:
    """Which implementation `disentangled_bias` runs for a score table (c2p or p2c): "triton",
    "interpreter", "eager" (the PyTorch chain, small CUDA tensors) or "reference"."""
    return _backend.for_tensor(table, SMALL_NUMEL)


def _index_2d(index: torch.Tensor, rows: int, cols: int, name: str) -> torch.Tensor:
    """`index` as [rows, cols]: leading dimensions of size 1 dropped (DeBERTa keeps a [1, S, S] tensor)."""
    if index.dim() < 2 or tuple(index.shape[-2:]) != (rows, cols) or any(d != 1 for d in index.shape[:-2]):
        raise ValueError(
            f"{name} must have shape [{rows}, {cols}] (leading 1s allowed), got {tuple(index.shape)}"
        )
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an int64 or int32 tensor, got {index.dtype}")
    return index.reshape(rows, cols)


def _check(c2p, p2c, c2p_index, p2c_index):
    """(N, Sq, Sk, 2-D c2p index or None, 2-D p2c index or None) after checking shapes."""
    if c2p is None and p2c is None:
        raise ValueError("disentangled_bias needs c2p, p2c or both")
    if (c2p is None) != (c2p_index is None) or (p2c is None) != (p2c_index is None):
        raise ValueError("each score table needs its index (c2p with c2p_index, p2c with p2c_index)")
    for t, name in ((c2p, "c2p"), (p2c, "p2c")):
        if t is not None and t.dim() != 3:
            raise ValueError(f"{name} must be [batch*heads, positions, buckets], got {tuple(t.shape)}")
    if c2p is not None:
        n, sq = c2p.shape[0], c2p.shape[1]
        sk = p2c.shape[1] if p2c is not None else c2p_index.shape[-1]
    else:
        n, sk = p2c.shape[0], p2c.shape[1]
        sq = p2c_index.shape[-1]
    if p2c is not None and (p2c.shape[0] != n or p2c.shape[1] != sk):
        raise ValueError(f"p2c {tuple(p2c.shape)} does not match c2p {tuple(c2p.shape)}")
    ci = None if c2p is None else _index_2d(c2p_index, sq, sk, "c2p_index")
    pi = None if p2c is None else _index_2d(p2c_index, sk, sq, "p2c_index")
    return n, sq, sk, ci, pi


def reference_disentangled_bias(
    c2p: torch.Tensor | None,
    p2c: torch.Tensor | None,
    c2p_index: torch.Tensor | None,
    p2c_index: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``gather(c2p, -1, ci) / scale + gather(p2c, -1, pi).transpose(-1, -2) / scale`` as PyTorch ops."""
    n, sq, sk, ci, pi = _check(c2p, p2c, c2p_index, p2c_index)
    out = None
    if c2p is not None:
        out = torch.gather(c2p, -1, ci.expand(n, sq, sk)) / scale
    if p2c is not None:
        term = torch.gather(p2c, -1, pi.expand(n, sk, sq)).transpose(-1, -2) / scale
        out = term if out is None else out + term
    return out


@functools.cache
def _launchers() -> tuple[Launcher, Launcher]:
    from . import _relpos_triton as k

    return Launcher(k.disentangled_bias_fwd_kernel), Launcher(k.disentangled_bias_bwd_kernel)


@functools.cache
def _runs_launcher() -> Launcher:
    from . import _relpos_triton as k

    return Launcher(k.bwd_runs_kernel)


def _strides(t: torch.Tensor | None, fallback: torch.Tensor, k: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else tuple(fallback.stride()[:k])


def _i64(n, sq, sk, tables) -> bool:
    return layout.needs_int64((n, sq, sk), [(sq * sk, sk, 1)]) or any(
        t is not None and layout.needs_int64(tuple(t.shape), [tuple(t.stride())]) for t in tables
    )


def _out_dtype(c2p, p2c) -> torch.dtype:
    if c2p is None or p2c is None:
        return (c2p if c2p is not None else p2c).dtype
    return torch.promote_types(c2p.dtype, p2c.dtype)


def _forward(c2p, p2c, ci, pi, scale, n, sq, sk) -> torch.Tensor:
    first = c2p if c2p is not None else p2c
    out = torch.empty((n, sq, sk), dtype=_out_dtype(c2p, p2c), device=first.device)
    if out.numel() == 0:
        return out
    _backend.check_launch(first)
    grid = (n, (sq + ROWS - 1) // ROWS)
    _launchers()[0](
        grid,
        (
            first if c2p is None else c2p, first if p2c is None else p2c,
            ci if ci is not None else pi, pi if pi is not None else ci, out, sq, sk,
            *_strides(c2p, first, 3), *_strides(p2c, first, 3),
            *_strides(ci, pi, 2), *_strides(pi, ci, 2), 1.0 / scale,
        ),
        {"HAS_C2P": c2p is not None, "HAS_P2C": p2c is not None, "ROWS": ROWS, "BLOCK": BLOCK,
         "RNE": _backend.emulate_rne(out), "I64": _i64(n, sq, sk, (c2p, p2c)), "num_warps": 4},
    )  # fmt: skip
    return out


def _backward(g, ci, pi, shapes, scale, n, sq, sk):
    """(dc2p, dp2c) in float32 (None for an absent table): scatter-adds of g / scale."""
    (p1, p2) = shapes
    dc2p = torch.zeros((n, sq, p1), dtype=torch.float32, device=g.device) if ci is not None else None
    dp2c = torch.zeros((n, sk, p2), dtype=torch.float32, device=g.device) if pi is not None else None
    if g.numel() == 0:
        return dc2p, dp2c
    if BACKWARD == "runs" and max(sq, sk) <= RUNS_MAX:
        _backward_runs(g, ci, pi, dc2p, dp2c, scale, n, sq, sk)
        return dc2p, dp2c
    grid = (n, (sq + ROWS - 1) // ROWS)
    placeholder = dc2p if dc2p is not None else dp2c
    _launchers()[1](
        grid,
        (
            g, ci if ci is not None else pi, pi if pi is not None else ci,
            placeholder if dc2p is None else dc2p, placeholder if dp2c is None else dp2c,
            sq, sk, max(p1, 1), max(p2, 1), *g.stride(),
            *_strides(ci, pi, 2), *_strides(pi, ci, 2), 1.0 / scale,
        ),
        {"HAS_C2P": ci is not None, "HAS_P2C": pi is not None, "ROWS": ROWS, "BLOCK": BLOCK,
         "I64": _i64(n, sq, sk, (g, dc2p, dp2c)), "num_warps": 4},
    )  # fmt: skip
    return dc2p, dp2c


def _backward_runs(g, ci, pi, dc2p, dp2c, scale, n, sq, sk) -> None:
    """`_backward` as segmented sums per row (BACKWARD "runs"): one launch per table, each summing along its
    own axis (the keys of a query for c2p, the queries of a key for p2c) with the whole axis in one tile."""
    runs = _runs_launcher()
    i64 = _i64(n, sq, sk, (g, dc2p, dp2c))
    sg0, sg1, sg2 = g.stride()
    if dc2p is not None:  # rows: queries i, summed over keys j
        runs(
            (n, (sq + ROWS - 1) // ROWS),
            (g, ci, dc2p, sq, sk, dc2p.shape[2], sg0, sg1, sg2, *ci.stride(), 1.0 / scale),
            {"OUTER": ROWS, "BLOCK": triton_next_power_of_2(sk), "I64": i64, "num_warps": 4},
        )
    if dp2c is not None:  # rows: keys j, summed over queries i
        runs(
            (n, (sk + RUNS_COLS - 1) // RUNS_COLS),
            (g, pi, dp2c, sk, sq, dp2c.shape[2], sg0, sg2, sg1, *pi.stride(), 1.0 / scale),
            {"OUTER": RUNS_COLS, "BLOCK": triton_next_power_of_2(sq), "I64": i64, "num_warps": 8},
        )


def _sizes(c2p, p2c, ci, pi) -> tuple[int, int, int]:
    """(N, Sq, Sk) of checked tables and 2-D indices."""
    if c2p is not None:
        return c2p.shape[0], c2p.shape[1], ci.shape[1]
    return p2c.shape[0], pi.shape[1], p2c.shape[1]


def _absent(g: torch.Tensor) -> torch.Tensor:
    """The custom op's stand-in for the gradient of an absent table (ops cannot return None)."""
    return g.new_empty((0,))


@torch.library.custom_op("opadvisor::disentangled_bias_fwd", mutates_args=())
def disentangled_bias_fwd_op(
    c2p: torch.Tensor | None, p2c: torch.Tensor | None, ci: torch.Tensor | None, pi: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """The forward kernel on checked tables and 2-D indices."""
    n, sq, sk = _sizes(c2p, p2c, ci, pi)
    return _forward(c2p, p2c, ci, pi, scale, n, sq, sk)


@disentangled_bias_fwd_op.register_fake
def _(c2p, p2c, ci, pi, scale):
    first = c2p if c2p is not None else p2c
    return first.new_empty(_sizes(c2p, p2c, ci, pi), dtype=_out_dtype(c2p, p2c))


def _table_grads(g, ci, pi, p1, p2, scale, c2p_dtype, p2c_dtype):
    """(dc2p, dp2c) in the tables' dtypes (None for an absent table): `_backward`, cast once."""
    n, sq, sk = g.shape
    dc2p, dp2c = _backward(g, ci, pi, (p1, p2), scale, n, sq, sk)
    return (
        dc2p.to(c2p_dtype) if dc2p is not None else None,
        dp2c.to(p2c_dtype) if dp2c is not None else None,
    )


@torch.library.custom_op("opadvisor::disentangled_bias_bwd", mutates_args=())
def disentangled_bias_bwd_op(
    g: torch.Tensor, ci: torch.Tensor | None, pi: torch.Tensor | None, p1: int, p2: int, scale: float,
    c2p_dtype: torch.dtype, p2c_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`_table_grads`, an empty tensor for an absent table."""
    dc2p, dp2c = _table_grads(g, ci, pi, p1, p2, scale, c2p_dtype, p2c_dtype)
    return (dc2p if dc2p is not None else _absent(g), dp2c if dp2c is not None else _absent(g))


@disentangled_bias_bwd_op.register_fake
def _(g, ci, pi, p1, p2, scale, c2p_dtype, p2c_dtype):
    n, sq, sk = g.shape
    dc2p = g.new_empty((n, sq, p1), dtype=c2p_dtype) if ci is not None else _absent(g)
    dp2c = g.new_empty((n, sk, p2), dtype=p2c_dtype) if pi is not None else _absent(g)
    return dc2p, dp2c


def _save(ctx, c2p, p2c, ci, pi, scale, out_dtype) -> None:
    """Keep what the backward needs (`_table_grads`' arguments after g): the indices, the bucket counts, the
    scale and the tables' dtypes (0 buckets and `out_dtype` for an absent table)."""
    ctx.save_for_backward(ci, pi)
    ctx.meta = (
        c2p.shape[-1] if c2p is not None else 0,
        p2c.shape[-1] if p2c is not None else 0,
        float(scale),
        c2p.dtype if c2p is not None else out_dtype,
        p2c.dtype if p2c is not None else out_dtype,
    )
    ctx.has = (c2p is not None, p2c is not None)


def _grads_of(ctx, g, table_grads=disentangled_bias_bwd_op):
    """(dc2p, dp2c) as autograd wants them (None where not wanted) from `table_grads`: the custom op where
    torch.compile traced the call, `_table_grads` itself in the eager Function (less host time per call)."""
    ci, pi = ctx.saved_tensors
    dc2p, dp2c = table_grads(g, ci, pi, *ctx.meta)
    return (
        dc2p if ctx.has[0] and ctx.needs_input_grad[0] else None,
        dp2c if ctx.has[1] and ctx.needs_input_grad[1] else None,
    )


def _op_setup(ctx, inputs, output):
    _save(ctx, *inputs, output.dtype)


def _op_backward(ctx, g):
    return (*_grads_of(ctx, g), None, None, None)


torch.library.register_autograd(disentangled_bias_fwd_op, _op_backward, setup_context=_op_setup)


class DisentangledBiasFunction(torch.autograd.Function):
    """The eager path: both kernels."""

    @staticmethod
    def forward(ctx, c2p, p2c, ci, pi, scale, n, sq, sk):
        out = _forward(c2p, p2c, ci, pi, scale, n, sq, sk)
        _save(ctx, c2p, p2c, ci, pi, scale, out.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        return (*_grads_of(ctx, g, _table_grads), None, None, None, None, None, None)


class ChainForwardKernelBackward(torch.autograd.Function):
    """COMPILE_PATH "backward_op": the chain forward, which dynamo traces and inductor fuses with the
    scores around it, and the backward op."""

    @staticmethod
    def forward(ctx, c2p, p2c, ci, pi, scale):
        _save(ctx, c2p, p2c, ci, pi, scale, _out_dtype(c2p, p2c))
        return reference_disentangled_bias(c2p, p2c, ci, pi, scale)

    @staticmethod
    def backward(ctx, g):
        return (*_grads_of(ctx, g), None, None, None)


def disentangled_bias(
    c2p: torch.Tensor | None,
    p2c: torch.Tensor | None,
    c2p_index: torch.Tensor | None,
    p2c_index: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """DeBERTa's relative-position attention bias in one pass (see the module doc).

    Args:
        c2p: content->position scores [N, Sq, P] (query i against every relative-position bucket), or None.
        p2c: position->content scores [N, Sk, P] (key j against every bucket), or None.
        c2p_index: the bucket of each (query i, key j) pair, [Sq, Sk] (leading 1s allowed), int64/int32.
        p2c_index: the bucket of each (key j, query i) pair, [Sk, Sq].
        scale: both terms are divided by it (a Python number).

    Returns [N, Sq, Sk]: ``c2p[n, i, ci[i, j]] / scale + p2c[n, j, pi[j, i]] / scale``, in the tables'
    dtype. Gradients flow to c2p and p2c (accumulated in float32 on the GPU).
    """
    n, sq, sk, ci, pi = _check(c2p, p2c, c2p_index, p2c_index)
    table = c2p if c2p is not None else p2c
    backend = disentangled_bias_backend(table) if n * sq * sk > 0 else _backend.REFERENCE
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _backend.fallback_reason(table) if n * sq * sk > 0 else None)
        return reference_disentangled_bias(c2p, p2c, c2p_index, p2c_index, scale)
    compiling = torch.compiler.is_compiling()
    if backend == _backend.EAGER or (compiling and COMPILE_PATH == "native"):
        _dispatch.record(OP, _dispatch.CHAIN)
        return reference_disentangled_bias(c2p, p2c, c2p_index, p2c_index, scale)
    _dispatch.record(OP, _dispatch.KERNEL)
    if compiling and COMPILE_PATH == "backward_op":
        return ChainForwardKernelBackward.apply(c2p, p2c, ci, pi, float(scale))
    if compiling:
        return disentangled_bias_fwd_op(c2p, p2c, ci, pi, float(scale))
    return DisentangledBiasFunction.apply(c2p, p2c, ci, pi, float(scale), n, sq, sk)
