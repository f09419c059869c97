"""`bias_dropout_add`: ``residual + dropout(x + bias)`` in one kernel, forward and backward.

Layers: `_dropout_add_triton` kernels -> `_forward` / `_backward_kernel` (launchers, through
`_launch.Launcher`) -> `BiasDropoutAddFunction` (eager autograd) and the custom ops
`opadvisor::bias_dropout_add_fwd` / `_bwd` (torch.compile with COMPILE_PATH "custom_op") ->
`bias_dropout_add`, which runs `eager_bias_dropout_add` (the plain chain) for small CUDA tensors and, by
default, under torch.compile. `reference_bias_dropout_add` is the PyTorch version and the oracle.

Backward saves no mask: the keep mask is recomputed from the seed (Philox, see `_rng`), so the only state
kept between forward and backward is three integers. `MASK_MODE = "byte"` instead stores a 1-byte mask
in the forward (compared on the GPU in benchmarks/kernels.py; see RESULTS.md for the choice).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _backend, _dispatch, _rng
from . import _layout as layout
from ._launch import Launcher
from .softmax import triton_cdiv, triton_next_power_of_2

# Elements per program (a tile of ROWS x BLOCK; 2048 measured best of 2048/4096/8192 on an H200), how
# the backward gets the keep mask ("philox": recomputed, measured faster than reading a 1-byte mask), and
# the Philox layout (see softmax.RNG_INTERLEAVE; one call per element measured 5% faster here).
TILE = 2048
MASK_MODE = "philox"  # or "byte"
RNG_INTERLEAVE = False
# On CUDA, tensors with fewer elements run the eager chain the user wrote (`residual + dropout(x + bias)`, in
# the inputs' dtype). The kernel saves about 5 us of GPU time per million elements (fwd+bwd, H200), and its
# call costs 0.1-0.2 ms more host time than the chain's (a Python autograd.Function, whose backward also
# hops to the autograd thread): in a step bound by its host (BERT-base, [8192, 768] x 24 calls) the kernel
# made the step slower (37.8 vs 30.0 ms), so only tensors from 2^25 elements, where the GPU saving covers
# that host cost, take it. See benchmarks/RESULTS.md, "Dispatch".
# While a CUDA graph is being captured every size takes the kernel (a replay has no per-kernel host cost).
SMALL_NUMEL = 1 << 25
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

    dtypes: (x, bias or None, residual); flags: (DROPOUT, BYTE_MASK, SEED_PTR, INTERLEAVE). Cached: a
    training step that repeats its shapes pays for the layout arithmetic once."""
    got = layout.row_layout(shape, [x_strides, r_strides], len(shape) - 1)
    if got is None:
        return None
    n_rows, n_cols, (_, d1, d2), (s_x, s_r) = got
    rows, block, warps = _config(n_cols, tile)
    grid = (triton_cdiv(n_rows, rows), triton_cdiv(n_cols, block))
    x_dtype, b_dtype, r_dtype = dtypes
    out_dtype = _promote(x_dtype, b_dtype, r_dtype)
    launcher = _launchers()[0]
    _backend.check_launch(device)
    dropout, byte_mask, seed_ptr, interleave = flags
    meta = {
        "HAS_BIAS": b_dtype is not None, "DROPOUT": dropout, "BYTE_MASK": byte_mask, "INTERLEAVE": interleave,
        "RNE": launcher.interpreted and out_dtype == torch.bfloat16, "SEED_PTR": seed_ptr,
        "ROWS": rows, "BLOCK": block, "I64": layout.needs_int64(shape, [x_strides, r_strides]),
        "num_warps": warps,
    }  # fmt: skip
    return launcher.prepare(grid, meta), (n_rows, n_cols, d1, d2, *s_x, *s_r), out_dtype


@functools.cache
def _launchers() -> tuple[Launcher, Launcher]:
    from . import _dropout_add_triton as k

    return Launcher(k.bias_dropout_add_fwd_kernel), Launcher(k.bias_dropout_add_bwd_kernel)


def _promote(x_dtype, b_dtype, r_dtype):
    dtype = torch.promote_types(x_dtype, r_dtype)
    return torch.promote_types(dtype, b_dtype) if b_dtype is not None else dtype


