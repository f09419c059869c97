"""Triton kernels of `rms_norm` (imported only when a kernel launches; see `rms_norm.py`).

X [N, D] rows (row stride sx, unit column stride), W [D]; one row per program forward, a run of rows per
program backward (its share of the weight's gradient summed in registers, one row of DW_PART per program).
Math in float32 whatever the storage dtype; D fits one block (BLOCK >= D, a power of two).

Forward, per row (transformers' LlamaRMSNorm / T5LayerNorm):
    rstd = 1 / sqrt(mean(x^2) + eps)
    n    = round_to_x_dtype(x * rstd)        (the original casts back to the input's dtype here)
    y    = w * n                             (in Y's dtype: torch's type promotion of w and x)
    RSTD[row] = rstd (float32, saved for the backward)
Backward, with n_hat = x * rstd (the cast's derivative is the identity) and g = w * dy:
    dx = rstd * (g - n_hat * mean(g * n_hat))
    dw = sum over rows of dy * n             (float32 partial sums per program: DW_PART [programs, D])
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import rne_bf16, widen


@triton.jit
def rms_norm_fwd_kernel(
    X, W, Y, RSTD, n_cols, sx, sy, eps,
    BLOCK: tl.constexpr, RNE_N: tl.constexpr, RNE_Y: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    row = widen(tl.program_id(0), I64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    n = rne_bf16(x * rstd, RNE_N).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, rne_bf16(w * n, RNE_Y).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(
    X, W, DY, RSTD, DX, DW_PART, n_rows, n_cols, sx, sdy, sdx, rows_per_program,
    BLOCK: tl.constexpr, RNE_N: tl.constexpr, RNE_DX: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    first = widen(pid, I64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        x = tl.load(X + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * sdy + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n_hat = x * rstd
        n = rne_bf16(n_hat, RNE_N).to(X.dtype.element_ty).to(tl.float32)
        dw += dy * n
        g = w * dy
        dx = rstd * (g - n_hat * (tl.sum(g * n_hat, axis=0) / n_cols))
        tl.store(DX + row * sdx + cols, rne_bf16(dx, RNE_DX).to(DX.dtype.element_ty), mask=ok)
    tl.store(DW_PART + widen(pid, I64) * n_cols + cols, dw, mask=ok)
