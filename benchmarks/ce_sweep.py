#!/usr/bin/env python3
"""Where cross_entropy's GPU time goes, and which tiling gets its forward + backward closest to copy bandwidth.

    python3 -P benchmarks/ce_sweep.py [--out DIR] [--quick]

Cases (bf16 logits, int64 targets, reduction "mean", as benchmarks/kernels.py's make_ce): the padded LM head's
column slice [8192,30528][:, :30522] and [4096,8192] (kernels.py's two rows, swept), BERT's [8192,30522] and
GPT-2's [8192,50257] contiguous (checked: their rows are not 16-byte aligned). GPU time alone
(triton.testing.do_bench_cudagraph, median), per part: the forward kernel alone, the reduce kernel alone, the
forward as the autograd Function runs it (forward + reduce), the backward kernel alone, and forward + backward
through autograd under bf16 autocast (kernels.py's "graph" fwd+bwd column). Bytes as kernels.py counts them:
2NC forward (the logits read), 4NC backward (read again, the gradient written); % copy is against the 2 GiB
device-to-device copy measured in this process.

Candidates are `cross_entropy.Tiles`: the forward's classes per iteration, warps and classes per running max /
sum (`group`, 0: one per class, the kernel before the ninth session), the backward's classes per iteration
and warps; and `_reduce_config`'s block and warps. Phase 1 times forward tilings alone, phase 2
backward tilings alone, phase 3 reduce blocks, per swept case (the rest of the Tiles as shipped); phase 4
times end to end, on all four cases, the eighth session's tiling (BEFORE), the shipped one (`_tiles`,
`_reduce_config`) and, on aligned rows where it differs, the one made of each swept case's best parts; and
checks the shipped kernels' per-row loss and gradient against BEFORE's (the largest loss difference, the
gradient elements that differ). Writes DIR/ce_sweep.md and .json (partial results after each phase);
prints the table last. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

SWEPT = ("[8192,30528][:, :30522]", "[4096,8192]")
CASES = {  # label: (rows, classes, row stride)
    "[8192,30528][:, :30522]": (8192, 30522, 30528),
    "[4096,8192]": (4096, 8192, 8192),
    "[8192,30522]": (8192, 30522, 30522),
    "[8192,50257]": (8192, 50257, 50257),
}
FORWARD = [  # (classes per iteration, warps, group)
    (4096, 8, 0), (2048, 4, 0), (2048, 4, 8), (1024, 2, 8), (2048, 2, 8), (1024, 4, 8), (4096, 4, 8),
    (2048, 4, 16), (2048, 8, 8),
]  # fmt: skip
BACKWARD = [
    (4096, 8),
    (2048, 4),
    (2048, 8),
    (4096, 16),
    (1024, 2),
    (8192, 16),
]  # (classes per iteration, warps)
BEFORE = (4096, 8, 0, 4096, 8)  # the eighth session's Tiles for every row length from 4096 classes
BEFORE_REDUCE = (2048, 8)
REDUCE = [(2048, 8), (8192, 8), (8192, 16), (16384, 16)]  # (block, warps) for 8192 rows and fewer


def _bench_module():
    """benchmarks/kernels.py, loaded by path (`python3 -P` puts no script folder on sys.path)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Knobs:
    """Sets the Tiles and reduce configuration the cross_entropy module launches with (its plan caches
    cleared), and restores the shipped choice."""

    def __init__(self, ce) -> None:
        self.ce = ce
        self.tiles_fn, self.reduce_fn = ce._tiles, ce._reduce_config

    def set(self, tiles=None, reduce=None) -> None:
        ce = self.ce
        ce._tiles = self.tiles_fn if tiles is None else (lambda n_cols, max_block, aligned: tiles)
        ce._reduce_config = self.reduce_fn if reduce is None else (lambda n_rows: reduce)
        ce._plan.cache_clear()
        ce._launch_plan.cache_clear()
        ce._reduce_launch.cache_clear()

    def shipped(self, case: Case):
        return self.tiles_fn(case.c, self.ce.MAX_BLOCK, case.aligned), self.reduce_fn(case.n)


class Case:
    def __init__(self, label: str) -> None:
        n, c, stride = CASES[label]
        self.label, self.n, self.c = label, n, c
        torch.manual_seed(0)
        full = torch.randn(n, stride, device="cuda", dtype=torch.bfloat16) * 3
        self.x = full[:, :c]
        self.t = torch.randint(0, c, (n,), device="cuda")
        self.fwd_bytes, self.bwd_bytes = 2 * n * c, 4 * n * c
        self.aligned = stride * 2 % 16 == 0


