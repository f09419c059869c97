"""`quick_gelu`: ``x * sigmoid(1.702 * x)`` (CLIP's QuickGELU) in one kernel each way.

Layers: `_elementwise_triton.quick_gelu_fwd_kernel` / `..._bwd_kernel` -> `QuickGeluFunction` (eager
autograd; saves x, recomputes the sigmoid in backward) -> `quick_gelu`. Where the kernel does not run (CPU
without Triton's interpreter, small CUDA tensors, under torch.compile) `reference_quick_gelu` runs: the
chain itself (three kernels forward on CUDA; inductor fuses it when compiled).

The chain written by hand runs three elementwise kernels forward (scale, sigmoid, multiply) and about five
backward, each a full pass over the activation; the fused kernels make one pass forward (read x, write y)
and one backward (read x and dy, write dx), computing in float32 and rounding once.
"""

from __future__ import annotations

import functools

import torch

from . import _backend, _dispatch
from . import _layout as layout
from ._launch import Launcher

BLOCK = 2048
# CUDA tensors with fewer elements run the chain. Not measured for this kernel yet: the value
# masked_softmax measured for the same autograd.Function host cost (~0.07 ms forward, ~0.2 ms
# forward+backward) against the GPU time of a few elementwise passes.
SMALL_NUMEL = 1 << 22
OP = "quick_gelu"  # its name in the dispatch record and in warnings


def quick_gelu_backend(x: torch.Tensor) -> str:
    """Which implementation `quick_gelu(x)` runs: "triton", "interpreter", "eager" or "reference"."""
    return _backend.for_tensor(x, SMALL_NUMEL)


def reference_quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(1.702 * x)`` in x's dtype: the chain the kernel replaces."""
    return x * torch.sigmoid(1.702 * x)


@functools.cache
def _launchers() -> tuple[Launcher, Launcher]:
    from . import _elementwise_triton as k

    return Launcher(k.quick_gelu_fwd_kernel), Launcher(k.quick_gelu_bwd_kernel)


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
