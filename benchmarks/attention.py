"""Attention with a padding mask: which SDPA backend runs, and what each costs, forward and backward.

    python benchmarks/attention.py [--batch 16 --heads 12 --seq 512 --head-dim 64]

The BERT example's attention after `opadvisor apply --rule sdpa_attention`: q, k, v [B, H, S, D] bf16 and a
[B, 1, 1, S] padding mask. Times (triton.testing.do_bench, median ms) of forward+backward for: the manual
chain; SDPA with no mask; with the boolean mask; with the same mask as an additive bf16 bias; each under the
default choice and forced to each backend (flash, efficient, cudnn, math), "-" where the backend refuses.
A diagnostic for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def manual(q, k, v, mask, p):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    a = F.softmax(s, dim=-1).masked_fill(~mask, 0.0)
    return F.dropout(a, p) @ v


def fwd_bwd(fn, q, k, v, dy):
    out = fn()
    torch.autograd.grad(out, (q, k, v), dy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    o = ap.parse_args()
    B, H, S, D = o.batch, o.heads, o.seq, o.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    dy = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.randint(S // 2, S + 1, (B,), device="cuda", generator=g)
    keep = (torch.arange(S, device="cuda")[None, :] < lengths[:, None]).view(B, 1, 1, S)
    bias = torch.zeros(B, 1, 1, S, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    p = o.dropout
    print(f"q/k/v [{B},{H},{S},{D}] bf16, mask [{B},1,1,{S}], dropout {p}; fwd+bwd ms (do_bench median)")
    print(
        f"manual chain (eager): {do_bench(lambda: fwd_bwd(lambda: manual(q, k, v, keep, p), q, k, v, dy)):.3f}"
    )
    cases = {
        "no mask": dict(),
        "bool mask": dict(attn_mask=keep),
        "additive bf16 mask": dict(attn_mask=bias),
    }
    backends = {
        "default": None,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    for case, kw in cases.items():
        cells = []
        for name, backend in backends.items():

            def call(kw=kw):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kw)

            try:
                if backend is None:
                    ms = do_bench(lambda call=call: fwd_bwd(call, q, k, v, dy))
                else:
                    with sdpa_kernel(backend):
                        ms = do_bench(lambda call=call: fwd_bwd(call, q, k, v, dy))
                cells.append(f"{name} {ms:.3f}")
            except RuntimeError as exc:
                cells.append(f"{name} - ({str(exc).splitlines()[0][:60]})")
        print(f"SDPA, {case}: " + "; ".join(cells), flush=True)
    # what the default picks: the kernel names of one fwd+bwd
    for case, kw in cases.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fwd_bwd(lambda kw=kw: F.scaled_dot_product_attention(q, k, v, dropout_p=p, **kw), q, k, v, dy)
            torch.cuda.synchronize()
        names = sorted(
            {e.name[:70] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
        )
        print(f"default kernels, {case}: {names}")


if __name__ == "__main__":
    main()