class Sweep:
    def __init__(self, kb, ce, cross_entropy, copy_gbs: float, rep_ms: int) -> None:
        self.kb, self.ce, self.cross_entropy, self.copy_gbs = kb, ce, cross_entropy, copy_gbs
        self.knobs = Knobs(ce)
        self.rep_ms = rep_ms
        self.rows: list[dict] = []

    def bench(self, fn) -> float:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=self.rep_ms, return_mode="median")

    # -- the parts ------------------------------------------------------------------------------------
    def fwd_kernel(self, case: Case):
        ce = self.ce
        return lambda: ce._forward(case.x, case.t, -100, True)

    def fwd(self, case: Case):
        ce = self.ce

        def run():
            rows, lse = ce._forward(case.x, case.t, -100, True)
            return ce._reduce(rows, "mean", torch.float32), lse

        return run

    def reduce(self, case: Case):
        ce = self.ce
        rows, _ = ce._forward(case.x, case.t, -100, True)
        return lambda: ce._reduce(rows, "mean", torch.float32)

    def bwd(self, case: Case):
        ce = self.ce
        rows, lse = ce._forward(case.x, case.t, -100, True)
        _, count = ce._reduce(rows, "mean", torch.float32)
        g = torch.tensor(1.0, device="cuda")
        return lambda: ce._backward(case.x, case.t, lse, g, count, -100)

    def fwd_bwd_ms(self, case: Case) -> float:
        x = case.x.detach().requires_grad_()
        dy = torch.tensor(1.0, device="cuda")
        fn = functools.partial(self.kb._fwd_bwd, self.cross_entropy, (x, case.t), [x], dy)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.bench(fn)

    # -- recording ------------------------------------------------------------------------------------
    def note(self, phase: str, case: Case, part: str, label: str, ms: float, nbytes: int, extra=None) -> dict:
        pct = 100 * nbytes / ms / 1e6 / self.copy_gbs if nbytes else None
        row = {"phase": phase, "case": case.label, "part": part, "config": label, "ms": ms, "pct_copy": pct}
        row.update(extra or {})
        self.rows.append(row)
        pct_s = f"{pct:5.1f}% copy" if pct is not None else ""
        print(f"[{phase}] {case.label:24s} {part:8s} {label:44s} {ms:.4f} ms {pct_s}", flush=True)
        return row

    def time(self, phase, case, part, label, make, nbytes, tiles=None, reduce=None) -> float:
        """Time `make(case)`'s function under (tiles, reduce); a candidate that fails is reported, skipped."""
        try:
            self.knobs.set(tiles, reduce)
            ms = self.bench(make(case))
        except Exception as exc:  # one candidate's failure must not lose the sweep
            print(f"[{phase}] {case.label} {part} {label} failed: {exc!r}", flush=True)
            return float("inf")
        finally:
            self.knobs.set()
        self.note(phase, case, part, label, ms, nbytes)
        return ms


def tiles_label(t) -> str:
    return f"fwd {t.fwd_block}/{t.fwd_warps}w g{t.group}, bwd {t.bwd_block}/{t.bwd_warps}w"


def sweep_case(sweep: Sweep, case: Case, quick: bool) -> tuple:
    """Phases 1-3 on one case: (best forward (block, warps, group), best backward, best reduce)."""
    Tiles = sweep.ce.Tiles
    shipped, _ = sweep.knobs.shipped(case)
    base = dataclasses.astuple(shipped)
    fwd_ms = {}
    for block, warps, group in FORWARD[::3] if quick else FORWARD:
        if block > max(16, 1 << (case.c - 1).bit_length()) or block // max(group, 1) < 32 * warps // 2:
            continue  # a block past the row, or fewer groups than half the threads
        tiles = Tiles(block, warps, group, *base[3:])
        fwd_ms[(block, warps, group)] = sweep.time(
            "1", case, "fwd kern", f"{block}/{warps}w group {group}", sweep.fwd_kernel, case.fwd_bytes, tiles
        )
    bwd_ms = {}
    for block, warps in BACKWARD[::3] if quick else BACKWARD:
        if block > max(16, 1 << (case.c - 1).bit_length()):
            continue
        tiles = Tiles(*base[:3], block, warps)
        bwd_ms[(block, warps)] = sweep.time(
            "2", case, "bwd", f"{block}/{warps}w", sweep.bwd, case.bwd_bytes, tiles
        )
    red_ms = {}
    for block, warps in REDUCE:
        red_ms[(block, warps)] = sweep.time(
            "3", case, "reduce", f"block {block} {warps}w", sweep.reduce, 0, None, (block, warps)
        )
    best = lambda d: min(d, key=d.get)  # noqa: E731
    return best(fwd_ms), best(bwd_ms), best(red_ms)


def end_to_end(sweep: Sweep, case: Case, label: str, tiles, reduce) -> dict:
    """Forward kernel, forward (+ reduce), backward and fwd+bwd of one (tiles, reduce) on one case."""
    out = {}
    for part, make, nbytes in (
        ("fwd kern", sweep.fwd_kernel, case.fwd_bytes),
        ("fwd", sweep.fwd, case.fwd_bytes),
        ("bwd", sweep.bwd, case.bwd_bytes),
    ):
        out[part] = sweep.time("4", case, part, label, make, nbytes, tiles, reduce)
    try:
        sweep.knobs.set(tiles, reduce)
        ms = sweep.fwd_bwd_ms(case)
    finally:
        sweep.knobs.set()
    sweep.note("4", case, "fwd+bwd", label, ms, case.fwd_bytes + case.bwd_bytes)
    out["fwd+bwd"] = ms
    return out