def _forward(x, bias, residual, p, seed):
    """(y, keep bytes or None): the 1-byte mask only in MASK_MODE "byte"."""
    byte_mask = p > 0 and MASK_MODE == "byte"
    if x.numel() == 0:
        y = torch.empty(x.shape, dtype=_out_dtype(x, bias, residual), device=x.device)
        return y, (torch.empty(x.shape, dtype=torch.uint8, device=x.device) if byte_mask else None)
    dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype)
    flags = (p > 0, byte_mask, isinstance(seed, torch.Tensor), RNG_INTERLEAVE)
    plan = _fwd_plan(x.shape, x.stride(), residual.stride(), dtypes, x.device, flags, TILE)
    if plan is None:
        _dispatch.warn_fallback(OP, "inputs whose batch dimensions do not merge into three are copied first")
        x, residual = x.contiguous(), residual.contiguous()
        plan = _fwd_plan(x.shape, x.stride(), residual.stride(), dtypes, x.device, flags, TILE)
    launch, ints, out_dtype = plan
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    keep = torch.empty(x.shape, dtype=torch.uint8, device=x.device) if byte_mask else None
    launch(
        (x, x if bias is None else bias, residual, y, keep if byte_mask else y, *ints,
         _rng.keep_scale(p), _rng.threshold(p), *_rng.seed_args(seed, y))
    )  # fmt: skip
    return y, keep


