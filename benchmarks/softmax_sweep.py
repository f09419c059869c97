#!/usr/bin/env python3
"""Which forward launch configuration gets masked_softmax closest to copy bandwidth on 512-column rows.

    python3 -P benchmarks/softmax_sweep.py [--out DIR] [--quick]

The case: [32,16,512,512] bf16 scores, a [32,1,1,512] bool padding mask, DeBERTa's fill and zeroed masked
positions (benchmarks/kernels.py's first row), forward only, GPU time alone (triton.testing.do_bench_cudagraph:
no launch or Python time). Each candidate is a `softmax.ForwardConfig` set as FORWARD_CONFIGS[512]: rows per
tile and warps per program, the shared mask row on or off, a persistent grid (programs per multiprocessor,
pipeline stages of its tile loop). Phase 1 sweeps rows x warps with one tile per program; phase 2 takes
phase 1's two best and tries persistent grids and the unshared mask row; the three best and the shipped
configuration are then timed again, interleaved, three rounds (the median decides). (Streaming cache hints
were a candidate too, until every one of them measured slower than its twin without: removed.)

Beside each time: % of the copy bandwidth measured in this process (a 2 GiB device-to-device copy, bytes read
+ written: the denominator of kernels.py's "% copy") and of a copy of this tensor's own bytes, and the compiled
kernel's registers per thread and spills. Last, the winner against the shipped configuration on forward +
backward of the same case and on BERT's add mask + scale + dropout at [16,12,512,512] (the configuration
applies to every 512-column forward), and the line to put in kernels/softmax.py. Writes DIR/softmax_sweep.md
and .json; prints the table last. About two minutes on an H200 (each configuration compiles once).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BLOCK = 512
# (rows, warps); no one-warp launch: softmax.ForwardConfig refuses them (other bits than the default on the H200)
PHASE1 = [(1, 2), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8), (16, 4)]


def _bench_module():
    """benchmarks/kernels.py, loaded by path (this runs with `python3 -P`, which puts no script folder on
    sys.path): its do_bench wrappers, copy bandwidth and the chains."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _set(softmax, config) -> None:
    """Make `config` the forward's configuration for 512-column rows (None: no entry, `_config`'s choice)."""
    if config is None:
        softmax.FORWARD_CONFIGS.pop(BLOCK, None)
    else:
        softmax.FORWARD_CONFIGS[BLOCK] = config
    softmax._plan.cache_clear()
    softmax._launch_plan.cache_clear()


def _label(config) -> str:
    if config is None:
        return "_config's choice (no FORWARD_CONFIGS entry)"
    parts = [f"rows={config.rows} warps={config.warps}"]
    if not config.share_mask:
        parts.append("mask per row")
    if config.programs_per_sm:
        parts.append(f"persistent {config.programs_per_sm}/SM stages={config.stages}")
    return ", ".join(parts)


def _registers(softmax, x, mask) -> tuple[int | None, int | None]:
    """(registers per thread, spills) of the forward kernel compiled for this case, if Triton says."""
    launch = softmax._launch_for(False, x, mask, 3, True, 0.0, (0, 0, 0), x.dtype)[0]
    for compiled in launch.compiled.values():
        return getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
    return None, None


