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


# ---- the backward as segmented sums (relpos.BACKWARD = "runs") -----------------------------------------------
# DeBERTa's indices are monotone along the summed axis: a query row's c2p index falls as the key moves right
# (the relative position i - j falls), a key's p2c index rises with the query. Equal indices then form one run
# per row, and the scatter-add is a sum per run: a segmented scan of the row, each run's sum stored once at its
# index by the run's last element. No atomics, each output written by one program; a row that is not monotone
# (neither non-increasing nor non-decreasing: an index of another model) is scatter-added with atomics as in
# disentangled_bias_bwd_kernel, so the result never depends on the promise.


@triton.jit
def _segmented_add(v1, f1, v2, f2):
    """Segmented sum: a run restarts where its flag (the run's first element) is set."""
    return tl.where(f2 != 0, v2, v1 + v2), f1 | f2


@triton.jit
def bwd_runs_kernel(
    G, IDX, D, n_o, n_r, P, sg0, so, sr, sio, sir, inv_scale,
    OUTER: tl.constexpr, BLOCK: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """d[n, o, idx[o, r]] += g[n, o, r] * inv_scale (g's strides: sg0, so, sr), summed along r: OUTER rows o
    of one batch-head, every r at once. c2p: o = query i, r = key j, idx = ci; p2c: o = key j, r = query
    i, idx = pi (g's strides swapped). Each run of equal indices along r is summed by a segmented scan and
    stored once, by its last element, where the row is monotone; atomics add the rest."""
    n = widen(tl.program_id(0), I64)
    o = widen(tl.program_id(1), I64) * OUTER + tl.arange(0, OUTER)
    r = tl.arange(0, BLOCK)
    ok = (o < n_o)[:, None] & (r < n_r)[None, :]
    has_next = (r + 1 < n_r)[None, :]
    g = tl.load(G + n * sg0 + o[:, None] * so + r[None, :] * sr, mask=ok, other=0.0).to(tl.float32)
    at = IDX + o[:, None] * sio + r[None, :] * sir
    # int32 in registers (an index into a table row): half the registers of a tile
    idx = tl.load(at, mask=ok, other=-1).to(tl.int32)
    prev = tl.load(at - sir, mask=ok & (r > 0)[None, :], other=-1).to(tl.int32)
    nxt = tl.load(at + sir, mask=ok & has_next, other=-1).to(tl.int32)
    first = (idx != prev).to(tl.int32)
    last = idx != nxt
    up = tl.max((ok & has_next & (nxt > idx)).to(tl.int32), axis=1)
    down = tl.max((ok & has_next & (nxt < idx)).to(tl.int32), axis=1)
    monotone = ((up == 0) | (down == 0))[:, None]
    sums, _ = tl.associative_scan((g * inv_scale, first), axis=1, combine_fn=_segmented_add)
    dst = D + n * n_o * P + o[:, None] * P + idx
    tl.store(dst, sums, mask=ok & last & monotone)
    tl.atomic_add(dst, g * inv_scale, mask=ok & (monotone == 0), sem="relaxed")
