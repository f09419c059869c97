"""Triton kernels of `bias_dropout_add` (imported only when a kernel launches; see `dropout_add.py`).

Forward:  y = residual + where(keep, (x + bias) / (1 - p), 0)
Backward: dx = where(keep, dy / (1 - p), 0);  dbias = sum over rows of dx;  dresidual = dy (no kernel)
          (each backward program sums dbias over its rows in float32; `bias_grad_kernel` adds those up and
          writes dbias in the bias's dtype: two launches, no PyTorch op between them)
The keep mask is recomputed from the seed (see `_rng`), or read back from the mask the forward stored
when the launcher asks for one: one bit an element (BIT_MASK) or one byte (BYTE_MASK, kept to compare).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import keep_mask, rne_bf16, seed_words, widen
from ._common_triton import row_offsets as _row_offsets


@triton.jit
def _philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox4x32 round (as `philox4x32`'s) on broadcastable tensors: written out so that the rounds whose
    words still depend on the row alone or the column alone stay that narrow (see `keep_rows_cols`)."""
    n0 = tl.math.umulhi(0xCD9E8D57, c2) ^ c1 ^ k0
    n2 = tl.math.umulhi(0xD2511F53, c0) ^ c3 ^ k1
    n1 = tl.mul(c2, 0xCD9E8D57, sanitize_overflow=False)
    n3 = tl.mul(c0, 0xD2511F53, sanitize_overflow=False)
    return n0, n1, n2, n3


