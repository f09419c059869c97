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
"""

from __future__ import annotations

import torch


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
