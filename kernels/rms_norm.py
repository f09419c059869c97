"""`rms_norm`: transformers' RMSNorm (LlamaRMSNorm, T5LayerNorm and the classes that copy it) in one kernel
each way.

The original, written op by op:

    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)

runs six kernels forward (a float32 copy, square, mean, add + rsqrt, multiply, cast, multiply by the
weight) and about as many backward, and saves the float32 copy and the normalised rows for the backward.
The kernels here read x once forward (y and the per-row rstd written) and x and dy once backward (dx
written, the weight's gradient summed per program in float32), saving x and rstd (float32 [rows]) only.
Values: float32 math, the normalised rows rounded to x's dtype where the original rounds them, y in the
dtype torch's type promotion gives `weight * x` (float32 for a float32 weight and bf16 x, as under autocast).
`torch.nn.functional.rms_norm` is a different function (no rounding to x's dtype before the weight).

Layers: `_rms_norm_triton` kernels -> `_forward` / `_backward` -> `RMSNormFunction` (eager autograd) and the
custom ops `opadvisor::rms_norm_fwd` / `_bwd` (torch.compile with COMPILE_PATH "custom_op") -> `rms_norm`.
`reference_rms_norm` is the original written in PyTorch, and what runs where the kernels do not:
`rms_norm_backend` says which ("triton", "interpreter", "eager": CUDA tensors under SMALL_NUMEL elements,
"reference": CPU without the interpreter, float64, rows longer than MAX_COLS, empty tensors). Under
torch.compile COMPILE_PATH "native" (the default) traces the reference, which inductor fuses with its
neighbours as well as this kernel does; "custom_op" traces the kernels as one node.
"""

from __future__ import annotations

import functools

import torch

from . import _backend, _dispatch
from . import _layout as layout
from ._launch import Launcher
from .softmax import triton_next_power_of_2

# Rows longer than this run the reference (one program holds a row in registers).
MAX_COLS = 16384
# CUDA tensors with fewer elements run the reference chain. Not measured for this kernel yet: the value
# the other memory-bound kernels use for an autograd.Function's host cost against a few passes over memory.
SMALL_NUMEL = 1 << 20
COMPILE_PATH = "native"  # under torch.compile: "native" traces the reference, "custom_op" the kernels
OP = "rms_norm"  # its name in the dispatch record and in warnings


def rms_norm_backend(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which implementation `rms_norm(x, weight, eps)` runs: "triton", "interpreter", "eager" or "reference"."""
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] > MAX_COLS:
        return _backend.REFERENCE
    if weight.device != x.device or weight.dtype not in _backend.KERNEL_DTYPES:
        return _backend.REFERENCE
    return _backend.for_tensor(x, SMALL_NUMEL)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op (the test oracle and the fallback)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


@functools.cache
def _launchers() -> tuple[Launcher, Launcher]:
    from . import _rms_norm_triton as k

    return Launcher(k.rms_norm_fwd_kernel), Launcher(k.rms_norm_bwd_kernel)


def _meta(n_cols: int, x: torch.Tensor, n_elements: int, out_flag: str, out: torch.Tensor) -> dict:
    """The kernels' constexprs; `out_flag`: the name of the flag that rounds `out`'s stores (interpreter)."""
    block = max(16, triton_next_power_of_2(n_cols))
    return {
        "BLOCK": block,
        "RNE_N": _backend.emulate_rne(x),
        out_flag: _backend.emulate_rne(out),
        "I64": n_elements >= layout.INT32_SAFE,
        "num_warps": min(16, max(1, block // 256)),
    }


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit column stride (a view where the layout allows, else a copy)."""
    if x.stride(-1) != 1:
        _dispatch.warn_fallback(OP, "an input whose last dimension is not contiguous is copied first")
    return x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in promote(weight, x) dtype with x's shape, rstd float32 [rows])."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty((n_rows, n_cols), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    _backend.check_launch(x)
    meta = _meta(n_cols, x2, max(x2.numel(), n_rows * x2.stride(0)), "RNE_Y", y)
    _launchers()[0]((n_rows,), (x2, weight, y, rstd, n_cols, x2.stride(0), n_cols, float(eps)), meta)
    return y.view(x.shape), rstd


def _backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype and shape, dweight in weight's dtype)."""
    x2 = _rows(x)
    dy2 = _rows(dy.to(torch.promote_types(weight.dtype, x.dtype)))
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    programs = max(1, min(n_rows, 4 * _backend.multiprocessors(x.device)))
    per_program = -(-n_rows // programs)
    programs = -(-n_rows // per_program)
    dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    meta = _meta(n_cols, x2, max(x2.numel(), n_rows * max(x2.stride(0), dy2.stride(0))), "RNE_DX", dx)
    args = (
        x2,
        weight,
        dy2,
        rstd,
        dx,
        dw_part,
        n_rows,
        n_cols,
        x2.stride(0),
        dy2.stride(0),
        n_cols,
        per_program,
    )
    _launchers()[1]((programs,), args, meta)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Eager-mode autograd around the kernels."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(x, weight, rstd, dy)
        return dx, dw, None


@torch.library.custom_op("opadvisor::rms_norm_fwd", mutates_args=())
def rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd float32 [rows])."""
    return _forward(x, weight, eps)


@rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1]
    y = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    return y, x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("opadvisor::rms_norm_bwd", mutates_args=())
def rms_norm_bwd_op(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight)."""
    return _backward(x, weight, rstd, dy)


@rms_norm_bwd_op.register_fake
def _(x, weight, rstd, dy):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd_op(x, weight, rstd, dy)
    return dx, dw, None


torch.library.register_autograd(rms_norm_fwd_op, _op_backward, setup_context=_setup_context)

_apply = _backend.direct_apply(RMSNormFunction)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of x over its last dimension with `weight` [D] (see the module docstring):
    `weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)`, one kernel each way on CUDA."""
    backend = rms_norm_backend(x, weight)
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _fallback_reason(x, weight))
        return reference_rms_norm(x, weight, eps)
    if backend == _backend.EAGER or (torch.compiler.is_compiling() and COMPILE_PATH == "native"):
        _dispatch.record(OP, _dispatch.CHAIN)
        return reference_rms_norm(x, weight, eps)
    _dispatch.record(OP, _dispatch.KERNEL)
    if torch.compiler.is_compiling():
        return rms_norm_fwd_op(x, weight, eps)[0]
    return _apply(x, weight, eps)


def _fallback_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    reason = _backend.fallback_reason(x)
    if reason is not None or _backend.backend(x) == _backend.REFERENCE or x.numel() == 0:
        return reason
    if x.shape[-1] > MAX_COLS:
        return f"rows of {x.shape[-1]} > {MAX_COLS} elements: the PyTorch reference runs"
    return f"a weight of shape {tuple(weight.shape)}, {weight.dtype} on {weight.device}: the PyTorch reference runs"
