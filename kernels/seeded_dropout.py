"""`dropout`: ``F.dropout(x, p, training)`` whose mask is never stored: backward recomputes it from a seed.

Layers: `_elementwise_triton.dropout_kernel` -> `_launch_dropout` (launcher) -> `DropoutFunction` (eager
autograd; its backward runs the same kernel on the gradient with the forward's seed) -> `dropout`. On
CPU tensors without Triton's interpreter, for small CUDA tensors and under torch.compile it runs
`F.dropout` itself (one fused kernel per direction on CUDA, and what inductor fuses with its neighbours).

This is the fix for dropout written by hand (a `rand`/`bernoulli` mask, `masked_fill` or a multiply, the
`1 / (1 - p)` scale: four to six kernels forward and two or three backward, plus a stored mask): the same
distribution (each element kept with probability 1 - p and scaled by 1 / (1 - p)) from a different random
stream (`_rng`'s Philox stream, or PyTorch's own for `F.dropout`), so losses agree in distribution, not bit
for bit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _backend, _dispatch, _rng
from . import _layout as layout
from ._launch import Launcher

# Elements per program, as bias_dropout_add (2048 measured best there on an H200); one Philox call per
# element (bias_dropout_add measured that faster than interleaving four columns per call).
TILE = 2048
RNG_INTERLEAVE = False
# CUDA tensors with fewer elements run F.dropout: the Triton path is a Python autograd.Function, whose host
# cost (~0.1-0.3 ms forward+backward) is what bias_dropout_add measured for the same structure, and
# F.dropout is already one kernel each way; the kernel saves the mask's bytes (1 of 3-5 bytes per
# element), which pays for that host time only on large tensors. Inside a CUDA graph capture (no host
# cost per replay) every size takes the kernel.
SMALL_NUMEL = 1 << 25
OP = "dropout"  # its name in the dispatch record and in warnings


def dropout_backend(x: torch.Tensor) -> str:
    """Which implementation `dropout(x, ...)` runs: "triton", "interpreter", "eager" (F.dropout, for small
    CUDA tensors) or "reference" (F.dropout on CPU, and for dtypes the kernel does not cover)."""
    return _backend.for_tensor(x, SMALL_NUMEL)


def reference_dropout(
    x: torch.Tensor, p: float, training: bool = True, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Dropout by PyTorch: `F.dropout`, or, given `keep` (bool, x's shape), that mask scaled by 1 / (1 - p),
    computed in float32 and rounded once to x's dtype (the oracle of the kernel's values)."""
    if not training or p == 0:
        return x
    if keep is None:
        return F.dropout(x, p, True)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.where(keep, x.to(compute) * _rng.keep_scale(p), 0.0).to(x.dtype)


def philox_keep_like(x: torch.Tensor, seed: _rng.Seed, p: float) -> torch.Tensor:
    """The keep mask the kernel draws for `x` (rows of its last dimension) and `seed`."""
    n_cols = max(x.shape[-1], 1)
    mask = _rng.philox_keep_mask(_rng.host_seed(seed), x.numel() // n_cols, n_cols, p, x.device)
    return mask.reshape(x.shape)


@functools.cache
def _launcher() -> Launcher:
    from . import _elementwise_triton as k

    return Launcher(k.dropout_kernel)


@functools.cache
def _plan(n_rows: int, n_cols: int, tile: int) -> tuple[tuple[int, int], dict]:
    block = min(max(16, 1 << (n_cols - 1).bit_length()), max(16, tile))
    rows = max(1, tile // block)
    warps = min(16, max(1, rows * block // 512))
    grid = ((n_rows + rows - 1) // rows, (n_cols + block - 1) // block)
    i64 = layout.needs_int64((n_rows, n_cols), [(n_cols, 1)])
    return grid, {"ROWS": rows, "BLOCK": block, "I64": i64, "num_warps": warps}


def _launch_dropout(x: torch.Tensor, p: float, seed: _rng.Seed) -> torch.Tensor:
    """where(keep, x / (1 - p), 0) for contiguous `x`, the keep mask drawn from `seed`."""
    y = torch.empty_like(x)
    _backend.check_launch(x)
    n_cols = x.shape[-1]
    grid, meta = _plan(x.numel() // n_cols, n_cols, TILE)
    seed_ptr, k0, k1, stream, from_ptr = _rng.seed_launch_args(seed, y)
    _launcher()(
        grid,
        (x, y, x.numel() // n_cols, n_cols, _rng.keep_scale(p), _rng.threshold(p), k0, k1, stream, seed_ptr),
        {"INTERLEAVE": RNG_INTERLEAVE, "RNE": _backend.emulate_rne(y), "SEED_PTR": from_ptr, **meta},
    )
    return y


class DropoutFunction(torch.autograd.Function):
    """Eager autograd around the kernel: forward and backward draw the same mask from one seed."""

    @staticmethod
    def forward(ctx, x, p):
        seed = _rng.draw_seed(x.device)
        ctx.args = (p, seed)
        if not x.is_contiguous():
            _dispatch.warn_fallback(OP, "a non-contiguous input is copied first")
        return _launch_dropout(x.contiguous(), p, seed)

    @staticmethod
    def backward(ctx, dy):
        p, seed = ctx.args
        # d/dx where(keep, x * s, 0) = where(keep, dy * s, 0): the forward's kernel on dy, same mask
        return _launch_dropout(dy.contiguous(), p, seed), None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``: elements zeroed with probability p, the rest scaled by 1 / (1 - p).

    Args:
        x: any shape (float32, float16, bfloat16 run the kernel).
        p: dropout probability in [0, 1]; training: dropout only when True (as F.dropout).

    Returns a tensor of x's shape and dtype (x itself when nothing is dropped: not training, or p == 0).
    Backward keeps no mask: it is recomputed from a seed that follows torch.manual_seed. CUDA tensors under
    SMALL_NUMEL elements, CPU tensors (without TRITON_INTERPRET=1) and calls traced by torch.compile run
    `F.dropout` (`dropout_backend` says which).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0:
        return x
    backend = dropout_backend(x)
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _backend.fallback_reason(x))
        return F.dropout(x, p, True)
    if backend == _backend.EAGER or torch.compiler.is_compiling():
        _dispatch.record(OP, _dispatch.CHAIN)
        return F.dropout(x, p, True)
    _dispatch.record(OP, _dispatch.KERNEL)
    return DropoutFunction.apply(x, float(p))
