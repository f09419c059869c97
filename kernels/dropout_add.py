"""`bias_dropout_add`: ``residual + dropout(x + bias)`` in one kernel, forward and backward.

Layers: `_dropout_add_triton` kernels -> `_forward` / `_backward_kernel` (launchers, through
`_launch.Launcher`) -> `BiasDropoutAddFunction` (eager autograd) and the custom ops
`opadvisor::bias_dropout_add_fwd` / `_bwd` (torch.compile with COMPILE_PATH "custom_op") ->
`bias_dropout_add`, which runs `eager_bias_dropout_add` (the plain chain) for small CUDA tensors and, by
default, under torch.compile. `reference_bias_dropout_add` is the PyTorch version and the oracle.

Backward saves no mask: the keep mask is recomputed from the seed (Philox, see `_rng`), so the only state
kept between forward and backward is three integers. `MASK_MODE = "byte"` / `"bits"` instead store a
1-byte / 1-bit mask in the forward (compared on the GPU in benchmarks/kernels.py and bda_sweep.py; see
RESULTS.md for the choice). The backward's launch is `BACKWARD_CONFIGS`' for the rows' width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _backend, _dispatch, _rng
from . import _layout as layout
from ._launch import Launch, Launcher
from .softmax import triton_cdiv, triton_next_power_of_2

# The forward's elements per program (a tile of ROWS x BLOCK; 2048 measured best of 2048/4096/8192 on an
# H200; the backward's launch is BACKWARD_CONFIGS), how the backward gets the keep mask ("philox":
# recomputed, measured faster than reading a 1-byte mask; "bits", one bit an element stored by the forward:
# the backward alone measured 0.085 ms against philox's 0.092 at [16384, 4096], but the forward's packing
# made it 2.8x slower, fwd+bwd 0.370 vs 0.194 ms, ninth session), and the forward's Philox layout (see
# softmax.RNG_INTERLEAVE; one call per element measured 5% faster here).
TILE = 2048
MASK_MODE = "philox"  # or "byte", "bits"
RNG_INTERLEAVE = False
# The forward draws its mask with `keep_rows_cols` (Philox's first rounds per row and per column, not per
# element; the same bits as `keep_mask`) where rows fit in int32: measured (tenth session, H200, GPU time)
# 0.0111 against 0.0124 ms at [8192, 768], 0.0251 against 0.0267 at [16384, 1024], the same at [8192, 4096];
# at [16384, 4096] within the runs' spread (0.0972 / 0.1018 in one, 0.0977 / 0.0966 in the other).
SPLIT_RNG = True
# On CUDA, tensors with fewer elements run the eager chain the user wrote (`residual + dropout(x + bias)`, in
# the inputs' dtype). The kernel saves about 5 us of GPU time per million elements (fwd+bwd, H200), and its
# call costs 0.1-0.2 ms more host time than the chain's (a Python autograd.Function, whose backward also
# hops to the autograd thread): in a step bound by its host (BERT-base, [8192, 768] x 24 calls) the kernel
# made the step slower (37.8 vs 30.0 ms), so at first only tensors from 2^25 elements, where the GPU saving covers
# that host cost, take it. Re-measured after the host cost was cut (sixth session, fwd+bwd from Python at
# [T, 768], kernel / chain): 0.210 / 0.162 ms at 16.8M elements, 0.217 / 0.286 at 33.5M; on a slower host
# 0.337 / 0.270 at [8192, 4096] (2^25): there the kernel's call (~0.24-0.34 ms of host time with the
# autograd thread hop, ~0.11 ms of GPU time) lost to the chain's 0.27 ms of GPU time. From 2^26 the chain's
# GPU time alone (~0.53 ms) exceeds the kernel call's host time on every host measured, so the threshold
# is 2^26 (eighth session; kernels.py times [16384, 4096] above it and --small both sides). See
# benchmarks/RESULTS.md, "Sixth session" and "Dispatch".
# While a CUDA graph is being captured every size takes the kernel (a replay has no per-kernel host cost).
SMALL_NUMEL = 1 << 26
# Under torch.compile: "chain" traces `residual + dropout(x + bias)` so that inductor fuses it with its
# neighbours (the LayerNorm after a residual add, say), which the opaque custom op prevents; "custom_op"
# traces opadvisor::bias_dropout_add_fwd. Measured on the BERT example (H200): chain 22.95 ms/step compiled,
# custom op 25.71.
COMPILE_PATH = "chain"

_NO_SEED = (0, 0, 0)
OP = "bias_dropout_add"  # its name in the dispatch record and in warnings


def bias_dropout_add_backend(x: torch.Tensor) -> str:
    """Which implementation `bias_dropout_add(x, ...)` runs: "triton", "interpreter", "eager" (the plain
    chain, for small CUDA tensors) or "reference"."""
    return _backend.for_tensor(x, SMALL_NUMEL)


def eager_bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool = True
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` as PyTorch ops in the inputs' dtype: the chain the kernel replaces."""
    v = x if bias is None else x + bias
    return residual + F.dropout(v, p, training)


