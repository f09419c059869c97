"""The chains fuse_region rewrites, at the sizes of the two region models, against their fixes and the floor.

    python benchmarks/regions_kernels.py --out $OUT/regions_kernels.md

Per chain, forward + backward (`triton.testing.do_bench`, median ms, launches included): the chain as
written by hand (eager), the same under torch.compile, the fix opadvisor writes, and the floor: the bytes
one fused pass must read and write each way at this device's measured copy bandwidth.

- tanh GELU by hand vs F.gelu(approximate="tanh"), [8192, 3072] bf16 (GPT-2 small's MLP, batch 8 x 1024)
- QuickGELU by hand vs opadvisor.kernels.quick_gelu, the same size
- DeBERTa's XDropout (bernoulli mask, masked_fill, scale) vs opadvisor.kernels.dropout, on attention
  probabilities [8, 12, 512, 512] float32 and hidden states [8, 512, 768] bf16
- DeBERTa's relative-position scores (two gathers, transpose, two scalings, a sum) vs
  opadvisor.kernels.disentangled_bias, [96, 512, 512] bf16 out of [96, 512, 512] tables, its backward as
  atomic scatter-adds (relpos.BACKWARD "atomic") and as segmented sums ("runs")
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def copy_gbps() -> float:
    from opadvisor.profile.runner import copy_bandwidth_gbps

    return copy_bandwidth_gbps() or float("nan")


def fwd_bwd(fn, inputs):
    """A closure running fn forward and backward on fresh leaves of `inputs` (same values every call)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    grad = torch.randn_like(out)

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)

    return run


def bench(run) -> float:
    from triton.testing import do_bench

    return do_bench(run, warmup=25, rep=100)


def gelu_by_hand(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def quick_gelu_by_hand(x):
    return x * torch.sigmoid(1.702 * x)


class XDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, drop_prob):
        mask = (1 - torch.empty_like(input).bernoulli_(1 - drop_prob)).to(torch.bool)
        ctx.scale = 1.0 / (1 - drop_prob)
        ctx.save_for_backward(mask)
        return input.masked_fill(mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad_output):
        (mask,) = ctx.saved_tensors
        return grad_output.masked_fill(mask, 0) * ctx.scale, None


def relpos_by_hand(c2p, p2c, ci, pi, scale):
    n, s = c2p.shape[0], c2p.shape[1]
    score = torch.gather(c2p, dim=-1, index=ci.expand([n, s, s])) / scale
    score += torch.gather(p2c, dim=-1, index=pi.expand([n, s, s])).transpose(-1, -2) / scale
    return score


def cases(dev: str):
    from opadvisor import kernels

    g = torch.Generator(device=dev).manual_seed(0)
    act = torch.randn(8192, 3072, device=dev, generator=g).bfloat16()
    probs = torch.rand(8, 12, 512, 512, device=dev, generator=g)
    hidden = torch.randn(8, 512, 768, device=dev, generator=g).bfloat16()
    n, s, span = 96, 512, 256
    c2p = torch.randn(n, s, 2 * span, device=dev, generator=g).bfloat16()
    p2c = torch.randn(n, s, 2 * span, device=dev, generator=g).bfloat16()
    rel = torch.arange(s, device=dev)[:, None] - torch.arange(s, device=dev)[None, :]
    ci = torch.clamp(rel + span, 0, 2 * span - 1)
    pi = torch.clamp(-rel + span, 0, 2 * span - 1)
    scale = math.sqrt(64 * 3)
    e = act.numel() * 2
    relpos_floor = (2 * c2p.numel() * 2 + n * s * s * 2) * 2  # read both tables, write out; backward mirrors
    return [
        ("tanh GELU [8192, 3072] bf16", gelu_by_hand, lambda x: F.gelu(x, approximate="tanh"), [act], 2 * e + 3 * e),
        ("QuickGELU [8192, 3072] bf16", quick_gelu_by_hand, kernels.quick_gelu, [act], 2 * e + 3 * e),
        ("dropout p=0.1 [8, 12, 512, 512] fp32", lambda x: XDropout.apply(x, 0.1),
         lambda x: kernels.dropout(x, 0.1), [probs], 4 * probs.numel() * 4),
        ("dropout p=0.1 [8, 512, 768] bf16", lambda x: XDropout.apply(x, 0.1),
         lambda x: kernels.dropout(x, 0.1), [hidden], 4 * hidden.numel() * 2),
        ("relative-position scores [96, 512, 512] bf16", lambda a, b: relpos_by_hand(a, b, ci, pi, scale),
         lambda a, b: kernels.disentangled_bias(a, b, ci, pi, scale), [c2p, p2c], relpos_floor),
        ("relative-position scores, backward runs", lambda a, b: relpos_by_hand(a, b, ci, pi, scale),
         lambda a, b: kernels.disentangled_bias(a, b, ci, pi, scale), [c2p, p2c], relpos_floor,
         {"BACKWARD": "runs"}),
    ]  # fmt: skip


@contextlib.contextmanager
def relpos_settings(settings: dict):
    """opadvisor.kernels.relpos's switches set for one row, restored after."""
    from opadvisor.kernels import relpos

    saved = {name: getattr(relpos, name) for name in settings}
    for name, value in settings.items():
        setattr(relpos, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(relpos, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="skip the torch.compile column"
    )
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/regions_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    bw = copy_gbps()
    lines = [
        f"## fuse_region's chains, forward + backward ({torch.cuda.get_device_name(0)})",
        "",
        f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; copy bandwidth measured {bw:.0f} GB/s",
        "- command: python benchmarks/regions_kernels.py" + (" --no-compile" if not opts.compile else ""),
        "- do_bench median, ms, launches included; floor: the bytes one fused pass reads and writes each way",
        "",
        "| chain | by hand, eager | by hand, torch.compile | opadvisor's fix | floor | fix vs by hand |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, by_hand, fix, inputs, floor_bytes, *settings in cases("cuda"):
        t_hand = bench(fwd_bwd(by_hand, inputs))
        t_comp = float("nan")
        if opts.compile:
            try:
                t_comp = bench(fwd_bwd(torch.compile(by_hand), inputs))
            except Exception as exc:  # noqa: BLE001 - a chain dynamo cannot compile is a result too
                print(f"{name}: torch.compile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        with relpos_settings(settings[0] if settings else {}):
            t_fix = bench(fwd_bwd(fix, inputs))
        floor = floor_bytes / (bw * 1e9) * 1e3
        lines.append(
            f"| {name} | {t_hand:.3f} | {t_comp:.3f} | {t_fix:.3f} | {floor:.3f} | {t_hand / t_fix:.2f}x |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    if opts.out:
        opts.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
