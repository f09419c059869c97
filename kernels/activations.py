"""`quick_gelu`: ``x * sigmoid(1.702 * x)`` (CLIP's QuickGELU), and `silu_mul`: ``F.silu(g) * u`` (a SwiGLU
MLP's gate: Llama's `act_fn(gate_proj(x)) * up_proj(x)`), each in one kernel each way.

Layers: `_elementwise_triton.quick_gelu_fwd_kernel` / `..._bwd_kernel` -> `QuickGeluFunction` (eager
autograd; saves x, recomputes the sigmoid in backward) -> `quick_gelu`. Where the kernel does not run (CPU
without Triton's interpreter, small CUDA tensors, under torch.compile) `reference_quick_gelu` runs: the
chain itself (three kernels forward on CUDA; inductor fuses it when compiled).

The chain written by hand runs three elementwise kernels forward (scale, sigmoid, multiply) and about five
backward, each a full pass over the activation; the fused kernels make one pass forward (read x, write y)
and one backward (read x and dy, write dx), computing in float32 and rounding once.

`silu_mul(g, u)`: the chain runs two kernels forward (silu, multiply) and saves g, u and silu(g) for the
backward; the fused kernel reads g and u once, writes y, and saves g and u only (a third less activation
memory per MLP); backward one kernel reads g, u, dy and writes dg and du. Layers: `silu_mul_fwd_kernel` /
`..._bwd_kernel` -> `SiluMulFunction` (eager) and the custom ops `opadvisor::silu_mul_fwd` / `_bwd`
(torch.compile with SILU_MUL_COMPILE_PATH "custom_op"; "native", the default, traces the chain, which inductor
fuses as well) -> `silu_mul`. Values: float32 math rounded once, where the chain rounds silu(g) to the
inputs' dtype first (the difference is one rounding of that dtype).
"""

from __future__ import annotations

import functools

import torch

from . import _backend, _dispatch
from . import _layout as layout
from ._launch import Launcher
from .casts import weight_grad
from .linear_cross_entropy import compute_dtype

BLOCK = 2048
# CUDA tensors with fewer elements run the chain. Not measured for this kernel yet: the value
# masked_softmax measured for the same autograd.Function host cost (~0.07 ms forward, ~0.2 ms
# forward+backward) against the GPU time of a few elementwise passes.
SMALL_NUMEL = 1 << 22
OP = "quick_gelu"  # its name in the dispatch record and in warnings
SILU_MUL_OP = "silu_mul"
SILU_MUL_LINEAR_OP = "silu_mul_linear"  # silu_mul_linear's own Function (its chain records silu_mul's path)
SILU_MUL_COMPILE_PATH = "native"  # under torch.compile: "native" traces the chain, "custom_op" the kernels


def quick_gelu_backend(x: torch.Tensor) -> str:
    """Which implementation `quick_gelu(x)` runs: "triton", "interpreter", "eager" or "reference"."""
    return _backend.for_tensor(x, SMALL_NUMEL)


def reference_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(1.702 * x)`` in x's dtype: the chain the kernel replaces."""
    return x * torch.sigmoid(1.702 * x)


@functools.cache
def _launchers() -> tuple[Launcher, ...]:
    from . import _elementwise_triton as k

    return (
        Launcher(k.quick_gelu_fwd_kernel),
        Launcher(k.quick_gelu_bwd_kernel),
        Launcher(k.silu_mul_fwd_kernel),
        Launcher(k.silu_mul_bwd_kernel),
    )


