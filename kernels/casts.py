"""`autocast_shared(x, n)`: one 16-bit copy of an activation that several linear layers read under autocast.

Why: under autocast every `F.linear` casts its float32 input to the autocast dtype itself, and autocast
caches only the casts of leaf tensors (the weights), not of activations. A block whose q, k and v
projections (or a SwiGLU's gate and up projections) read the same float32 hidden states (transformers'
norms return float32 there) makes three (two) 16-bit copies of it, and each projection keeps its own copy
for its weight's gradient until the backward: at Llama-3.2-1B's size (8192 tokens x 2048) that is 64 MiB
written and kept per block beyond one copy, about 1.5 GiB over 16 blocks.

`autocast_shared(x, n)` returns `n` views of one copy, cast exactly as autocast would (`x.to(dtype)`: the
same rounding, so every projection computes the same values). The backward is eager's too: each view's
gradient is cast back to float32 and the sum is taken in float32 (autograd would otherwise add the
16-bit gradients of one shared tensor in 16 bits before casting them). Where autocast is off for x's
device, or x is not float32, it returns `n` times x itself, as the projections would read it.

`autocast_linear(x, weight, bias)` is `F.linear` under autocast (the same casts, product and input gradient)
whose float32 weight's gradient, with WEIGHT_GRAD_F32 on a CUDA device, the product writes in float32 itself
(`torch.mm(..., out_dtype=torch.float32)`): eager writes it in 16 bits and casts it to float32 after, a kernel
that reads 2 and writes 4 bytes per weight (Llama-3.2-1B: a billion a step). The gradient is then the
product's float32 sum, not that sum rounded to 16 bits: a change of rounding, and the H200 measured no gain,
so the switch is off. `weight_grad` is that product, for the Functions that compute a
weight's gradient themselves (silu_mul_linear's down projection). Elsewhere (switch off, the CPU, autocast
off, a 16-bit weight) both are eager's computation exactly.
"""

from __future__ import annotations

import torch

# see the module docstring. Measured on an H200 (Llama-3.2-1B shape, then torch.compile): the float32-output
# products took as long as the 16-bit products and their casts together (step 134.25 ms on, 134.01 off): off
WEIGHT_GRAD_F32 = False
_HAS_MM_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype, n: int):  # type: ignore[override]
        ctx.source = x.dtype
        copy = x.to(dtype)
        # views of one copy: each use gets its own gradient, summed in float32 below
        return tuple(copy.view_as(copy) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        total = None
        for grad in grads:
            if grad is not None:
                total = grad.to(ctx.source) if total is None else total + grad.to(ctx.source)
        return total, None, None


def autocast_shared(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """`n` tensors to feed `n` linear layers in place of `x`: views of one autocast-dtype copy of `x` where
    autocast is on for its device and `x` is float32, else `x` itself `n` times (see the module docstring)."""
    device = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
        return (x,) * n
    dtype = torch.get_autocast_dtype(device)
    if dtype == torch.float32:
        return (x,) * n
    if not x.requires_grad or not torch.is_grad_enabled():
        copy = x.to(dtype)
        return (copy,) * n
    return _SharedCast.apply(x, dtype, n)


def weight_grad(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dy.t() @ x` (dy [rows, out], x [rows, in], both 16-bit) as the gradient of a `dtype` weight: the
    product in float32 itself with WEIGHT_GRAD_F32 on CUDA, else eager's 16-bit product cast to `dtype`."""
    if WEIGHT_GRAD_F32 and dtype == torch.float32 and dy.is_cuda and dy.dtype != dtype and _HAS_MM_DTYPE:
        return torch.mm(dy.t(), x, out_dtype=torch.float32)
    return dy.t().mm(x).to(dtype)


class _AutocastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):  # type: ignore[override]
        x16, w16 = x.to(dtype), weight.to(dtype)  # autocast's casts
        ctx.save_for_backward(x16, w16)  # what autocast's product keeps
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast(x.device.type, enabled=False):  # cast above, as autocast would
            return torch.nn.functional.linear(x16, w16, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x16, w16 = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dy.matmul(w16).to(x_dtype) if ctx.needs_input_grad[0] else None
        dw = weight_grad(dy2, x16.reshape(-1, x16.shape[-1]), w_dtype) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0).to(b_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; under autocast with WEIGHT_GRAD_F32 and a float32 weight being trained,
    its weight's gradient written in float32 by the product itself on CUDA (see the module docstring)."""
    device = x.device.type
    if (
        not WEIGHT_GRAD_F32
        or weight.dtype != torch.float32
        or not torch.is_autocast_enabled(device)
        or not (weight.requires_grad and torch.is_grad_enabled())
    ):
        return torch.nn.functional.linear(x, weight, bias)
    dtype = torch.get_autocast_dtype(device)
    if dtype == torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    return _AutocastLinear.apply(x, weight, bias, dtype)