class Sweep:
    def __init__(self, kb, softmax, masked_softmax, copy_gbs: float) -> None:
        self.kb, self.softmax, self.copy_gbs = kb, softmax, copy_gbs
        torch.manual_seed(0)
        bf16 = torch.bfloat16
        self.x = torch.randn(32, 16, 512, 512, device="cuda", dtype=bf16)
        self.mask = torch.rand(32, 1, 1, 512, device="cuda") < 0.2
        self.nbytes = 2 * 2 * self.x.numel() + self.mask.numel()
        fill = torch.finfo(bf16).min
        self.fwd = functools.partial(masked_softmax, self.x, self.mask, fill_value=fill, zero_masked=True)
        out = torch.empty_like(self.x)
        self.same_copy_gbs = 2 * 2 * self.x.numel() / kb.bench_graph(lambda: out.copy_(self.x)) / 1e6
        self.rows: list[dict] = []

    def time(self, config) -> float:
        _set(self.softmax, config)
        with torch.no_grad():
            return self.kb.bench_graph(self.fwd)

    def note(self, phase: str, config, ms: float) -> dict:
        regs, spills = _registers(self.softmax, self.x, self.mask)
        gbs = self.nbytes / ms / 1e6
        row = {
            "phase": phase, "config": None if config is None else config.__dict__, "label": _label(config),
            "ms": ms, "GBps": gbs, "pct_copy": 100 * gbs / self.copy_gbs,
            "pct_same_copy": 100 * gbs / self.same_copy_gbs, "regs": regs, "spills": spills,
        }  # fmt: skip
        self.rows.append(row)
        print(
            f"[{phase}] {row['label']:52s} {ms:.4f} ms  {row['pct_copy']:5.1f}% copy  "
            f"{row['pct_same_copy']:5.1f}% same-size copy  regs {regs} spills {spills}",
            flush=True,
        )
        return row

    def run(self, config, phase: str) -> dict:
        """Time `config` and note it; a configuration that fails to compile or run is reported and skipped."""
        try:
            ms = self.time(config)
        except Exception as exc:  # one candidate's failure must not lose the sweep
            print(f"[{phase}] {_label(config):52s} failed: {exc!r}", flush=True)
            return {"ms": float("inf")}
        return self.note(phase, config, ms)


def phase1(sweep: Sweep, quick: bool) -> list:
    fc = sweep.softmax.ForwardConfig
    pairs = PHASE1[4:10] if quick else PHASE1
    results = []
    for rows, warps in pairs:
        config = fc(rows=rows, warps=warps)
        results.append((sweep.run(config, "1")["ms"], config))
    return [c for _, c in sorted(results, key=lambda r: r[0])]


def phase2(sweep: Sweep, best: list, quick: bool) -> None:
    fc = sweep.softmax.ForwardConfig
    for base in best[:2]:
        sweep.run(fc(base.rows, base.warps, share_mask=False), "2")
        for per_sm in (4, 8) if quick else (4, 8, 16):
            if per_sm * base.warps > 64:  # more warps than a multiprocessor holds: the same as fewer
                continue
            for stages in (1, 2, 3):
                sweep.run(fc(base.rows, base.warps, programs_per_sm=per_sm, stages=stages), "2")


def final_rounds(sweep: Sweep, shipped, rounds: int = 3) -> list[dict]:
    """The three best so far and the shipped configuration, timed again in interleaved rounds."""
    by_label: dict[str, dict] = {}
    for r in sorted(sweep.rows, key=lambda r: r["ms"]):
        by_label.setdefault(r["label"], r)
    fc = sweep.softmax.ForwardConfig
    finalists = [shipped]
    for r in by_label.values():
        config = None if r["config"] is None else fc(**r["config"])
        if len(finalists) < 4 and config not in finalists:
            finalists.append(config)
    times: dict[int, list[float]] = {i: [] for i in range(len(finalists))}
    for _ in range(rounds):
        for i, config in enumerate(finalists):
            times[i].append(sweep.time(config))
    out = []
    for i, config in enumerate(finalists):
        _set(sweep.softmax, config)
        out.append(sweep.note("final", config, statistics.median(times[i])))
    return out


