"""Triton kernels of `dropout`, `quick_gelu` and `silu_mul` (imported only when a kernel launches; see
`seeded_dropout.py` and `activations.py`). They work on contiguous tensors (dropout: seen as rows of its last
dimension; the others: flat).

dropout:     y = where(keep, x / (1 - p), 0)      (its backward is the same kernel on dy, same seed)
quick_gelu:  y = x * sigmoid(1.702 x)
             dx = dy * (s + 1.702 x s (1 - s)),   s = sigmoid(1.702 x)
silu_mul:    y = g * sigmoid(g) * u               (a SwiGLU MLP's act(gate(x)) * up(x), SiLU as act)
             dg = dy * u * s (1 + g (1 - s)),  du = dy * g * s,   s = sigmoid(g)
             (the backward kernel can write y again too: silu_mul_linear keeps g and u, not y)
The dropout keep mask is `_rng`'s Philox stream (the one `bias_dropout_add` uses), recomputed in backward.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import keep_mask, rne_bf16, seed_words, widen


@triton.jit(do_not_specialize=["k0", "k1", "stream", "threshold"])
def dropout_kernel(
    X,
    Y,
    n_rows,
    n_cols,
    keep_scale,
    threshold,
    k0,
    k1,
    stream,
    SEED,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    SEED_PTR: tl.constexpr,
):
    k0, k1, stream = seed_words(SEED, k0, k1, stream, SEED_PTR)
    rows = widen(tl.program_id(0), I64) * ROWS + tl.arange(0, ROWS)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    off = rows[:, None] * n_cols + widen(cols, I64)[None, :]
    v = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
    keep = keep_mask(k0, k1, stream, threshold, rows, col0, ROWS, BLOCK, INTERLEAVE)
    v = tl.where(keep, v * keep_scale, 0.0)
    tl.store(Y + off, rne_bf16(v, RNE).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def quick_gelu_fwd_kernel(X, Y, n, BLOCK: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr):
    offs = widen(tl.program_id(0), I64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.sigmoid(1.702 * x)
    tl.store(Y + offs, rne_bf16(y, RNE).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def quick_gelu_bwd_kernel(X, DY, DX, n, BLOCK: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr):
    offs = widen(tl.program_id(0), I64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(1.702 * x)
    # d/dx x * s(1.702 x) = s + 1.702 x s (1 - s)
    dx = dy * (s + 1.702 * x * s * (1.0 - s))
    tl.store(DX + offs, rne_bf16(dx, RNE).to(DX.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr):
    offs = widen(tl.program_id(0), I64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, rne_bf16(y, RNE).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_bwd_kernel(
    G, U, DY, DG, DU, Y, n, BLOCK: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr, WRITE_Y: tl.constexpr
):
    offs = widen(tl.program_id(0), I64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    if WRITE_Y:  # the forward's y again, the forward kernel's g * sigmoid(g) * u (silu_mul_linear's backward)
        tl.store(Y + offs, rne_bf16(g * s * u, RNE).to(Y.dtype.element_ty), mask=ok)
    # y = silu(g) * u: du = dy * g s; dg = dy * u * (s + g s (1 - s))
    tl.store(DU + offs, rne_bf16(dy * g * s, RNE).to(DU.dtype.element_ty), mask=ok)
    tl.store(DG + offs, rne_bf16(dy * u * s * (1.0 + g * (1.0 - s)), RNE).to(DG.dtype.element_ty), mask=ok)
