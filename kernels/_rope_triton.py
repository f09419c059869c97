"""Triton kernel of `rotary_embedding` (imported only when a kernel launches; see `rope.py`).

One program per token (b, s): the token's cos / sin rows [D] are loaded once and applied to all its heads,
X [B, H, S, D] read through its strides (transformers' q and k are transposed views of [B, S, H, D]). With
x1, x2 the halves of a head's row and c1, c2, s1, s2 the halves of cos and sin:
    forward  (transformers' x * cos + rotate_half(x) * sin):  y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
    backward (BACKWARD, its transpose, on dy):                dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
Math in float32; Y is written contiguous [B, H, S, D] in its own dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import rne_bf16


@triton.jit
def rope_kernel(
    X, COS, SIN, Y, n_seq, n_heads, sxb, sxh, sxs, scb, scs, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    b = (token // n_seq).to(tl.int64)
    s = (token % n_seq).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    c_row = COS + b * scb + s * scs
    s_row = SIN + b * scb + s * scs
    c1 = tl.load(c_row + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + half + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + half + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for h0 in range(0, n_heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        ok = (h < n_heads)[:, None] & d_ok[None, :]
        x_row = X + b * sxb + s * sxs + h[:, None] * sxh
        x1 = tl.load(x_row + d[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + half + d[None, :], mask=ok, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        y_row = Y + ((b * n_heads + h[:, None]) * n_seq + s) * (2 * half)
        tl.store(y_row + d[None, :], rne_bf16(y1, RNE).to(Y.dtype.element_ty), mask=ok)
        tl.store(y_row + half + d[None, :], rne_bf16(y2, RNE).to(Y.dtype.element_ty), mask=ok)