@triton.jit
def keep_rows_cols(k0, k1, stream, threshold, rows, cols):
    """`keep_mask`'s bits for int32 `rows` [ROWS, 1] (so the counter's row-high word is 0) x `cols` [1, BLOCK],
    in fewer instructions: Philox's first round sees one word that depends on the row and three that depend
    on the column, so it runs once per row and once per column (hoisted out of a program's row loop), and
    the second and half the third run on [ROWS, 1] / [1, BLOCK] words; only the rest runs per element (and
    per four columns once compiled: a thread's four columns of a quad share the words). The threshold test
    `(w >> 1) >= t` is `w >= 2t` unsigned (the same bits, one instruction fewer an element)."""
    key0 = k0.to(tl.uint32)
    key1 = k1.to(tl.uint32)
    quad = (cols // 4).to(tl.uint32)
    r = rows.to(tl.uint32)
    zero = tl.zeros_like(r)
    c0, c1, c2, c3 = _philox_round(quad, r, zero, stream.to(tl.uint32) + tl.zeros_like(quad), key0, key1)
    for _ in tl.static_range(9):
        key0 = tl.add(key0, 0x9E3779B9, sanitize_overflow=False)
        key1 = tl.add(key1, 0xBB67AE85, sanitize_overflow=False)
        c0, c1, c2, c3 = _philox_round(c0, c1, c2, c3, key0, key1)
    which = cols % 4
    words = tl.where(which == 0, c0, tl.where(which == 1, c1, tl.where(which == 2, c2, c3)))
    return words >= threshold.to(tl.uint32) * 2


@triton.jit
def _row_starts(rows, D1, D2, s0, s1, s2, FLAT: tl.constexpr):
    """`row_offsets`, or with FLAT (a 2-D layout: every row index below D2) rows * s2 without the integer
    divisions (a runtime divisor costs about ten instructions a row)."""
    if FLAT:
        return rows * s2
    else:
        return _row_offsets(rows, D1, D2, s0, s1, s2)


@triton.jit
def _keep(k0, k1, stream, threshold, rows, cols, col0, ROWS: tl.constexpr, BLOCK: tl.constexpr,
          INTERLEAVE: tl.constexpr, SPLIT_RNG: tl.constexpr):  # fmt: skip
    """The keep mask [ROWS, BLOCK] of `rows` x `cols` (col0 .. col0 + BLOCK - 1): `keep_rows_cols` with
    SPLIT_RNG (int32 rows), else `keep_mask`; the same bits."""
    if SPLIT_RNG:
        return keep_rows_cols(k0, k1, stream, threshold, rows[:, None], cols[None, :])
    else:
        return keep_mask(k0, k1, stream, threshold, rows, col0, ROWS, BLOCK, INTERLEAVE)


@triton.jit(do_not_specialize=["k0", "k1", "stream", "threshold"])
def bias_dropout_add_fwd_kernel(
    X,
    B,
    R,
    Y,
    KEEP,
    n_rows,
    n_cols,
    D1,
    D2,
    sx0,
    sx1,
    sx2,
    sxc,
    sr0,
    sr1,
    sr2,
    src,
    keep_scale,
    threshold,
    k0,
    k1,
    stream,
    SEED,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BYTE_MASK: tl.constexpr,
    BIT_MASK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    SEED_PTR: tl.constexpr,
    FLAT: tl.constexpr,
    SPLIT_RNG: tl.constexpr,
):
    k0, k1, stream = seed_words(SEED, k0, k1, stream, SEED_PTR)
    rows = widen(tl.program_id(0), I64) * ROWS + tl.arange(0, ROWS)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    c = widen(cols, I64)[None, :]
    xo = _row_starts(rows, D1, D2, sx0, sx1, sx2, FLAT)
    ro = _row_starts(rows, D1, D2, sr0, sr1, sr2, FLAT)
    v = tl.load(X + xo[:, None] + c * sxc, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    yoff = rows[:, None] * n_cols + c
    if DROPOUT:
        keep = _keep(k0, k1, stream, threshold, rows, cols, col0, ROWS, BLOCK, INTERLEAVE, SPLIT_RNG)
        v = tl.where(keep, v * keep_scale, 0.0)
        if BYTE_MASK:
            tl.store(KEEP + yoff, keep.to(tl.uint8), mask=ok)
        if BIT_MASK:
            _store_bits(KEEP, keep & ok, rows, col0, n_rows, n_cols, ROWS, BLOCK)
    r = tl.load(R + ro[:, None] + c * src, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + yoff, rne_bf16(r + v, RNE).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bit_offsets(rows, col0, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """(offsets, in-bounds) of the mask bytes of `rows` x columns col0 .. col0 + BLOCK - 1: a row's bits
    take ceil(n_cols / 8) bytes, column c is bit c % 8 of byte c // 8 (col0 is a multiple of 8)."""
    j = col0 // 8 + tl.arange(0, BLOCK // 8)
    ok = (rows < n_rows)[:, None] & (j * 8 < n_cols)[None, :]
    return rows[:, None] * ((n_cols + 7) // 8) + j[None, :], ok


@triton.jit
def _store_bits(KEEP, keep, rows, col0, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The keep mask [ROWS, BLOCK] packed eight columns a byte (see `_bit_offsets`)."""
    eight = tl.reshape(keep.to(tl.int32), (ROWS, BLOCK // 8, 8))
    packed = tl.sum(eight << tl.arange(0, 8)[None, None, :], axis=2)
    off, ok = _bit_offsets(rows, col0, n_rows, n_cols, ROWS, BLOCK)
    tl.store(KEEP + off, packed.to(tl.int8), mask=ok)


@triton.jit
def _load_bits(KEEP, rows, col0, n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The keep mask [ROWS, BLOCK] that `_store_bits` packed (int8 bytes: sign extension sets only bits above 7)."""
    off, ok = _bit_offsets(rows, col0, n_rows, n_cols, ROWS, BLOCK)
    packed = tl.load(KEEP + off, mask=ok, other=0).to(tl.int32)
    eight = (packed[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
    return tl.reshape(eight, (ROWS, BLOCK)) != 0


@triton.jit
def _load_dy(DY, rows, c, col_ok, n_rows, D1, D2, sdy0, sdy1, sdy2, sdyc, FLAT: tl.constexpr):
    """dy at `rows` x the column block, as float32 (0 outside the tensor)."""
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    dyo = _row_starts(rows, D1, D2, sdy0, sdy1, sdy2, FLAT)
    return tl.load(DY + dyo[:, None] + c * sdyc, mask=ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["k0", "k1", "stream", "threshold", "rows_per_prog"])
def bias_dropout_add_bwd_kernel(
    DY,
    DX,
    DB,
    KEEP,
    n_rows,
    n_cols,
    D1,
    D2,
    sdy0,
    sdy1,
    sdy2,
    sdyc,
    rows_per_prog,
    keep_scale,
    threshold,
    k0,
    k1,
    stream,
    SEED,
    HAS_BIAS: tl.constexpr,
    BYTE_MASK: tl.constexpr,
    BIT_MASK: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    SEED_PTR: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    FLAT: tl.constexpr,
    SPLIT_RNG: tl.constexpr,
):
    """dx for rows [pid0 * rows_per_prog, +rows_per_prog) x one column block; partial dbias per program.

    The partial sum stays a [ROWS, BLOCK] tile until the loop ends (one cross-row reduction per program,
    not one per iteration). STAGES pipelines the loop's loads (tl.range); PREFETCH loads the next rows' dy
    before the current rows' mask is drawn (rows past the program's own are read, never written). FLAT and
    SPLIT_RNG: see `_row_starts` and `keep_rows_cols`."""
    k0, k1, stream = seed_words(SEED, k0, k1, stream, SEED_PTR)
    pid_r = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    c = widen(cols, I64)[None, :]
    acc = tl.zeros((ROWS, BLOCK), tl.float32)
    first = widen(pid_r, I64) * rows_per_prog
    if PREFETCH:
        dy = _load_dy(DY, first + tl.arange(0, ROWS), c, col_ok, n_rows, D1, D2, sdy0, sdy1, sdy2, sdyc, FLAT)
    for r0 in tl.range(0, rows_per_prog, ROWS, num_stages=STAGES):
        rows = first + r0 + tl.arange(0, ROWS)
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        if PREFETCH:
            cur = dy
            dy = _load_dy(DY, rows + ROWS, c, col_ok, n_rows, D1, D2, sdy0, sdy1, sdy2, sdyc, FLAT)
        else:
            cur = _load_dy(DY, rows, c, col_ok, n_rows, D1, D2, sdy0, sdy1, sdy2, sdyc, FLAT)
        doff = rows[:, None] * n_cols + c
        if BYTE_MASK:
            keep = tl.load(KEEP + doff, mask=ok, other=0) != 0
        elif BIT_MASK:
            keep = _load_bits(KEEP, rows, col0, n_rows, n_cols, ROWS, BLOCK)
        else:
            keep = _keep(k0, k1, stream, threshold, rows, cols, col0, ROWS, BLOCK, INTERLEAVE, SPLIT_RNG)
        # cur is 0 outside the tensor (the loads' `other`): no `& ok` here (two selects an element fewer)
        dx = tl.where(keep, cur * keep_scale, 0.0)
        tl.store(DX + doff, rne_bf16(dx, RNE).to(DX.dtype.element_ty), mask=ok)
        if HAS_BIAS:
            acc += dx
    if HAS_BIAS:
        tl.store(DB + widen(pid_r, I64) * n_cols + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def bias_grad_kernel(
    PARTIAL, DB, n_parts, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RNE: tl.constexpr
):  # fmt: skip
    """DB[c] = sum over r of PARTIAL[r, c] (the backward kernel's per-program sums, float32 [n_parts,
    n_cols]) in DB's dtype, rounded once: one program per BLOCK_C columns, tiles of BLOCK_R rows, a fixed
    order (deterministic)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
    for r0 in range(0, n_parts, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = (rows < n_parts)[:, None] & col_ok[None, :]
        acc += tl.load(PARTIAL + rows[:, None] * n_cols + cols[None, :], mask=ok, other=0.0)
    tl.store(DB + cols, rne_bf16(tl.sum(acc, axis=0), RNE).to(DB.dtype.element_ty), mask=col_ok)
