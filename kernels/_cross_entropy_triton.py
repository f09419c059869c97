"""Triton kernels of `cross_entropy` (imported only when a kernel launches; see `cross_entropy.py`).

One program per row of the logits X [N, C] (any row stride, unit column stride), looping over the
classes in blocks of BLOCK; math in float32 whatever the storage dtype. Offsets are int64 where a tensor
reaches 2**31 elements (I64), int32 otherwise.

Forward, per row i with target t = T[i]:
    lse_i  = log(sum_j exp(x_ij))    (one pass: online max / sum-exp per group of GROUP classes,
                                      `_row_lse_grouped`, or per class with GROUP 0, `_row_lse`)
    loss_i = lse_i - x_it,  0 when t == ignore_index, NaN when t is outside [0, C)
    LSE[i] = lse_i (saved for the backward), LOSS[i] = loss_i (float32), and with COUNT VALID[i] = 1.0 if
    t != ignore_index else 0.0; for "mean" and "sum" `cross_entropy_reduce_kernel` then sums them (LOSS and
    VALID are two rows of one buffer) and writes the loss, divided by the count for "mean"
Backward, with g_i = G[i * sg] (the upstream gradient; for "mean" (MEAN) divided here by COUNT[0]):
    dx_ij = (exp(x_ij - lse_i) - [j == t]) * g_i,  0 for ignored rows, NaN for out-of-range targets
    DX has X's row stride when X's rows do not overlap (a column slice of a padded tensor gives a
    gradient laid out the same way: 16-byte aligned rows, vector stores), else C.
Ignored rows are not read at all (in masked-LM training most rows are), in both directions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import rne_bf16, widen


@triton.jit
def _lse_step(X, xo, c0, n_cols, m_i, l_i, BLOCK: tl.constexpr, MASKED: tl.constexpr, I64: tl.constexpr):
    """Fold the block of columns c0 .. c0 + BLOCK - 1 into the lanes' running max m_i and sum l_i.

    A new value s moves a lane's max only when it is larger, so one exponential serves both cases: with
    e = exp(-|s - m|), l becomes l * e + 1 (new max) or l + e (not). One exp per element instead of the
    two of the usual rescaling: at the H200's bandwidth two would make the kernel bound by them."""
    cols = c0 + tl.arange(0, BLOCK)
    ptrs = X + xo + widen(cols, I64)
    if MASKED:
        s = tl.load(ptrs, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    else:
        s = tl.load(ptrs).to(tl.float32)
    d = s - m_i
    e = tl.exp(-tl.abs(d))
    l_i = tl.where(d > 0, l_i * e + 1.0, l_i + e)
    return tl.maximum(m_i, s), l_i


@triton.jit
def _row_lse(X, xo, n_cols, BLOCK: tl.constexpr, I64: tl.constexpr):
    """log-sum-exp of the row at X + xo, in one read: per-lane online max / sum (`_lse_step`), lanes
    merged at the end.

    Whole blocks load unmasked (a mask that ends mid-vector, as at 30522 columns, would stop Triton from
    vectorising every load of the row); the last, partial block is masked. m starts at -FLT_MAX rather
    than -inf so that the masked tail and -inf logits give exp(-inf) = 0 without an inf - inf; a row of
    -inf only gives lse = -inf (loss NaN, as PyTorch's), +inf or NaN logits give NaN.
    """
    m_i = tl.full((BLOCK,), -3.4028234663852886e38, tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    n_full = n_cols - n_cols % BLOCK
    for c0 in range(0, n_full, BLOCK):
        m_i, l_i = _lse_step(X, xo, c0, n_cols, m_i, l_i, BLOCK, False, I64)
    for c0 in range(n_full, n_cols, BLOCK):  # at most once
        m_i, l_i = _lse_step(X, xo, c0, n_cols, m_i, l_i, BLOCK, True, I64)
    m = tl.max(m_i, axis=0)
    return m + tl.log(tl.sum(l_i * tl.exp(m_i - m), axis=0))


@triton.jit
def _group_step(
    X, xo, c0, n_cols, m_g, l_g, BLOCK: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr, I64: tl.constexpr
):  # fmt: skip
    """Fold the columns c0 .. c0 + BLOCK - 1, as [BLOCK // GROUP, GROUP] (GROUP consecutive columns per
    row of the tile: one thread's vector where the row is 16-byte aligned), into each group's running max
    m_g and sum l_g of exp(x - m_g).

    Per element: a max, a subtraction and one exp (the group's max is taken first, in-thread); per group
    and block one exp more to rescale l_g. `_lse_step` spends about twice the instructions per element
    (its max and sum are per element), which made the forward bound by them rather than by memory."""
    cols = c0 + tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ptrs = X + xo + widen(cols, I64)
    if MASKED:
        s = tl.load(ptrs, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    else:
        s = tl.load(ptrs).to(tl.float32)
    m_new = tl.maximum(m_g, tl.max(s, axis=1))
    # A group of -inf only (masked, or -inf logits) keeps m = -inf: shift by 0 there, exp(-inf) = 0.
    off = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_g = l_g * tl.exp(m_g - off) + tl.sum(tl.exp(s - off[:, None]), axis=1)
    return m_new, l_g


@triton.jit
def _row_lse_grouped(X, xo, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr, I64: tl.constexpr):
    """log-sum-exp of the row at X + xo in one read, with a running max / sum per group of GROUP columns
    (`_group_step`), groups merged at the end. Whole blocks load unmasked, the last partial one masked
    (as `_row_lse`). A row of -inf gives -inf (loss NaN, as PyTorch's), +inf or NaN logits give NaN."""
    m_g = tl.full((BLOCK // GROUP,), float("-inf"), tl.float32)
    l_g = tl.zeros((BLOCK // GROUP,), tl.float32)
    n_full = n_cols - n_cols % BLOCK
    for c0 in range(0, n_full, BLOCK):
        m_g, l_g = _group_step(X, xo, c0, n_cols, m_g, l_g, BLOCK, GROUP, False, I64)
    for c0 in range(n_full, n_cols, BLOCK):  # at most once
        m_g, l_g = _group_step(X, xo, c0, n_cols, m_g, l_g, BLOCK, GROUP, True, I64)
    m = tl.max(m_g, axis=0)
    off = tl.where(m == float("-inf"), 0.0, m)
    return off + tl.log(tl.sum(l_g * tl.exp(m_g - off), axis=0))


@triton.jit
def cross_entropy_fwd_kernel(
    X,
    T,
    LOSS,
    LSE,
    VALID,
    n_cols,
    sx0,
    st0,
    ignore_index,
    BLOCK: tl.constexpr,
    I64: tl.constexpr,
    COUNT: tl.constexpr,
    GROUP: tl.constexpr,
):
    """GROUP: columns per running max / sum (`_row_lse_grouped`); 0: one per column (`_row_lse`)."""
    row = widen(tl.program_id(0), I64)
    t = tl.load(T + row * st0)
    if COUNT:
        tl.store(VALID + row, tl.where(t != ignore_index, 1.0, 0.0))
    if t != ignore_index:
        xo = row * sx0
        if GROUP == 0:
            lse = _row_lse(X, xo, n_cols, BLOCK, I64)
        else:
            lse = _row_lse_grouped(X, xo, n_cols, BLOCK, GROUP, I64)
        in_range = (t >= 0) & (t < n_cols)
        # An out-of-range target is never read (index 0 instead) and gives NaN: no host check, no sync.
        x_t = tl.load(X + xo + tl.where(in_range, t, 0)).to(tl.float32)
        tl.store(LSE + row, lse)
        tl.store(LOSS + row, tl.where(in_range, lse - x_t, float("nan")))
    else:
        tl.store(LSE + row, 0.0)
        tl.store(LOSS + row, 0.0)


@triton.jit
def _grad_step(
    X, DX, xo, do, c0, n_cols, lse, g, tc, bad,
    BLOCK: tl.constexpr, MASKED: tl.constexpr, ZERO: tl.constexpr, RNE: tl.constexpr, I64: tl.constexpr,
):  # fmt: skip
    """dx for the columns c0 .. c0 + BLOCK - 1 of one row (ZERO: an ignored row, x not read)."""
    cols = c0 + tl.arange(0, BLOCK)
    c = widen(cols, I64)
    ok = cols < n_cols
    if ZERO:
        dx = tl.zeros((BLOCK,), tl.float32)
    else:
        if MASKED:
            x = tl.load(X + xo + c, mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(X + xo + c).to(tl.float32)
        dx = (tl.exp(x - lse) - tl.where(cols == tc, 1.0, 0.0)) * g + bad
    dx = rne_bf16(dx, RNE).to(DX.dtype.element_ty)
    if MASKED:
        tl.store(DX + do + c, dx, mask=ok)
    else:
        tl.store(DX + do + c, dx)


@triton.jit
def cross_entropy_bwd_kernel(
    X,
    T,
    LSE,
    G,
    COUNT,
    DX,
    n_cols,
    sx0,
    sdx0,
    st0,
    sg0,
    ignore_index,
    BLOCK: tl.constexpr,
    RNE: tl.constexpr,
    I64: tl.constexpr,
    MEAN: tl.constexpr,
):
    """DX [N, C] (row stride sdx0, unit column stride) in its own dtype, rounded once from float32."""
    row = widen(tl.program_id(0), I64)
    t = tl.load(T + row * st0)
    xo = row * sx0
    do = row * sdx0
    n_full = n_cols - n_cols % BLOCK
    if t != ignore_index:
        lse = tl.load(LSE + row)
        g = tl.load(G + row * sg0).to(tl.float32)
        if MEAN:
            g = g / tl.load(COUNT)
        in_range = (t >= 0) & (t < n_cols)
        # In range, t < C < 2**31: compare in int32 against the int32 column indices.
        tc = tl.where(in_range, t, -1).to(tl.int32)
        bad = tl.where(in_range, 0.0, float("nan"))  # NaN gradient for an out-of-range target
        for c0 in range(0, n_full, BLOCK):
            _grad_step(X, DX, xo, do, c0, n_cols, lse, g, tc, bad, BLOCK, False, False, RNE, I64)
        for c0 in range(n_full, n_cols, BLOCK):  # at most once
            _grad_step(X, DX, xo, do, c0, n_cols, lse, g, tc, bad, BLOCK, True, False, RNE, I64)
    else:
        for c0 in range(0, n_full, BLOCK):
            _grad_step(X, DX, xo, do, c0, n_cols, 0.0, 0.0, 0, 0.0, BLOCK, False, True, RNE, I64)
        for c0 in range(n_full, n_cols, BLOCK):
            _grad_step(X, DX, xo, do, c0, n_cols, 0.0, 0.0, 0, 0.0, BLOCK, True, True, RNE, I64)


@triton.jit
def cross_entropy_reduce_kernel(
    ROWS, LOSS, COUNT, n_rows, BLOCK: tl.constexpr, MEAN: tl.constexpr, RNE: tl.constexpr
):  # fmt: skip
    """One program: LOSS[0] = sum of the per-row losses ROWS[0, :n_rows] ("sum"), or that sum over the
    count of rows not ignored, ROWS[1, :n_rows] summed into COUNT[0] ("mean": 0 / 0 gives NaN, as
    PyTorch), in LOSS's dtype, rounded once; float32 sums in a fixed order (deterministic)."""
    total = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.float32)
    for r0 in range(0, n_rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        ok = r < n_rows
        total += tl.load(ROWS + r, mask=ok, other=0.0)
        if MEAN:
            count += tl.load(ROWS + n_rows + r, mask=ok, other=0.0)
    loss = tl.sum(total, axis=0)
    if MEAN:
        n = tl.sum(count, axis=0)
        tl.store(COUNT, n)
        loss = loss / n
    tl.store(LOSS, rne_bf16(loss, RNE).to(LOSS.dtype.element_ty))
