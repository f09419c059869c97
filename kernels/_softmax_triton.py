"""Triton kernels of `masked_softmax` (imported only when a kernel launches; see `softmax.py`).

Layout: the softmax dimension is the row; the other dimensions are merged into at most three batch
dimensions (sizes D0 x D1 x D2, any strides, 0 for broadcast masks), so broadcast masks and
non-contiguous inputs are read in place. Offsets are int64 where a tensor reaches 2**31 elements (I64), int32
otherwise. A mask row that all ROWS rows of a program share ([B,1,1,S] padding masks) is loaded once
(MASK_SHARED, decided by the launcher). Math is float32 whatever the storage dtype. The forward of rows
held whole in registers can also run on a persistent grid (PERSISTENT: each program loops over tiles, STAGES
pipelining the loads); `softmax.FORWARD_CONFIGS` picks, per row block, from what
benchmarks/softmax_sweep.py measured. Rows of a power of two columns wider than one warp's 16-byte vectors
are held in SPLIT pieces a thread, each warp with whole rows (`_fwd_tile_split`, SPLIT from the launcher).

Forward, per row:  s = x * scale;  s = where(mask, fill, s) (bool) or s + mask (additive)
                   p = exp(s - max s) / sum exp(s - max s)   (0 for a row whose s are all -inf)
                   p = where(mask, 0, p) if ZERO_MASKED;  y = where(keep, p / (1 - p_drop), 0)
Backward, with P the saved probabilities (y without dropout, p with dropout):
                   dp = where(keep, dy / (1 - p_drop), 0), then where(mask, 0, dp) if ZERO_MASKED
                   ds = P * (dp - sum(dp * P))    # d/ds softmax: P * (dp - <dp, P>)
                   dx = where(mask, 0, ds) * scale (bool mask: masked_fill passes no gradient)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import keep_mask, rne_bf16, seed_words, widen
from ._common_triton import row_offsets as _row_offsets


@triton.jit
def _load_mask(M, mo, cols, ok, n_cols, smc, other, I64: tl.constexpr, MASK_SHARED: tl.constexpr):
    """The mask values of one [ROWS, BLOCK] tile (`other` outside it). MASK_SHARED: every row of the
    program reads the same mask row (a [B,1,1,S] padding mask, say; the launcher checks), `mo` is that
    row's offset and the row is loaded once instead of once per row."""
    c = widen(cols, I64)
    if MASK_SHARED:
        v = tl.load(M + mo + c * smc, mask=cols < n_cols, other=other)
        return tl.where(ok, v[None, :], other)
    else:
        return tl.load(M + mo[:, None] + c[None, :] * smc, mask=ok, other=other)


@triton.jit
def _mask_row_offsets(rows, first_row, D1, D2, sm0, sm1, sm2, MASK_SHARED: tl.constexpr):
    if MASK_SHARED:
        return _row_offsets(first_row, D1, D2, sm0, sm1, sm2)
    else:
        return _row_offsets(rows, D1, D2, sm0, sm1, sm2)


@triton.jit
def _scores(
    X, M, xo, mo, cols, ok, n_cols, sxc, smc, scale, fill,
    MASK: tl.constexpr, I64: tl.constexpr, MASK_SHARED: tl.constexpr,
):  # fmt: skip
    """s (float32, -inf outside the row) and the bool mask for one [ROWS, BLOCK] tile."""
    c = widen(cols, I64)[None, :]
    x = tl.load(X + xo[:, None] + c * sxc, mask=ok, other=0.0).to(tl.float32)
    s = x * scale
    masked = ok & False
    if MASK == 1:
        masked = _load_mask(M, mo, cols, ok, n_cols, smc, 0, I64, MASK_SHARED) != 0
        s = tl.where(masked, fill, s)
    if MASK == 2:
        s = s + _load_mask(M, mo, cols, ok, n_cols, smc, 0.0, I64, MASK_SHARED).to(tl.float32)
    return tl.where(ok, s, float("-inf")), masked