def _meta(n: int, t: torch.Tensor) -> tuple[tuple[int], dict]:
    grid = ((n + BLOCK - 1) // BLOCK,)
    return grid, {"BLOCK": BLOCK, "RNE": _backend.emulate_rne(t), "I64": n >= layout.INT32_SAFE}


class QuickGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if not x.is_contiguous():
            _dispatch.warn_fallback(OP, "a non-contiguous input is copied first")
        x = x.contiguous()
        y = torch.empty_like(x)
        _backend.check_launch(x)
        grid, meta = _meta(x.numel(), y)
        _launchers()[0](grid, (x, y, x.numel()), meta)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        grid, meta = _meta(x.numel(), dx)
        _launchers()[1](grid, (x, dy, dx, x.numel()), meta)
        return dx


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)``, one kernel forward and one backward on CUDA (see the module doc)."""
    backend = quick_gelu_backend(x)
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _backend.fallback_reason(x))
        return reference_quick_gelu(x)
    if backend == _backend.EAGER or torch.compiler.is_compiling():
        _dispatch.record(OP, _dispatch.CHAIN)
        return reference_quick_gelu(x)
    _dispatch.record(OP, _dispatch.KERNEL)
    return QuickGeluFunction.apply(x)


# ---- silu_mul ----------------------------------------------------------------------------------------------
def silu_mul_backend(g: torch.Tensor, u: torch.Tensor) -> str:
    """Which implementation `silu_mul(g, u)` runs: "triton", "interpreter", "eager" or "reference"."""
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        return _backend.REFERENCE
    return _backend.for_tensor(g, SMALL_NUMEL)


def reference_silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u``: the chain the kernel replaces (transformers' SiLUActivation is F.silu)."""
    return torch.nn.functional.silu(g) * u


def _silu_mul_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if not (g.is_contiguous() and u.is_contiguous()):
        _dispatch.warn_fallback(SILU_MUL_OP, "non-contiguous inputs are copied first")
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    _backend.check_launch(g)
    grid, meta = _meta(g.numel(), y)
    _launchers()[2](grid, (g, u, y, g.numel()), meta)
    return y