def cross_checks(kb, softmax, masked_softmax, shipped, winner) -> list[dict]:
    """The winner against the shipped configuration where it also applies: forward + backward of the sweep's
    case, and BERT's additive mask + scale + dropout at [16,12,512,512] (forward, forward + backward)."""
    bf16 = torch.bfloat16
    x = torch.randn(32, 16, 512, 512, device="cuda", dtype=bf16, requires_grad=True)
    mask = torch.rand(32, 1, 1, 512, device="cuda") < 0.2
    fill = torch.finfo(bf16).min
    deberta = functools.partial(masked_softmax, fill_value=fill, zero_masked=True)
    xb = torch.randn(16, 12, 512, 512, device="cuda", dtype=bf16, requires_grad=True)
    add = torch.where(torch.rand(16, 1, 1, 512, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
    bert = functools.partial(masked_softmax, scale=0.125, dropout_p=0.1)
    cases = [
        ("[32,16,512,512] pad mask fwd+bwd", functools.partial(kb._fwd_bwd, deberta, (x, mask), [x], torch.randn_like(x))),
        ("[16,12,512,512] add, scale, dropout fwd", _no_grad(functools.partial(bert, xb.detach(), add))),
        ("[16,12,512,512] add, scale, dropout fwd+bwd", functools.partial(kb._fwd_bwd, bert, (xb, add), [xb], torch.randn_like(xb))),
    ]  # fmt: skip
    out = []
    for label, fn in cases:
        ms = {}
        for name, config in (("shipped", shipped), ("winner", winner)):
            _set(softmax, config)
            ms[name] = kb.bench_graph(fn)
        out.append({"case": label, "shipped_ms": ms["shipped"], "winner_ms": ms["winner"]})
        print(f"[check] {label:44s} shipped {ms['shipped']:.4f} ms  winner {ms['winner']:.4f} ms", flush=True)
    return out


def _no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()

    return call


def report(
    out_dir: str, env: dict, rows: list[dict], final: list[dict], checks: list[dict], line: str
) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "softmax_sweep.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "final": final, "checks": checks, "winner": line}, f, indent=1)
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; copy {env['copy_GBps']:.0f} GB/s "
        f"(2 GiB, read + write), copy of the case's own bytes {env['same_copy_GBps']:.0f} GB/s. Command: "
        f"`{env['command']}`. masked_softmax forward, [32,16,512,512] bf16, [32,1,1,512] bool mask, GPU time "
        "(CUDA graph replays, median).",
        "",
        "| phase | forward config (512-column rows) | ms | % copy | % same-size copy | regs | spills |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["phase"] != "final", r["ms"])):
        lines.append(
            f"| {r['phase']} | {r['label']} | {r['ms']:.4f} | {r['pct_copy']:.1f}% | {r['pct_same_copy']:.1f}% | "
            f"{r['regs']} | {r['spills']} |"
        )
    lines += ["", "| case | shipped ms | winner ms |", "|---|---:|---:|"]
    lines += [f"| {c['case']} | {c['shipped_ms']:.4f} | {c['winner_ms']:.4f} |" for c in checks]
    lines += ["", f"Winner: {line}"]
    with open(os.path.join(out_dir, "softmax_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument(
        "--out", default=os.environ.get("OUT", "benchmarks"), help="folder for softmax_sweep.md/json"
    )
    ap.add_argument("--quick", action="store_true", help="fewer candidates (a smoke test)")
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from opadvisor.kernels import masked_softmax, softmax

    kb = _bench_module()
    copy_gbs = kb.copy_bandwidth()
    sweep = Sweep(kb, softmax, masked_softmax, copy_gbs)
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_gbs, "same_copy_GBps": sweep.same_copy_gbs, "command": "python3 " + " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    shipped = softmax.FORWARD_CONFIGS.get(BLOCK)
    sweep.run(shipped, "shipped")
    best = phase1(sweep, args.quick)
    phase2(sweep, best, args.quick)
    final = final_rounds(sweep, shipped)
    top = min(final, key=lambda r: r["ms"])
    winner = None if top["config"] is None else softmax.ForwardConfig(**top["config"])
    checks = cross_checks(kb, softmax, masked_softmax, shipped, winner)
    _set(softmax, shipped)
    line = "no FORWARD_CONFIGS entry" if winner is None else f"FORWARD_CONFIGS[{BLOCK}] = {winner!r}"
    shipped_ms = final[0]["ms"]
    report(
        args.out, env, sweep.rows, final, checks,
        f"{line} ({top['pct_copy']:.1f}% of copy; shipped {final[0]['pct_copy']:.1f}%, "
        f"{shipped_ms / top['ms']:.3f}x)",
    )  # fmt: skip
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