@functools.lru_cache(maxsize=64)
def _programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@functools.lru_cache(maxsize=4096)
def _bwd_plan(shape, dy_strides, dtypes, device, flags, tile):
    """(Launch, integer args, rows of partial dbias sums) for one layout of dy, or None (copy first).

    dtypes: (dy, dx); flags: (HAS_BIAS, BYTE_MASK, SEED_PTR, INTERLEAVE). Each program sums dbias over a
    run of rows of one column block."""
    got = layout.row_layout(shape, [dy_strides], len(shape) - 1)
    if got is None:
        return None
    n_rows, n_cols, (_, d1, d2), (s_dy,) = got
    rows, block, warps = _config(n_cols, tile)
    col_blocks = triton_cdiv(n_cols, block)
    row_progs = max(1, min(triton_cdiv(n_rows, rows), _programs_target(device) // col_blocks))
    rows_per_prog = triton_cdiv(triton_cdiv(n_rows, row_progs), rows) * rows
    row_progs = triton_cdiv(n_rows, rows_per_prog)
    launcher = _launchers()[1]
    _backend.check_launch(device)
    has_bias, byte_mask, seed_ptr, interleave = flags
    meta = {
        "HAS_BIAS": has_bias, "BYTE_MASK": byte_mask, "INTERLEAVE": interleave,
        "RNE": launcher.interpreted and dtypes[1] == torch.bfloat16, "SEED_PTR": seed_ptr,
        "ROWS": rows, "BLOCK": block, "I64": layout.needs_int64(shape, [dy_strides]), "num_warps": warps,
    }  # fmt: skip
    ints = (n_rows, n_cols, d1, d2, *s_dy, rows_per_prog)
    return launcher.prepare((row_progs, col_blocks), meta), ints, row_progs


def _backward_kernel(dy, keep, x_dtype, need_dbias, p, seed):
    """(dx, dbias in float32 or None) for a dropout forward: per-program column sums, then one sum.

    `keep`: the forward's 1-byte mask, or None / an empty tensor when the mask is recomputed from `seed`."""
    byte_mask = keep is not None and keep.numel() > 0
    dx = torch.empty(dy.shape, dtype=x_dtype, device=dy.device)
    if dy.numel() == 0:
        return dx, (dy.new_zeros(dy.shape[-1], dtype=torch.float32) if need_dbias else None)
    flags = (need_dbias, byte_mask, isinstance(seed, torch.Tensor), RNG_INTERLEAVE)
    dtypes = (dy.dtype, x_dtype)
    plan = _bwd_plan(dy.shape, dy.stride(), dtypes, dy.device, flags, TILE)
    if plan is None:
        dy = dy.contiguous()
        plan = _bwd_plan(dy.shape, dy.stride(), dtypes, dy.device, flags, TILE)
    launch, ints, row_progs = plan
    partial = (
        torch.empty((row_progs, dy.shape[-1]), dtype=torch.float32, device=dy.device) if need_dbias else None
    )
    launch(
        (dy, dx, dx if partial is None else partial, keep if byte_mask else dx, *ints,
         _rng.keep_scale(p), _rng.threshold(p), *_rng.seed_args(seed, dx))
    )  # fmt: skip
    return dx, (partial.sum(0) if partial is not None else None)


def _grads(dy, dtypes, needs, p, run_kernel, *run_args):
    """(dx, dbias, dresidual) for the inputs that need them; dtypes: (x, bias or None, residual);
    `run_kernel(*run_args, need_dbias)` -> (dx, dbias in float32)."""
    x_dtype, b_dtype, r_dtype = dtypes
    need_dx, need_db, need_dr = needs
    need_db = need_db and b_dtype is not None
    dres = (dy if dy.dtype == r_dtype else dy.to(r_dtype)) if need_dr else None
    if p > 0 and (need_dx or need_db):
        dx, dbias = run_kernel(*run_args, need_db)
    else:
        dx = dy.to(x_dtype)
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32) if need_db else None
    return (dx if need_dx else None), (dbias.to(b_dtype) if need_db else None), dres


def _kernel_backward(dy, keep, x_dtype, p, seed, need_dbias):
    return _backward_kernel(dy, keep, x_dtype, need_dbias, p, seed)


class BiasDropoutAddFunction(torch.autograd.Function):
    """Eager-mode autograd around the kernels: nothing but the three dtypes, p and the seed is kept for
    backward (and the 1-byte mask in MASK_MODE "byte")."""

    @staticmethod
    def forward(ctx, x, bias, residual, p):
        seed = _rng.draw_seed(x.device) if p > 0 else _NO_SEED
        y, keep = _forward(x, bias, residual, p, seed)
        if keep is not None:
            ctx.save_for_backward(keep)
        ctx.args = (
            (x.dtype, None if bias is None else bias.dtype, residual.dtype),
            p,
            seed,
            keep is not None,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        dtypes, p, seed, byte_mask = ctx.args
        keep = ctx.saved_tensors[0] if byte_mask else None
        need = ctx.needs_input_grad
        dx, dbias, dres = _grads(dy, dtypes, need[:3], p, _kernel_backward, dy, keep, dtypes[0], p, seed)
        return dx, dbias, dres, None


@torch.library.custom_op("opadvisor::bias_dropout_add_fwd", mutates_args=())
def bias_dropout_add_fwd_op(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, keep bytes or empty, seed as a CPU int64 tensor [3])."""
    seed = _rng.draw_op_seed(x.device, "opadvisor::bias_dropout_add_fwd") if p > 0 else _NO_SEED
    y, keep = _forward(x, bias, residual, p, seed)
    if keep is None:
        keep = torch.empty(0, dtype=torch.uint8, device=x.device)
    return y, keep, torch.tensor(seed, dtype=torch.int64)


@bias_dropout_add_fwd_op.register_fake
def _(x, bias, residual, p):
    y = torch.empty(x.shape, dtype=_out_dtype(x, bias, residual), device=x.device)
    byte_mask = p > 0 and MASK_MODE == "byte"
    keep = torch.empty(x.shape if byte_mask else (0,), dtype=torch.uint8, device=x.device)
    return y, keep, torch.empty(3, dtype=torch.int64, device="cpu")


@torch.library.custom_op("opadvisor::bias_dropout_add_bwd", mutates_args=())
def bias_dropout_add_bwd_op(
    dy: torch.Tensor, keep: torch.Tensor, seed: torch.Tensor, x_dtype: torch.dtype, p: float, need_dbias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias in float32, or an empty tensor when not needed)."""
    k0, k1, stream = (int(v) for v in seed.tolist())
    dx, dbias = _backward_kernel(dy, keep, x_dtype, need_dbias, p, (k0, k1, stream))
    return dx, dbias if dbias is not None else dy.new_empty(0, dtype=torch.float32)


@bias_dropout_add_bwd_op.register_fake
def _(dy, keep, seed, x_dtype, p, need_dbias):
    dx = torch.empty(dy.shape, dtype=x_dtype, device=dy.device)
    return dx, dy.new_empty(dy.shape[-1] if need_dbias else 0, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, bias, residual, p = inputs
    _, keep, seed = output
    ctx.save_for_backward(keep, seed)
    ctx.args = ((x.dtype, None if bias is None else bias.dtype, residual.dtype), p)


def _op_backward(ctx, dy, _dkeep, _dseed):
    keep, seed = ctx.saved_tensors
    dtypes, p = ctx.args
    need = ctx.needs_input_grad
    dx, dbias, dres = _grads(dy, dtypes, need[:3], p, bias_dropout_add_bwd_op, dy, keep, seed, dtypes[0], p)
    return dx, dbias, dres, None


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
    return BiasDropoutAddFunction.apply(x, bias, residual, p_eff)
