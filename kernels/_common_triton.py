"""Triton helpers shared by the kernels (imported only when a kernel launches): the dropout stream of
`_rng`, row offsets, and rounding for stores."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 blocks (the rounds of Triton's own philox_impl, kept here so the
    stream does not change with the Triton version)."""
    PHILOX_KEY_A: tl.constexpr = 0x9E3779B9
    PHILOX_KEY_B: tl.constexpr = 0xBB67AE85
    PHILOX_ROUND_A: tl.constexpr = 0xD2511F53
    PHILOX_ROUND_B: tl.constexpr = 0xCD9E8D57
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.math.umulhi(PHILOX_ROUND_B, _c2) ^ c1 ^ k0
        c2 = tl.math.umulhi(PHILOX_ROUND_A, _c0) ^ c3 ^ k1
        c1 = tl.mul(PHILOX_ROUND_B, _c2, sanitize_overflow=False)
        c3 = tl.mul(PHILOX_ROUND_A, _c0, sanitize_overflow=False)
        k0 = tl.add(k0, PHILOX_KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def seed_words(SEED, k0, k1, stream, SEED_PTR: tl.constexpr):
    """(k0, k1, stream): the launch's integer arguments, or with SEED_PTR the three int32 words at SEED
    (a seed drawn on the device while a CUDA graph was captured, fresh at every replay; see `_rng`)."""
    if SEED_PTR:
        return tl.load(SEED), tl.load(SEED + 1), tl.load(SEED + 2)
    else:
        return k0, k1, stream


@triton.jit
def keep_mask(
    k0, k1, stream, threshold, rows, col0, ROWS: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr
):
    """Keep mask [ROWS, BLOCK] for `rows` (int32 or int64 [ROWS]) and columns col0 .. col0 + BLOCK - 1.

    col0 must be a multiple of 4. INTERLEAVE computes one Philox call per 4 columns and interleaves the
    4 words; otherwise each element runs its own call and picks its word (same bits, 4x the arithmetic).
    """
    rows = rows.to(tl.int64)
    r_lo = tl.broadcast_to((rows & 0xFFFFFFFF).to(tl.uint32)[:, None], (ROWS, BLOCK // 4))
    r_hi = tl.broadcast_to((rows >> 32).to(tl.uint32)[:, None], (ROWS, BLOCK // 4))
    key0 = k0.to(tl.uint32)
    key1 = k1.to(tl.uint32)
    if INTERLEAVE:
        quad = tl.broadcast_to(
            (col0 // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)[None, :], (ROWS, BLOCK // 4)
        )
        s = tl.zeros((ROWS, BLOCK // 4), dtype=tl.uint32) + stream.to(tl.uint32)
        w0, w1, w2, w3 = philox4x32(quad, r_lo, r_hi, s, key0, key1)
        words = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))
    else:
        cols = col0 + tl.arange(0, BLOCK)
        quad = tl.broadcast_to((cols // 4).to(tl.uint32)[None, :], (ROWS, BLOCK))
        lo = tl.broadcast_to((rows & 0xFFFFFFFF).to(tl.uint32)[:, None], (ROWS, BLOCK))
        hi = tl.broadcast_to((rows >> 32).to(tl.uint32)[:, None], (ROWS, BLOCK))
        s = tl.zeros((ROWS, BLOCK), dtype=tl.uint32) + stream.to(tl.uint32)
        w0, w1, w2, w3 = philox4x32(quad, lo, hi, s, key0, key1)
        which = (cols % 4)[None, :]
        words = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    return (words >> 1).to(tl.int32) >= threshold


@triton.jit
def widen(i, I64: tl.constexpr):
    """`i` as int64 when offsets may reach 2**31 (I64), else unchanged (int32 index math: 64-bit integer
    division, used for the row offsets below, costs several times as many instructions)."""
    if I64:
        return i.to(tl.int64)
    else:
        return i


@triton.jit
def row_offsets(rows, D1, D2, s0, s1, s2):
    """Offset (elements, in `rows`' integer type) of each row start, rows being flat indices over
    D0 x D1 x D2."""
    i2 = rows % D2
    t = rows // D2
    return (t // D1) * s0 + (t % D1) * s1 + i2 * s2


@triton.jit
def rne_bf16(v, EMULATE: tl.constexpr):
    """Round float32 `v` to the nearest bfloat16 value (ties to even), still as float32.

    Compiled kernels round when storing to bfloat16; Triton's interpreter truncates instead. With
    EMULATE (set by the launchers under the interpreter only) the rounding happens here, so the
    interpreter produces the GPU's bits and the following store's truncation is exact.
    """
    if EMULATE:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v
