"""Triton kernel of `AdamW` (imported only when a step launches; see `adamw.py`).

One launch updates every tensor of a group (one dtype, one step count): a multi-tensor step. The tensors
stay where the model keeps them; the launch reads their addresses from tables:

    P, G, M, V        int64 [tensors]: the addresses of the parameters, gradients, exp_avg and exp_avg_sq
    NUMEL             int64 [tensors]: their sizes (each tensor contiguous, all four of one size)
    BLOCK_TENSOR      int32 [blocks]: the tensor a program updates
    BLOCK_START       int64 [blocks]: the first element it updates (BLOCK elements from there)

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
def adamw_kernel(
    P, G, M, V, NUMEL, BLOCK_TENSOR, BLOCK_START,
    lr_wd, beta1, beta2, step_size, bc2_sqrt, eps,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    idx = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    ok = idx < tl.load(NUMEL + t)
    p_ptr = tl.load(P + t).to(tl.pointer_type(DTYPE))
    g_ptr = tl.load(G + t).to(tl.pointer_type(DTYPE))
    m_ptr = tl.load(M + t).to(tl.pointer_type(DTYPE))
    v_ptr = tl.load(V + t).to(tl.pointer_type(DTYPE))
    p = tl.load(p_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    p = p - lr_wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # IEEE square root and divisions (Triton's `/` and tl.sqrt are approximate), as torch's kernel computes
    p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(p_ptr + idx, rne_bf16(p, RNE).to(DTYPE), mask=ok)
    tl.store(m_ptr + idx, rne_bf16(m, RNE).to(DTYPE), mask=ok)
    tl.store(v_ptr + idx, rne_bf16(v, RNE).to(DTYPE), mask=ok)