@triton.jit
def _fwd_tile(
    tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc, sy0, sy1, sy2, syc,
    scale, fill, keep_scale, threshold, k0, k1, stream,
    MASK: tl.constexpr, ZERO_MASKED: tl.constexpr, DROPOUT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr,
    MASK_SHARED: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """The forward of rows [tile * ROWS, +ROWS), each held whole in registers (rows up to BLOCK columns),
    as one [ROWS, BLOCK] tile (SPLIT = 1) or in SPLIT pieces a row (`_fwd_tile_split`)."""
    if SPLIT > 1:
        _fwd_tile_split(
            tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
            sy0, sy1, sy2, syc, scale, fill, keep_scale, threshold, k0, k1, stream,
            MASK, ZERO_MASKED, DROPOUT, ROWS, BLOCK, INTERLEAVE, RNE, I64, MASK_SHARED, SPLIT, EVEN, SCALED,
        )  # fmt: skip
    else:
        _fwd_tile_flat(
            tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
            sy0, sy1, sy2, syc, scale, fill, keep_scale, threshold, k0, k1, stream,
            MASK, ZERO_MASKED, DROPOUT, ROWS, BLOCK, INTERLEAVE, RNE, I64, MASK_SHARED,
        )  # fmt: skip


@triton.jit
def _fwd_tile_flat(
    tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc, sy0, sy1, sy2, syc,
    scale, fill, keep_scale, threshold, k0, k1, stream,
    MASK: tl.constexpr, ZERO_MASKED: tl.constexpr, DROPOUT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr,
    MASK_SHARED: tl.constexpr,
):  # fmt: skip
    """`_fwd_tile` with SPLIT = 1: the tile as [ROWS, BLOCK]."""
    first = widen(tile, I64) * ROWS
    rows = first + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    xo = _row_offsets(rows, D1, D2, sx0, sx1, sx2)
    mo = _mask_row_offsets(rows, first, D1, D2, sm0, sm1, sm2, MASK_SHARED)
    yo = _row_offsets(rows, D1, D2, sy0, sy1, sy2)
    cols = tl.arange(0, BLOCK)
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    s, masked = _scores(X, M, xo, mo, cols, ok, n_cols, sxc, smc, scale, fill, MASK, I64, MASK_SHARED)
    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(s - m[:, None])
    den = tl.sum(e, axis=1)
    p = e * tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)[:, None]
    if ZERO_MASKED:
        p = tl.where(masked, 0.0, p)
    yoff = yo[:, None] + widen(cols, I64)[None, :] * syc
    if DROPOUT:
        tl.store(P + yoff, rne_bf16(p, RNE).to(P.dtype.element_ty), mask=ok)
        keep = keep_mask(k0, k1, stream, threshold, rows, 0, ROWS, BLOCK, INTERLEAVE)
        p = tl.where(keep, p * keep_scale, 0.0)
    tl.store(Y + yoff, rne_bf16(p, RNE).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _load_tile(ptr, ok, other, EVEN: tl.constexpr):
    if EVEN:  # every element of the tile is in bounds: no predicates
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=ok, other=other)


@triton.jit
def _store_tile(ptr, value, ok, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=ok)