def agreement(sweep: Sweep, case: Case, tiles, reduce) -> dict:
    """The shipped kernels' per-row losses and gradient against those of (tiles, reduce) on one case."""

    def outputs(t, r):
        sweep.knobs.set(t, r)
        x = case.x.detach().requires_grad_()
        loss = sweep.cross_entropy(x, case.t, reduction="none")
        (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
        mean = sweep.cross_entropy(case.x, case.t)
        return loss.detach(), dx, mean

    try:
        l0, d0, m0 = outputs(tiles, reduce)
        l1, d1, m1 = outputs(None, None)
    finally:
        sweep.knobs.set()
    return {
        "case": case.label,
        "max_row_loss_diff": (l1 - l0).abs().max().item(),
        "mean_loss_diff": (m1 - m0).abs().item(),
        "grad_elements_differing": int((d1 != d0).sum().item()),
        "grad_elements": d0.numel(),
    }


def write(out_dir: str, env: dict, sweep: Sweep, extra: dict, final: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ce_sweep.json"), "w") as f:
        json.dump({"env": env, "rows": sweep.rows, **extra}, f, indent=1)
    if not final:
        return
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; copy {env['copy_GBps']:.0f} GB/s "
        f"(2 GiB, read + write). Command: `{env['command']}`. cross_entropy, bf16 logits, reduction mean, GPU "
        "time (CUDA graph replays, median); bytes 2NC forward, 4NC backward.",
        "",
        "| phase | case | part | config | ms | % copy |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in sorted(sweep.rows, key=lambda r: (r["phase"], r["case"], r["part"], r["ms"])):
        pct = f"{r['pct_copy']:.1f}%" if r["pct_copy"] is not None else ""
        lines.append(f"| {r['phase']} | {r['case']} | {r['part']} | {r['config']} | {r['ms']:.4f} | {pct} |")
    lines += [
        "",
        "Shipped against the eighth session's tiling (BEFORE):",
        "",
        "| case | max row-loss diff | mean-loss diff | gradient elements differing |",
        "|---|---:|---:|---:|",
    ]
    for a in extra.get("agreement", []):
        lines.append(
            f"| {a['case']} | {a['max_row_loss_diff']:.3g} | {a['mean_loss_diff']:.3g} | "
            f"{a['grad_elements_differing']} of {a['grad_elements']} |"
        )
    lines += ["", f"Winners: {extra.get('winners')}"]
    with open(os.path.join(out_dir, "ce_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"), help="folder for ce_sweep.md/json")
    ap.add_argument("--quick", action="store_true", help="fewer candidates (a smoke test)")
    ap.add_argument("--rep-ms", type=int, default=40, help="do_bench_cudagraph's rep per timing")
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from opadvisor.kernels import cross_entropy

    ce = importlib.import_module("opadvisor.kernels.cross_entropy")  # the package's name is the function
    kb = _bench_module()
    copy_gbs = kb.copy_bandwidth()
    sweep = Sweep(kb, ce, cross_entropy, copy_gbs, args.rep_ms)
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_gbs, "command": "python3 -P " + " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    before = ce.Tiles(*BEFORE)
    winners = {}
    for label in SWEPT:
        case = Case(label)
        fwd, bwd, red = sweep_case(sweep, case, args.quick)
        winners[label] = {"tiles": sweep.ce.Tiles(*fwd, *bwd), "reduce": red}
        write(args.out, env, sweep, {"winners": str(winners)})
        print(f"best for {label}: {winners[label]}  ({time.time() - t0:.0f} s)", flush=True)
        del case
        torch.cuda.empty_cache()
    agree = []
    for label in CASES:
        case = Case(label)
        shipped, _ = sweep.knobs.shipped(case)
        end_to_end(sweep, case, "before: " + tiles_label(before), before, BEFORE_REDUCE)
        end_to_end(sweep, case, "shipped: " + tiles_label(shipped), None, None)
        # The swept shape whose rows round to the same power of two decides (30522 and 50257 -> the LM head's);
        # it was swept on aligned rows only.
        win = winners[SWEPT[1]] if case.c <= 8192 else winners[SWEPT[0]]
        if case.aligned and win["tiles"] != shipped:
            end_to_end(sweep, case, "winner: " + tiles_label(win["tiles"]), win["tiles"], win["reduce"])
        agree.append(agreement(sweep, case, before, BEFORE_REDUCE))
        write(args.out, env, sweep, {"winners": str(winners), "agreement": agree})
        del case
        torch.cuda.empty_cache()
    write(args.out, env, sweep, {"winners": str(winners), "agreement": agree}, final=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
