"""Triton kernels of `disentangled_bias` (imported only when a kernel launches; see `relpos.py`).

Forward, for each batch-head n and query/key positions i, j:
    out[n, i, j] = (c2p[n, i, ci[i, j]] + p2c[n, j, pi[j, i]]) * inv_scale
Backward (the gathers' adjoint: scatter-adds, accumulated in float32 with atomics):
    dc2p[n, i, ci[i, j]] += g[n, i, j] * inv_scale;   dp2c[n, j, pi[j, i]] += g[n, i, j] * inv_scale
A program handles ROWS query rows of one batch-head and loops over the keys in tiles of BLOCK.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import rne_bf16, widen


@triton.jit
def disentangled_bias_fwd_kernel(
    C2P,
    P2C,
    CI,
    PI,
    OUT,
    Sq,
    Sk,
    sc0,
    sc1,
    sc2,
    sp0,
    sp1,
    sp2,
    sci0,
    sci1,
    spi0,
    spi1,
    inv_scale,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
):
    n = widen(tl.program_id(0), I64)
    i = widen(tl.program_id(1), I64) * ROWS + tl.arange(0, ROWS)
    i_ok = i < Sq
    for j0 in range(0, Sk, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = i_ok[:, None] & (j < Sk)[None, :]
        acc = tl.zeros((ROWS, BLOCK), tl.float32)
        if HAS_C2P:
            ci = tl.load(CI + i[:, None] * sci0 + j[None, :] * sci1, mask=ok, other=0)
            acc += tl.load(C2P + n * sc0 + i[:, None] * sc1 + ci * sc2, mask=ok, other=0.0).to(tl.float32)
        if HAS_P2C:
            pi = tl.load(PI + j[None, :] * spi0 + i[:, None] * spi1, mask=ok, other=0)
            acc += tl.load(P2C + n * sp0 + j[None, :] * sp1 + pi * sp2, mask=ok, other=0.0).to(tl.float32)
        out = n * Sq * Sk + i[:, None] * Sk + j[None, :]
        tl.store(OUT + out, rne_bf16(acc * inv_scale, RNE).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def disentangled_bias_bwd_kernel(
    G,
    CI,
    PI,
    DC2P,
    DP2C,
    Sq,
    Sk,
    P1,
    P2,
    sg0,
    sg1,
    sg2,
    sci0,
    sci1,
    spi0,
    spi1,
    inv_scale,
    HAS_C2P: tl.constexpr,
    HAS_P2C: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    I64: tl.constexpr,
):
    n = widen(tl.program_id(0), I64)
    i = widen(tl.program_id(1), I64) * ROWS + tl.arange(0, ROWS)
    i_ok = i < Sq
    for j0 in range(0, Sk, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = i_ok[:, None] & (j < Sk)[None, :]
        g = tl.load(G + n * sg0 + i[:, None] * sg1 + j[None, :] * sg2, mask=ok, other=0.0).to(tl.float32)
        g = g * inv_scale
        if HAS_C2P:
            ci = tl.load(CI + i[:, None] * sci0 + j[None, :] * sci1, mask=ok, other=0)
            tl.atomic_add(DC2P + n * Sq * P1 + i[:, None] * P1 + ci, g, mask=ok, sem="relaxed")
        if HAS_P2C:
            pi = tl.load(PI + j[None, :] * spi0 + i[:, None] * spi1, mask=ok, other=0)
            tl.atomic_add(DP2C + n * Sk * P2 + j[None, :] * P2 + pi, g, mask=ok, sem="relaxed")
