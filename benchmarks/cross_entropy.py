#!/usr/bin/env python3
"""Benchmark opadvisor.kernels.cross_entropy on a GPU against F.cross_entropy, eager and compiled.

    python3 benchmarks/cross_entropy.py [--out DIR] [--ignore-frac F] [--warmup N] [--reps N]

Per shape (bf16 logits, all under bf16 autocast as a training step runs its loss: the LM head's
[8192, 30522] as a column slice of a [8192, 30528] padded GEMM output, [4096, 50257] and [16384, 32000]
contiguous), forward and forward+backward: the median time over --reps calls timed by CUDA events after
--warmup calls, for eager `F.cross_entropy`, `torch.compile` of it, and opadvisor's `cross_entropy`; GB/s
over the bytes a fused implementation must move at least (forward reads the logits once; forward+backward
reads them twice and writes the gradient once); speedups; and the peak memory a forward+backward
allocates beyond its inputs (eager's float32 copies of the logits show there). Prints the table and
writes DIR/cross_entropy.md (DIR: --out, else $OUT, else benchmarks/).

The gradient is taken w.r.t. the logits as the loss sees them (the slice itself for the LM head), so the
times cover the loss alone, not the scatter of the slice's gradient into the padded GEMM output.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
# (label, rows, classes, padded row length or None)
SHAPES = [
    ("LM head: [8192, 30528][:, :30522]", 8192, 30522, 30528),
    ("[4096, 50257]", 4096, 50257, None),
    ("[16384, 32000]", 16384, 32000, None),
]


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median GPU time of `fn` in ms: CUDA events around each call, after `warmup` calls.

    Each call is synchronised before the next one starts, so an event pair measures that call alone; the
    logits (>= 500 MB) are far larger than L2, so no cache flush is needed between calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """MiB that one call of `fn` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def make_inputs(rows: int, classes: int, padded: int | None, ignore_frac: float):
    """(logits leaf requiring grad, targets): a column slice of a padded tensor when `padded` is set."""
    width = padded or classes
    full = torch.randn(rows, width, device="cuda", dtype=BF16) * 3
    logits = full[:, :classes].detach().requires_grad_()  # a leaf that keeps the slice's strides
    target = torch.randint(0, classes, (rows,), device="cuda")
    if ignore_frac > 0:
        target[torch.rand(rows, device="cuda") < ignore_frac] = -100
    return logits, target


def variants(ours) -> dict[str, Callable]:
    """The three implementations; compiled per shape with static shapes (a recompile for a new shape
    would otherwise make dynamo switch to a dynamic-shape graph)."""

    def eager(x, t):
        return F.cross_entropy(x, t)

    return {"eager": eager, "compile": torch.compile(eager, dynamic=False), "ours": ours}


def under_autocast(fn, *args):
    with torch.autocast("cuda", dtype=BF16):
        return fn(*args)


def fwd_call(fn, x, t) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return under_autocast(fn, x, t)

    return call


def fwd_bwd_call(fn, x, t) -> Callable[[], object]:
    def call():
        return torch.autograd.grad(under_autocast(fn, x, t), x)

    return call


def bench_shape(label, rows, classes, padded, args, ours) -> list[dict]:
    x, t = make_inputs(rows, classes, padded, args.ignore_frac)
    fns = variants(ours)
    loss = {name: under_autocast(fn, x, t).float() for name, fn in fns.items()}
    diff = max(abs(loss[n].item() - loss["eager"].item()) for n in loss)
    print(f"{label}: loss {loss['eager'].item():.5f}, max |diff| vs eager {diff:.2e}", flush=True)
    nbytes = rows * classes * x.element_size()
    out = []
    for mode, make, moved in (("fwd", fwd_call, nbytes), ("fwd+bwd", fwd_bwd_call, 3 * nbytes)):
        ms = {n: time_ms(make(fn, x, t), args.warmup, args.reps) for n, fn in fns.items()}
        mem = {n: peak_extra_mib(make(fn, x, t)) for n, fn in fns.items()}
        row = {"shape": label, "mode": mode, "bytes": moved, "ms": ms, "mib": mem}
        row["gbps"] = {n: moved / v / 1e6 for n, v in ms.items()}
        out.append(row)
        print(
            f"  {mode:7s} eager {ms['eager']:.3f} compile {ms['compile']:.3f} ours {ms['ours']:.3f} ms "
            f"({row['gbps']['ours']:.0f} GB/s, x{ms['eager'] / ms['ours']:.2f} eager, "
            f"x{ms['compile'] / ms['ours']:.2f} compile)",
            flush=True,
        )
    del x, t
    torch.cuda.empty_cache()
    return out


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}. "
        f"Command: `{env['command']}`.",
        "",
        "bf16 logits under bf16 autocast, targets with ignore_index on "
        f"{env['ignore_frac']:.0%} of the rows. Times: median ms over {env['reps']} calls (CUDA events, "
        f"after {env['warmup']} warm-up calls). GB/s: the logits read once (fwd), read twice and the "
        "gradient written once (fwd+bwd), over the time. Peak MiB: allocated beyond the inputs.",
        "",
        "| shape | pass | eager ms | compile ms | ours ms | eager GB/s | compile GB/s | ours GB/s "
        "| vs eager | vs compile | peak MiB eager | compile | ours |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms, gb, mib = r["ms"], r["gbps"], r["mib"]
        lines.append(
            f"| {r['shape']} | {r['mode']} | {ms['eager']:.3f} | {ms['compile']:.3f} | {ms['ours']:.3f} | "
            f"{gb['eager']:.0f} | {gb['compile']:.0f} | {gb['ours']:.0f} | "
            f"{ms['eager'] / ms['ours']:.2f}x | {ms['compile'] / ms['ours']:.2f}x | "
            f"{mib['eager']:.0f} | {mib['compile']:.0f} | {mib['ours']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"), help="folder for cross_entropy.md")
    ap.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of rows with ignore_index")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    ap.add_argument("--reps", type=int, default=30, help="timed calls (the median is reported)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cross_entropy.py needs a CUDA device (none is available)", file=sys.stderr)
        return 2

    import triton
    from opadvisor.kernels import cross_entropy

    ce = importlib.import_module("opadvisor.kernels.cross_entropy")
    ce.SMALL_CLASSES = 0  # time the kernel itself (every shape here is far above the threshold anyway)
    torch.manual_seed(0)
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "command": "python3 " + " ".join(sys.argv),
        "ignore_frac": args.ignore_frac,
        "warmup": args.warmup,
        "reps": args.reps,
    }
    print(env, flush=True)
    rows = []
    for label, n, c, padded in SHAPES:
        rows += bench_shape(label, n, c, padded, args, cross_entropy)
    text = markdown(env, rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cross_entropy.md")
    with open(path, "w") as f:
        f.write(text)
    print(text + f"written to {path}")
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