def reference_bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + dropout(x + bias)`` computed in float32 (float64 for float64 inputs) by PyTorch.

    Dropout uses PyTorch's generator unless `keep` (bool, x's shape) gives the mask.
    """
    out_dtype = _out_dtype(x, bias, residual)
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    v = x.to(compute)
    if bias is not None:
        v = v + bias.to(compute)
    if training and p > 0:
        v = F.dropout(v, p) if keep is None else torch.where(keep, v * _rng.keep_scale(p), 0.0)
    return (residual.to(compute) + v).to(out_dtype)


def philox_keep_like(x: torch.Tensor, seed: _rng.Seed, p: float) -> torch.Tensor:
    """The keep mask the kernels draw for `x` (rows of its last dimension) and `seed`."""
    n_cols = x.shape[-1]
    return _rng.philox_keep_mask(
        _rng.host_seed(seed), x.numel() // max(n_cols, 1), n_cols, p, x.device
    ).reshape(x.shape)


def _out_dtype(x, bias, residual):
    return _promote(x.dtype, None if bias is None else bias.dtype, residual.dtype)


@functools.cache
def _config(n_cols: int, tile: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps): a tile of ~`tile` elements, columns first."""
    block = min(max(16, triton_next_power_of_2(n_cols)), max(16, tile))
    rows = max(1, tile // block)
    warps = min(16, max(1, rows * block // 512))
    return rows, block, warps


@functools.lru_cache(maxsize=4096)
def _fwd_plan(shape, x_strides, r_strides, dtypes, device, flags, tile):
    """(Launch, integer args, output dtype) for one layout, or None when it needs a copy first.

    dtypes: (x, bias or None, residual); flags: (DROPOUT, stored mask: None, "byte" or "bits", SEED_PTR,
    INTERLEAVE). Cached: a
    training step that repeats its shapes pays for the layout arithmetic once."""
    got = layout.row_layout(shape, [x_strides, r_strides], len(shape) - 1)
    if got is None:
        return None
    n_rows, n_cols, (_, d1, d2), (s_x, s_r) = got
    i64 = layout.needs_int64(shape, [x_strides, r_strides])
    rows, block, warps = _config(n_cols, tile)
    grid = (triton_cdiv(n_rows, rows), triton_cdiv(n_cols, block))
    x_dtype, b_dtype, r_dtype = dtypes
    out_dtype = _promote(x_dtype, b_dtype, r_dtype)
    launcher = _launchers()[0]
    _backend.check_launch_device(device)
    dropout, stored, seed_ptr, interleave = flags
    meta = {
        "HAS_BIAS": b_dtype is not None, "DROPOUT": dropout, "BYTE_MASK": stored == "byte",
        "BIT_MASK": stored == "bits", "INTERLEAVE": interleave,
        "RNE": launcher.interpreted and out_dtype == torch.bfloat16, "SEED_PTR": seed_ptr,
        "ROWS": rows, "BLOCK": block, "I64": i64, "FLAT": n_rows == d2, "SPLIT_RNG": SPLIT_RNG and not i64,
        "num_warps": warps,
    }  # fmt: skip
    return launcher.prepare(grid, meta), (n_rows, n_cols, d1, d2, *s_x, *s_r), out_dtype


@functools.cache
def _launchers() -> tuple[Launcher, Launcher, Launcher]:
    from . import _dropout_add_triton as k

    return (
        Launcher(k.bias_dropout_add_fwd_kernel),
        Launcher(k.bias_dropout_add_bwd_kernel),
        Launcher(k.bias_grad_kernel),
    )


def _promote(x_dtype, b_dtype, r_dtype):
    dtype = torch.promote_types(x_dtype, r_dtype)
    return torch.promote_types(dtype, b_dtype) if b_dtype is not None else dtype


def _stored_mask(p: float) -> str | None:
    """The mask the forward stores for the backward: None (recomputed from the seed), "byte" or "bits"."""
    return MASK_MODE if p > 0 and MASK_MODE != "philox" else None


def _empty_mask(shape, stored: str | None, device) -> torch.Tensor:
    """An empty tensor for the mask the forward stores, or an empty one for none. "byte": uint8 of x's shape;
    "bits": int8 (the dtype tells the backward which), rows of ceil(n_cols / 8) bytes, column c in bit c % 8
    of byte c // 8."""
    if stored is None:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if stored == "byte":
        return torch.empty(shape, dtype=torch.uint8, device=device)
    return torch.empty(_bits_shape(shape), dtype=torch.int8, device=device)


def _bits_shape(shape) -> tuple[int, int]:
    n_cols = shape[-1] if len(shape) else 1
    return (math.prod(shape) // max(n_cols, 1), triton_cdiv(n_cols, 8))


def _mask_kind(keep: torch.Tensor | None) -> str | None:
    """Which mask the backward reads: None (none stored: recompute from the seed), "byte" or "bits"."""
    if keep is None or keep.numel() == 0:
        return None
    return "bits" if keep.dtype == torch.int8 else "byte"


def _forward(x, bias, residual, p, seed):
    """(y, the stored keep mask or None): a mask only in MASK_MODE "byte" or "bits"."""
    stored = _stored_mask(p)
    keep = None if stored is None else _empty_mask(x.shape, stored, x.device)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=_out_dtype(x, bias, residual), device=x.device), keep
    dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype)
    flags = (p > 0, stored, isinstance(seed, torch.Tensor), RNG_INTERLEAVE)
    plan = _fwd_plan(x.shape, x.stride(), residual.stride(), dtypes, x.device, flags, TILE)
    if plan is None:
        _dispatch.warn_fallback(OP, "inputs whose batch dimensions do not merge into three are copied first")
        x, residual = x.contiguous(), residual.contiguous()
        plan = _fwd_plan(x.shape, x.stride(), residual.stride(), dtypes, x.device, flags, TILE)
    launch, ints, out_dtype = plan
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    launch(
        (x, x if bias is None else bias, residual, y, y if keep is None else keep, *ints,
         *_rng.dropout_scalars(p), *_rng.seed_args(seed, y))
    )  # fmt: skip
    return y, keep


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """How the backward launches: `bias_dropout_add_bwd_kernel` on a grid of about `programs_per_sm`
    programs per multiprocessor (split into column blocks of up to `block` columns, each program looping over
    a run of rows, `rows` rows an iteration, `warps` warps; rows narrower than `block` take more rows an
    iteration, the tile staying rows x block elements; fewer programs where each would get under `min_rows`
    rows: each program writes a row of partial sums), `stages` pipelining its loop's loads, `prefetch`
    loading the next rows before the current ones' mask is drawn, `interleave` one Philox call per four
    columns (the same bits as one per element, see `keep_mask`), `split_rng` the mask drawn by
    `keep_rows_cols` (the same bits again; where rows fit in int32); then `bias_grad_kernel` summing the
    partial sums in tiles of `sum_rows` x `sum_cols`, `sum_warps` warps."""

    rows: int = 1
    block: int = 2048
    warps: int = 4
    programs_per_sm: int = 4
    min_rows: int = 1
    stages: int = 1
    prefetch: bool = False
    interleave: bool = False
    sum_rows: int = 32
    sum_cols: int = 64
    sum_warps: int = 4
    split_rng: bool = False


# The backward's launch per row width: (fewest columns, BackwardConfig) pairs, widest first; a layout takes
# the first whose fewest columns its rows reach. Measured on an H200 (tenth session, benchmarks/bda_sweep.py,
# GPU time from CUDA-graph replays, bf16, p=0.1, with this session's kernel: no `row_offsets` divisions on
# 2-D layouts, no redundant bounds selects): rows of 4096 columns run 2 rows x 1024 columns an iteration
# with `keep_rows_cols` (63 registers: 8 programs of 4 warps a multiprocessor), at least 32 rows a program:
# the backward alone 0.078 ms at [16384, 4096] (80.5% of copy) against 0.082 for the ninth session's
# 8 x 256 tile, 0.084 for 2 x 1024 with `keep_mask` and 0.089 for 8 x 256 with `keep_rows_cols` (its hoisted
# column words take it to 72 registers, 7 programs resident); fwd+bwd 0.1751 ms (90.1%), [8192, 4096]
# 0.0948 (83.3%; 0.0966 with at least 64 rows a program). Narrower rows keep the ninth session's 8 x 256
# tile with `keep_mask` (a 1024-column block leaves [16384, 1024] one column block and [8192, 768] a quarter
# of its lanes idle: fwd+bwd 0.0586 against 0.0533 ms, 0.0382 against 0.0262; 32 rows a program there
# measured slower). Two tiles ahead, an evict-first L2 policy on dy and dx, a 64-register cap and 1 x 2048,
# 4 x 512, 4 x 256, 8 x 128, 16 x 256 tiles measured no faster (RESULTS.md, "tenth session").
BACKWARD_CONFIGS = (
    (4096, BackwardConfig(rows=2, block=1024, warps=4, programs_per_sm=8, min_rows=32, prefetch=True,
                          sum_rows=256, sum_cols=8, split_rng=True)),
    (0, BackwardConfig(rows=8, block=256, warps=4, programs_per_sm=16, min_rows=64, prefetch=True,
                       sum_rows=256, sum_cols=8)),
)  # fmt: skip


def backward_config(n_cols: int, configs=None) -> BackwardConfig:
    """The BackwardConfig of `configs` (default BACKWARD_CONFIGS) for rows of `n_cols` columns."""
    for fewest, config in BACKWARD_CONFIGS if configs is None else configs:
        if n_cols >= fewest:
            return config
    raise ValueError(f"no backward config for rows of {n_cols} columns")


class BackwardPlan(NamedTuple):
    """The backward's launches for one layout of dy: `launch` (dx and, with a bias gradient, each program's
    partial dbias), its integer args, `sum_launch` (`bias_grad_kernel`: the partial sums added up into dbias,
    a second launch; None without a bias gradient) and the partial sums' shape [programs along rows, n_cols]
    (None: no dbias). Two launches on purpose: dbias summed inside the backward launch by the last program
    of each column block (an atomic ticket) measured twice as slow on an H200 (fwd+bwd GPU time 0.223 ms
    against 0.110 at [8192, 4096]; 37% of copy bandwidth against ~72% at [16384, 4096]) and saved too
    little host time from Python to matter."""

    launch: Launch
    ints: tuple
    sum_launch: Launch | None
    partial_shape: tuple[int, int] | None


def _bwd_geometry(n_rows: int, n_cols: int, config: BackwardConfig, programs: int):
    """(ROWS, BLOCK, grid, rows per program): the config's tile, narrowed to the rows' width, over a grid of
    about `programs` programs (at least one tile of rows each)."""
    block = min(max(16, triton_next_power_of_2(n_cols)), config.block)
    rows = max(1, config.rows * config.block // block)
    col_blocks = triton_cdiv(n_cols, block)
    row_progs = max(1, min(triton_cdiv(n_rows, max(rows, config.min_rows)), programs // col_blocks))
    rows_per_prog = triton_cdiv(triton_cdiv(n_rows, row_progs), rows) * rows
    return rows, block, (triton_cdiv(n_rows, rows_per_prog), col_blocks), rows_per_prog


@functools.lru_cache(maxsize=4096)
def _bwd_plan(shape, dy_strides, dtypes, device, flags, configs):
    """The BackwardPlan for one layout of dy, or None (copy first). dtypes: (dy, dx, bias or None: no
    dbias); flags: (stored mask: None, "byte" or "bits"; SEED_PTR); configs: BACKWARD_CONFIGS. Each backward
    program sums dbias over a run of rows of one column block."""
    got = layout.row_layout(shape, [dy_strides], len(shape) - 1)
    if got is None:
        return None
    n_rows, n_cols, (_, d1, d2), (s_dy,) = got
    config = backward_config(n_cols, configs)
    i64 = layout.needs_int64(shape, [dy_strides])
    programs = config.programs_per_sm * _backend.multiprocessors(device)
    rows, block, grid, rows_per_prog = _bwd_geometry(n_rows, n_cols, config, programs)
    _, dx_dtype, b_dtype = dtypes
    _, bwd, bias_grad = _launchers()
    _backend.check_launch_device(device)
    stored, seed_ptr = flags
    meta = {
        "HAS_BIAS": b_dtype is not None, "BYTE_MASK": stored == "byte", "BIT_MASK": stored == "bits",
        "INTERLEAVE": config.interleave,
        "RNE": bwd.interpreted and dx_dtype == torch.bfloat16, "SEED_PTR": seed_ptr,
        "ROWS": rows, "BLOCK": block, "I64": i64, "FLAT": n_rows == d2, "SPLIT_RNG": config.split_rng and not i64,
        "STAGES": config.stages, "PREFETCH": config.prefetch, "num_warps": config.warps,
    }  # fmt: skip
    ints = (n_rows, n_cols, d1, d2, *s_dy, rows_per_prog)
    launch = bwd.prepare(grid, meta)
    if b_dtype is None:
        return BackwardPlan(launch, ints, None, None)
    rne = bias_grad.interpreted and b_dtype == torch.bfloat16
    sum_meta = {
        "BLOCK_R": config.sum_rows, "BLOCK_C": config.sum_cols, "RNE": rne, "num_warps": config.sum_warps
    }  # fmt: skip
    sum_launch = bias_grad.prepare((triton_cdiv(n_cols, config.sum_cols),), sum_meta)
    return BackwardPlan(launch, ints, sum_launch, (grid[0], n_cols))


def _backward_kernel(dy, keep, x_dtype, b_dtype, p, seed, prepared=None):
    """(dx, dbias in b_dtype, or None when b_dtype is None) for a dropout forward.

    `keep`: the forward's stored mask (bytes or bits, see `_empty_mask`), or None / an empty tensor when the
    mask is recomputed from `seed`.
    `prepared`: `_prepare_backward`'s (dy strides, dy dtype, BackwardPlan), used when dy matches it."""
    stored = _mask_kind(keep)
    dx = torch.empty(dy.shape, dtype=x_dtype, device=dy.device)
    if dy.numel() == 0:
        return dx, (dy.new_zeros(dy.shape[-1], dtype=b_dtype) if b_dtype is not None else None)
    if prepared is not None and dy.stride() == prepared[0] and dy.dtype == prepared[1]:
        plan = prepared[2]
    else:
        flags = (stored, isinstance(seed, torch.Tensor))
        dtypes = (dy.dtype, x_dtype, b_dtype)
        plan = _bwd_plan(dy.shape, dy.stride(), dtypes, dy.device, flags, BACKWARD_CONFIGS)
        if plan is None:
            dy = dy.contiguous()
            plan = _bwd_plan(dy.shape, dy.stride(), dtypes, dy.device, flags, BACKWARD_CONFIGS)
    tail = (
        dx if stored is None else keep,
        *plan.ints,
        *_rng.dropout_scalars(p),
        *_rng.seed_args(seed, dx),
    )
    if plan.partial_shape is None:
        plan.launch((dy, dx, dx, *tail))
        return dx, None
    partial = torch.empty(plan.partial_shape, dtype=torch.float32, device=dy.device)
    plan.launch((dy, dx, partial, *tail))
    dbias = torch.empty(plan.partial_shape[1], dtype=b_dtype, device=dy.device)
    plan.sum_launch((partial, dbias, *plan.partial_shape))
    return dx, dbias


def _prepare_backward(y, info, stored, seed):
    """(dy strides, dy dtype, BackwardPlan) for a dy laid out like the output `y` (as autograd passes it),
    looked up while the forward runs, so the backward (on the autograd engine's device thread, where Python
    is slow) checks dy's strides and dtype and launches; None when no kernel runs backward."""
    x_dtype, b_dtype, _, p, need_dx, need_db, _ = info
    if not (p > 0 and (need_dx or need_db)) or y.numel() == 0:
        return None
    flags = (stored, isinstance(seed, torch.Tensor))
    plan = _bwd_plan(y.shape, y.stride(), (y.dtype, x_dtype, b_dtype), y.device, flags, BACKWARD_CONFIGS)
    return None if plan is None else (y.stride(), y.dtype, plan)


def _grads(dy, info, run_kernel, *run_args):
    """(dx, dbias, dresidual), None for those not needed. info: (x dtype, bias dtype or None when no dbias
    is needed, residual dtype, p, need dx, need dbias, need dresidual); `run_kernel(*run_args)` -> (dx,
    dbias in the bias's dtype or None) runs the kernels (with dropout)."""
    x_dtype, b_dtype, r_dtype, p, need_dx, need_db, need_dr = info
    dres = (dy if dy.dtype == r_dtype else dy.to(r_dtype)) if need_dr else None
    if p > 0 and (need_dx or need_db):
        dx, dbias = run_kernel(*run_args)
    else:
        dx = dy.to(x_dtype)
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32).to(b_dtype) if need_db else None
    return (dx if need_dx else None), dbias, dres


def _grad_info(ctx, x, bias, residual, p) -> tuple:
    """What the backward needs to know besides the seed: dtypes, p, and which gradients are needed."""
    need_dx, need_db, need_dr = ctx.needs_input_grad[:3]
    b_dtype = None if bias is None or not need_db else bias.dtype
    return x.dtype, b_dtype, residual.dtype, p, need_dx, b_dtype is not None, need_dr


class BiasDropoutAddFunction(torch.autograd.Function):
    """Eager-mode autograd around the kernels: nothing but the dtypes, p, the seed and which gradients are
    needed is kept for backward (and the mask in MASK_MODE "byte" or "bits"), and the backward is the two
    kernel launches."""

    @staticmethod
    def forward(ctx, x, bias, residual, p):
        seed = _rng.draw_seed(x.device) if p > 0 else _NO_SEED
        y, keep = _forward(x, bias, residual, p, seed)
        if keep is not None:
            ctx.save_for_backward(keep)
        info = _grad_info(ctx, x, bias, residual, p)
        ctx.args = (info, seed, keep is not None, _prepare_backward(y, info, _mask_kind(keep), seed))
        return y

    @staticmethod
    def backward(ctx, dy):
        info, seed, byte_mask, prepared = ctx.args
        keep = ctx.saved_tensors[0] if byte_mask else None
        dx, dbias, dres = _grads(
            dy, info, _backward_kernel, dy, keep, info[0], info[1], info[3], seed, prepared
        )  # fmt: skip
        return dx, dbias, dres, None


# BiasDropoutAddFunction.apply without autograd.Function.apply's Python wrapper (see _backend.direct_apply).
_apply = _backend.direct_apply(BiasDropoutAddFunction)


@torch.library.custom_op("opadvisor::bias_dropout_add_fwd", mutates_args=())
def bias_dropout_add_fwd_op(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, keep bytes or empty, seed as a CPU int64 tensor [3])."""
    seed = _rng.draw_op_seed(x.device, "opadvisor::bias_dropout_add_fwd") if p > 0 else _NO_SEED
    y, keep = _forward(x, bias, residual, p, seed)
    if keep is None:
        keep = _empty_mask(x.shape, None, x.device)
    return y, keep, torch.tensor(seed, dtype=torch.int64)


@bias_dropout_add_fwd_op.register_fake
def _(x, bias, residual, p):
    y = torch.empty(x.shape, dtype=_out_dtype(x, bias, residual), device=x.device)
    stored = _stored_mask(p)
    keep = _empty_mask(x.shape, stored, x.device)
    return y, keep, torch.empty(3, dtype=torch.int64, device="cpu")


@torch.library.custom_op("opadvisor::bias_dropout_add_bwd", mutates_args=())
def bias_dropout_add_bwd_op(
    dy: torch.Tensor, keep: torch.Tensor, seed: torch.Tensor, x_dtype: torch.dtype, b_dtype: torch.dtype | None,
    p: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dbias in b_dtype, or an empty tensor when b_dtype is None)."""
    k0, k1, stream = (int(v) for v in seed.tolist())
    dx, dbias = _backward_kernel(dy, keep, x_dtype, b_dtype, p, (k0, k1, stream))
    return dx, dbias if dbias is not None else dy.new_empty(0)


@bias_dropout_add_bwd_op.register_fake
def _(dy, keep, seed, x_dtype, b_dtype, p):
    dx = torch.empty(dy.shape, dtype=x_dtype, device=dy.device)
    if b_dtype is None:
        return dx, dy.new_empty(0)
    return dx, dy.new_empty(dy.shape[-1], dtype=b_dtype)


def _setup_context(ctx, inputs, output):
    x, bias, residual, p = inputs
    _, keep, seed = output
    ctx.save_for_backward(keep, seed)
    ctx.args = _grad_info(ctx, x, bias, residual, p)


def _op_backward(ctx, dy, _dkeep, _dseed):
    keep, seed = ctx.saved_tensors
    info = ctx.args
    dx, dbias, dres = _grads(dy, info, _op_kernel_backward, dy, keep, seed, info)
    return dx, dbias, dres, None


def _op_kernel_backward(dy, keep, seed, info):
    dx, dbias = bias_dropout_add_bwd_op(dy, keep, seed, info[0], info[1], info[3])
    return dx, dbias if info[1] is not None else None


torch.library.register_autograd(bias_dropout_add_fwd_op, _op_backward, setup_context=_setup_context)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool = True,
) -> torch.Tensor:
    """``residual + dropout(x + bias, p, training)`` in one pass; forward and backward.

    Args:
        x: the sublayer output [..., H] (float32, float16, bfloat16 run the kernels).
        bias: None or [H] (the bias the sublayer's linear would have added).
        residual: the residual stream, x's shape.
        p: dropout probability; training: dropout only when True (as F.dropout).

    Returns a tensor of x's shape in the promoted dtype of the inputs. Backward gives dx, dbias and
    dresidual and keeps no mask: the dropout mask is recomputed from a seed that follows
    torch.manual_seed. CUDA tensors under SMALL_NUMEL elements, and calls traced by torch.compile (see
    COMPILE_PATH), run the plain PyTorch chain instead (`bias_dropout_add_backend` says which).
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's {tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"bias must have shape [{x.shape[-1]}], got {tuple(bias.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    p_eff = float(p) if training else 0.0
    backend = bias_dropout_add_backend(x)
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _backend.fallback_reason(x))
        return reference_bias_dropout_add(x, bias, residual, p_eff)
    if backend == _backend.EAGER or (torch.compiler.is_compiling() and COMPILE_PATH == "chain"):
        _dispatch.record(OP, _dispatch.CHAIN)
        return eager_bias_dropout_add(x, bias, residual, p_eff)
    _dispatch.record(OP, _dispatch.KERNEL)
    if torch.compiler.is_compiling():
        return bias_dropout_add_fwd_op(x, bias, residual, p_eff)[0]
    return _apply(x, bias, residual, p_eff)