def _silu_mul_backward(
    g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, y: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """dg and du; where `y` is given (contiguous, like g), the kernel also writes the forward's output there."""
    g, u, dy = g.contiguous(), u.contiguous(), dy.to(g.dtype).contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    grid, meta = _meta(g.numel(), dg)
    meta["WRITE_Y"] = y is not None
    _launchers()[3](grid, (g, u, dy, dg, du, dg if y is None else y, g.numel()), meta)
    return dg, du


class SiluMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return _silu_mul_forward(g, u)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return _silu_mul_backward(g, u, dy)


@torch.library.custom_op("opadvisor::silu_mul_fwd", mutates_args=())
def silu_mul_fwd_op(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _silu_mul_forward(g, u)


@silu_mul_fwd_op.register_fake
def _(g, u):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


@torch.library.custom_op("opadvisor::silu_mul_bwd", mutates_args=())
def silu_mul_bwd_op(g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _silu_mul_backward(g, u, dy)


@silu_mul_bwd_op.register_fake
def _(g, u, dy):
    return (
        torch.empty_like(g, memory_format=torch.contiguous_format),
        torch.empty_like(u, memory_format=torch.contiguous_format),
    )


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_op_backward(ctx, dy):
    g, u = ctx.saved_tensors
    return silu_mul_bwd_op(g, u, dy)


torch.library.register_autograd(silu_mul_fwd_op, _silu_mul_op_backward, setup_context=_silu_mul_setup)
_silu_mul_apply = _backend.direct_apply(SiluMulFunction)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` (g, u of one shape and dtype), one kernel forward and one backward on CUDA."""
    backend = silu_mul_backend(g, u)
    if backend == _backend.REFERENCE:
        reason = _backend.fallback_reason(g)
        if reason is None and _backend.backend(g) != _backend.REFERENCE and g.numel():
            reason = "inputs of different shapes, dtypes or devices: the PyTorch reference runs"
        _dispatch.record_reference(SILU_MUL_OP, reason)
        return reference_silu_mul(g, u)
    if backend == _backend.EAGER or (torch.compiler.is_compiling() and SILU_MUL_COMPILE_PATH == "native"):
        _dispatch.record(SILU_MUL_OP, _dispatch.CHAIN)
        return reference_silu_mul(g, u)
    _dispatch.record(SILU_MUL_OP, _dispatch.KERNEL)
    if torch.compiler.is_compiling():
        return silu_mul_fwd_op(g, u)
    return _silu_mul_apply(g, u)


# ---- silu_mul_linear: a SwiGLU MLP's down projection that keeps g and u only ---------------------------------
# `down_proj(silu_mul(g, u))` keeps three activations for its backward: g and u (silu_mul's) and
# y = silu_mul(g, u) (the projection's input, for its weight's gradient), plus, under autocast, the 16-bit
# copy of the weight. Here the backward computes y again in the kernel that computes dg and du (one pass
# over g and u that the backward makes anyway) and casts the weight again: at Llama-3.2-1B's training size
# (8192 tokens x 8192) that is 128 MiB less kept per block, about 2 GiB over 16 blocks. The values and
# gradients are eager's: the same kernels, matrix products and casts as eager's autograd runs.
def _linear_dtype(g: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype `F.linear(y, weight)` computes in for a y of g's dtype (linear_cross_entropy's
    `compute_dtype`), or None where that is not one dtype for both (without autocast F.linear then raises;
    autocast leaves a float64 weight alone): the chain runs there and does what eager does."""
    dtypes = _backend.KERNEL_DTYPES
    if g.dtype not in dtypes or weight.dtype not in dtypes:
        return None
    if weight.dtype != g.dtype and not torch.is_autocast_enabled(g.device.type):
        return None
    return compute_dtype(g, weight)


class SiluMulLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, weight, dtype):
        y = _silu_mul_forward(g, u)
        with torch.autocast(g.device.type, enabled=False):  # the casts autocast makes, made here
            out = torch.nn.functional.linear(y.to(dtype), weight.to(dtype))
        ctx.save_for_backward(g, u, weight)
        ctx.dtype = dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        g, u, weight = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        d2 = dout.reshape(-1, dout.shape[-1])
        # eager's mm backward for a row-major input: grad_input = grad.mm(weight), grad_weight = grad.t().mm(input)
        dy = d2.mm(w).view(g.shape)
        # y (silu_mul's output) only for the weight's gradient: a frozen weight needs none written
        y = torch.empty(g.shape, dtype=g.dtype, device=g.device) if ctx.needs_input_grad[2] else None
        dg, du = _silu_mul_backward(g, u, dy, y)
        dw = None if y is None else weight_grad(d2, y.to(ctx.dtype).view(-1, y.shape[-1]), weight.dtype)
        return dg, du, dw, None


_silu_mul_linear_apply = _backend.direct_apply(SiluMulLinearFunction)


def _silu_mul_linear_fused(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether silu_mul_linear's own Function runs: the kernel's backends, a backward to save memory for, no
    bias (Llama-family MLPs have none), eager execution (inductor plans the memory of a compiled graph)."""
    if bias is not None or torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if not (g.requires_grad or u.requires_grad or weight.requires_grad):
        return False
    if weight.dim() != 2 or g.shape[-1] != weight.shape[-1]:
        return False
    return silu_mul_backend(g, u) in (_backend.TRITON, _backend.INTERPRETER)


def silu_mul_linear(
    g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(silu_mul(g, u), weight, bias)``: a SwiGLU MLP's down projection of its gate. In training,
    with the kernel's backends and no bias, the backward computes silu_mul's output again instead of keeping
    it (see the section comment); elsewhere it is that chain itself."""
    dtype = _linear_dtype(g, weight)
    if dtype is None or not _silu_mul_linear_fused(g, u, weight, bias):
        return torch.nn.functional.linear(silu_mul(g, u), weight, bias)
    _dispatch.record(SILU_MUL_LINEAR_OP, _dispatch.KERNEL)
    return _silu_mul_linear_apply(g, u, weight, dtype)