@triton.jit
def _fwd_tile_split(
    tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc, sy0, sy1, sy2, syc,
    scale, fill, keep_scale, threshold, k0, k1, stream,
    MASK: tl.constexpr, ZERO_MASKED: tl.constexpr, DROPOUT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr,
    MASK_SHARED: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """`_fwd_tile` with the tile held as [ROWS, SPLIT, BLOCK // SPLIT]: column j * (BLOCK // SPLIT) + c of row
    r at [r, j, c]. BLOCK // SPLIT is what one warp's lanes cover with 16-byte vectors, so the compiler's
    layout puts the SPLIT pieces of a row in one thread and the warps along the rows: the row max and sum
    need no exchange between warps (no shared memory, no barrier), where the [ROWS, BLOCK] tile spreads a row
    over warps. EVEN: every tile is whole (no bounds predicates); SCALED: scale is not 1 (else no multiply).
    Same arithmetic as `_fwd_tile_flat`; the row sum adds the pieces first (another order)."""
    PIECE: tl.constexpr = BLOCK // SPLIT
    first = widen(tile, I64) * ROWS
    rows = first + tl.arange(0, ROWS)
    xo = _row_offsets(rows, D1, D2, sx0, sx1, sx2)[:, None, None]
    yo = _row_offsets(rows, D1, D2, sy0, sy1, sy2)[:, None, None]
    piece = widen(tl.arange(0, SPLIT), I64)[None, :, None] * PIECE
    cols = piece + widen(tl.arange(0, PIECE), I64)[None, None, :]
    ok = (rows < n_rows)[:, None, None] & (cols < n_cols)
    s = _load_tile(X + xo + cols * sxc, ok, 0.0, EVEN).to(tl.float32)
    if SCALED:
        s = s * scale
    masked = ok & False
    if MASK != 0:
        if MASK_SHARED:  # one mask row for the whole tile (each warp's loads of it hit L1)
            mo = tl.broadcast_to(_row_offsets(first, D1, D2, sm0, sm1, sm2), (ROWS, 1, 1))
        else:
            mo = _row_offsets(rows, D1, D2, sm0, sm1, sm2)[:, None, None]
        # Runs of 8 columns, as far as the compiler knows: it then loads the mask 8 elements a thread, in
        # x's layout (16 bytes of bool take another layout and a shuffle through shared memory).
        mv = _load_tile(M + mo + (cols // 8 * 8 + cols % 8) * smc, ok, 0, EVEN)
        if MASK == 1:
            masked = mv != 0
            if not EVEN:
                masked = masked & ok
            s = tl.where(masked, fill, s)
        else:
            s = s + mv.to(tl.float32)
    if not EVEN:
        s = tl.where(ok, s, float("-inf"))
    m = tl.max(tl.max(s, axis=1), axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)[:, None, None]
    e = tl.exp(s - m)
    den = tl.sum(tl.sum(e, axis=1), axis=1)
    p = e * tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)[:, None, None]
    if ZERO_MASKED:
        p = tl.where(masked, 0.0, p)
    yoff = yo + cols * syc
    if DROPOUT:
        _store_tile(P + yoff, rne_bf16(p, RNE).to(P.dtype.element_ty), ok, EVEN)
        keep = tl.reshape(
            keep_mask(k0, k1, stream, threshold, rows, 0, ROWS, BLOCK, INTERLEAVE), (ROWS, SPLIT, PIECE)
        )
        p = tl.where(keep, p * keep_scale, 0.0)
    _store_tile(Y + yoff, rne_bf16(p, RNE).to(Y.dtype.element_ty), ok, EVEN)


@triton.jit(do_not_specialize=["k0", "k1", "stream", "threshold"])
def masked_softmax_fwd_kernel(
    X,
    M,
    Y,
    P,
    n_rows,
    n_cols,
    D1,
    D2,
    sx0,
    sx1,
    sx2,
    sxc,
    sm0,
    sm1,
    sm2,
    smc,
    sy0,
    sy1,
    sy2,
    syc,
    scale,
    fill,
    keep_scale,
    threshold,
    k0,
    k1,
    stream,
    SEED,
    MASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOPED: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    SEED_PTR: tl.constexpr,
    PERSISTENT: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN: tl.constexpr,
    SCALED: tl.constexpr,
):
    """LOOPED: one tile of ROWS rows per program, its rows read in BLOCK-column pieces (twice). Otherwise
    each row is held whole: one tile per program, or with PERSISTENT a grid of fewer programs each looping
    over tiles (tl.range with STAGES pipelines the next tile's loads)."""
    k0, k1, stream = seed_words(SEED, k0, k1, stream, SEED_PTR)
    if LOOPED:
        rows = widen(tl.program_id(0), I64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        xo = _row_offsets(rows, D1, D2, sx0, sx1, sx2)
        mo = _mask_row_offsets(rows, widen(tl.program_id(0), I64) * ROWS, D1, D2, sm0, sm1, sm2, MASK_SHARED)
        yo = _row_offsets(rows, D1, D2, sy0, sy1, sy2)
        # Pass 1: running max and sum per lane (online softmax), merged across lanes at the end.
        m_i = tl.full((ROWS, BLOCK), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS, BLOCK), tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < n_cols)[None, :]
            s, masked = _scores(X, M, xo, mo, cols, ok, n_cols, sxc, smc, scale, fill, MASK, I64, MASK_SHARED)
            m_new = tl.maximum(m_i, s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.exp(s - m_safe)
            m_i = m_new
        m = tl.max(m_i, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        den = tl.sum(l_i * tl.exp(m_i - m[:, None]), axis=1)
        inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
        # Pass 2: normalise and write (the second read of the row mostly hits L2).
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < n_cols)[None, :]
            s, masked = _scores(X, M, xo, mo, cols, ok, n_cols, sxc, smc, scale, fill, MASK, I64, MASK_SHARED)
            p = tl.exp(s - m[:, None]) * inv[:, None]
            if ZERO_MASKED:
                p = tl.where(masked, 0.0, p)
            yoff = yo[:, None] + widen(cols, I64)[None, :] * syc
            if DROPOUT:
                tl.store(P + yoff, rne_bf16(p, RNE).to(P.dtype.element_ty), mask=ok)
                keep = keep_mask(k0, k1, stream, threshold, rows, c0, ROWS, BLOCK, INTERLEAVE)
                p = tl.where(keep, p * keep_scale, 0.0)
            tl.store(Y + yoff, rne_bf16(p, RNE).to(Y.dtype.element_ty), mask=ok)
    elif PERSISTENT:
        n_tiles = tl.cdiv(n_rows, ROWS)
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            _fwd_tile(
                tile, X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
                sy0, sy1, sy2, syc, scale, fill, keep_scale, threshold, k0, k1, stream,
                MASK, ZERO_MASKED, DROPOUT, ROWS, BLOCK, INTERLEAVE, RNE, I64, MASK_SHARED, SPLIT, EVEN, SCALED,
            )  # fmt: skip
    else:
        _fwd_tile(
            tl.program_id(0), X, M, Y, P, n_rows, n_cols, D1, D2, sx0, sx1, sx2, sxc, sm0, sm1, sm2, smc,
            sy0, sy1, sy2, syc, scale, fill, keep_scale, threshold, k0, k1, stream,
            MASK, ZERO_MASKED, DROPOUT, ROWS, BLOCK, INTERLEAVE, RNE, I64, MASK_SHARED, SPLIT, EVEN, SCALED,
        )  # fmt: skip


@triton.jit
def _grad_terms(
    P,
    DY,
    M,
    po,
    dyo,
    mo,
    cols,
    ok,
    n_cols,
    spc,
    sdyc,
    smc,
    keep_scale,
    k0,
    k1,
    stream,
    threshold,
    rows,
    c0,
    MASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    I64: tl.constexpr,
    MASK_SHARED: tl.constexpr,
):
    """(P, dp, bool mask) for one tile: dp is the gradient reaching the softmax output."""
    c = widen(cols, I64)[None, :]
    p = tl.load(P + po[:, None] + c * spc, mask=ok, other=0.0).to(tl.float32)
    dp = tl.load(DY + dyo[:, None] + c * sdyc, mask=ok, other=0.0).to(tl.float32)
    masked = ok & False
    if MASK == 1:
        masked = _load_mask(M, mo, cols, ok, n_cols, smc, 0, I64, MASK_SHARED) != 0
    if DROPOUT:
        keep = keep_mask(k0, k1, stream, threshold, rows, c0, ROWS, BLOCK, INTERLEAVE)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    if ZERO_MASKED:
        dp = tl.where(masked, 0.0, dp)
    return p, dp, masked


@triton.jit(do_not_specialize=["k0", "k1", "stream", "threshold"])
def masked_softmax_bwd_kernel(
    P,
    DY,
    M,
    DX,
    n_rows,
    n_cols,
    D1,
    D2,
    sp0,
    sp1,
    sp2,
    spc,
    sdy0,
    sdy1,
    sdy2,
    sdyc,
    sm0,
    sm1,
    sm2,
    smc,
    sdx0,
    sdx1,
    sdx2,
    sdxc,
    scale,
    keep_scale,
    threshold,
    k0,
    k1,
    stream,
    SEED,
    MASK: tl.constexpr,
    ZERO_MASKED: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOPED: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    MASK_SHARED: tl.constexpr,
    SEED_PTR: tl.constexpr,
):
    k0, k1, stream = seed_words(SEED, k0, k1, stream, SEED_PTR)
    rows = widen(tl.program_id(0), I64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    po = _row_offsets(rows, D1, D2, sp0, sp1, sp2)
    dyo = _row_offsets(rows, D1, D2, sdy0, sdy1, sdy2)
    mo = _mask_row_offsets(rows, widen(tl.program_id(0), I64) * ROWS, D1, D2, sm0, sm1, sm2, MASK_SHARED)
    dxo = _row_offsets(rows, D1, D2, sdx0, sdx1, sdx2)
    if LOOPED:
        acc = tl.zeros((ROWS, BLOCK), tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < n_cols)[None, :]
            p, dp, masked = _grad_terms(
                P,
                DY,
                M,
                po,
                dyo,
                mo,
                cols,
                ok,
                n_cols,
                spc,
                sdyc,
                smc,
                keep_scale,
                k0,
                k1,
                stream,
                threshold,
                rows,
                c0,
                MASK,
                ZERO_MASKED,
                DROPOUT,
                ROWS,
                BLOCK,
                INTERLEAVE,
                I64,
                MASK_SHARED,
            )
            acc += p * dp
        dot = tl.sum(acc, axis=1)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < n_cols)[None, :]
            p, dp, masked = _grad_terms(
                P,
                DY,
                M,
                po,
                dyo,
                mo,
                cols,
                ok,
                n_cols,
                spc,
                sdyc,
                smc,
                keep_scale,
                k0,
                k1,
                stream,
                threshold,
                rows,
                c0,
                MASK,
                ZERO_MASKED,
                DROPOUT,
                ROWS,
                BLOCK,
                INTERLEAVE,
                I64,
                MASK_SHARED,
            )
            ds = p * (dp - dot[:, None])
            if MASK == 1:
                ds = tl.where(masked, 0.0, ds)
            dxoff = dxo[:, None] + widen(cols, I64)[None, :] * sdxc
            tl.store(DX + dxoff, rne_bf16(ds * scale, RNE).to(DX.dtype.element_ty), mask=ok)
    else:
        cols = tl.arange(0, BLOCK)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        p, dp, masked = _grad_terms(
            P,
            DY,
            M,
            po,
            dyo,
            mo,
            cols,
            ok,
            n_cols,
            spc,
            sdyc,
            smc,
            keep_scale,
            k0,
            k1,
            stream,
            threshold,
            rows,
            0,
            MASK,
            ZERO_MASKED,
            DROPOUT,
            ROWS,
            BLOCK,
            INTERLEAVE,
            I64,
            MASK_SHARED,
        )
        dot = tl.sum(p * dp, axis=1)
        ds = p * (dp - dot[:, None])
        if MASK == 1:
            ds = tl.where(masked, 0.0, ds)
        dxoff = dxo[:, None] + widen(cols, I64)[None, :] * sdxc
        tl.store(DX + dxoff, rne_bf16(ds * scale, RNE).to(DX.dtype.element_ty), mask=ok)
