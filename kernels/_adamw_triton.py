"""Triton kernel of `AdamW` (imported only when a step launches; see `adamw.py`).

One launch updates every tensor of a group (one dtype, one step count): a multi-tensor step. The tensors
stay where the model keeps them; the launch finds them from one of them, BASE, and tables:

    OFFSETS         int64 [4, tensors]: where each parameter, gradient, exp_avg and exp_avg_sq starts, in
                    elements from BASE (each tensor contiguous, all four of a parameter of one size)
    NUMEL           int64 [tensors]: their sizes
    FIRST_BLOCK     int32 [tensors]: the index of each tensor's first block
    BLOCK_TENSOR    int32 [blocks]: the tensor a program updates (its BLOCK elements follow from the two)

Addresses as offsets from a kernel argument, not as pointers loaded from a table: Triton then knows BASE's
alignment, and with ALIGNED (every tensor starts on 16 bytes, as the caching allocator places them) the
offsets' too, so it can move 16 bytes per load and store; a full block runs without a mask (a mask whose
bound is read from memory would also stop that), the one partial block of a tensor with it.

Per element, in float32 whatever the storage dtype (torch's fused AdamW, `_fused_adamw`, step for step):
    p = p - lr_wd * p                                     (decoupled weight decay; lr_wd = lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)    (step_size = lr / (1 - beta1^t), bc2_sqrt =
                                                            sqrt(1 - beta2^t), computed on the host)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common_triton import rne_bf16


@triton.jit
def _offset(OFFSETS, kind, t, n_tensors, VEC: tl.constexpr, ALIGNED: tl.constexpr):
    """Where tensor t's parameter (kind 0), gradient (1), exp_avg (2) or exp_avg_sq (3) starts."""
    off = tl.load(OFFSETS + kind * n_tensors + t)
    if ALIGNED:
        off = tl.multiple_of(off, VEC)
    return off


@triton.jit
def _update(
    BASE, po, go, mo, vo, idx, ok,
    lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
    MASKED: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    if MASKED:
        p = tl.load(BASE + po + idx, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(BASE + go + idx, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(BASE + mo + idx, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(BASE + vo + idx, mask=ok, other=0.0).to(tl.float32)
    else:
        p = tl.load(BASE + po + idx).to(tl.float32)
        g = tl.load(BASE + go + idx).to(tl.float32)
        m = tl.load(BASE + mo + idx).to(tl.float32)
        v = tl.load(BASE + vo + idx).to(tl.float32)
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE square root and divisions (Triton's `/` and tl.sqrt are approximate), as torch's kernel computes
    p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    p = rne_bf16(p, RNE).to(BASE.dtype.element_ty)
    m = rne_bf16(m, RNE).to(BASE.dtype.element_ty)
    v = rne_bf16(v, RNE).to(BASE.dtype.element_ty)
    if MASKED:
        tl.store(BASE + po + idx, p, mask=ok)
        tl.store(BASE + mo + idx, m, mask=ok)
        tl.store(BASE + vo + idx, v, mask=ok)
    else:
        tl.store(BASE + po + idx, p)
        tl.store(BASE + mo + idx, m)
        tl.store(BASE + vo + idx, v)


@triton.jit
def adamw_kernel(
    BASE, OFFSETS, NUMEL, FIRST_BLOCK, BLOCK_TENSOR, n_tensors,
    lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
    BLOCK: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    start = (pid - tl.load(FIRST_BLOCK + t)).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    n = tl.load(NUMEL + t)
    po = _offset(OFFSETS, 0, t, n_tensors, VEC, ALIGNED)
    go = _offset(OFFSETS, 1, t, n_tensors, VEC, ALIGNED)
    mo = _offset(OFFSETS, 2, t, n_tensors, VEC, ALIGNED)
    vo = _offset(OFFSETS, 3, t, n_tensors, VEC, ALIGNED)
    if start + BLOCK <= n:
        _update(BASE, po, go, mo, vo, idx, idx < n, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps, False, RNE)
    else:
        _update(BASE, po, go, mo, vo, idx, idx < n, lr_wd, beta1, beta2, step_size, bc2_sqrt, eps, True, RNE)
