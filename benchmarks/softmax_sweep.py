#!/usr/bin/env python3
"""masked_softmax's forward against copy bandwidth: the row split and the launch configurations, GPU time.

    python3 -P benchmarks/softmax_sweep.py [--out DIR] [--quick] [--budget SECONDS]

The main case: [32,16,512,512] bf16 scores, a [32,1,1,512] bool padding mask, DeBERTa's fill and zeroed masked
positions (benchmarks/kernels.py's first row), forward only, GPU time alone (CUDA graph replays, median: no
launch or Python time). Candidates: `softmax.ROW_SPLIT` (a row held in pieces so that each warp has whole rows,
see kernels/_softmax_triton.py) off (the shipped kernel before it) or on, times `softmax.ForwardConfig`s set as
FORWARD_CONFIGS[512] (rows per tile, warps, a persistent grid). Phases, each written to DIR as it ends:

1. the main case for every candidate;
2. bits: with the split on, every configuration gives the same y (dropout included) and dx as the split's
   default launch (BERT's add mask + scale + dropout and the padding case, small batches); the split against
   the shipped kernel (elements of y and dx that differ, largest difference) and both against the float32
   reference;
3. the shipped kernel, the split's default and the two best split configurations, timed again in interleaved
   rounds (median) on the main case forward and forward + backward, and on BERT's [16,12,512,512] add mask +
   scale + dropout forward and forward + backward: the per-shape choice must not make BERT's case slower;
4. guards: the split on and off (default launch) on other row lengths and dtypes it applies to.

% copy is kernels.py's: the bytes the op must move (x read, y written, the saved p with dropout, the mask once;
the backward reads y, dy and writes dx) over the time, against a 2 GiB device-to-device copy measured in this
process (bytes read + written). Phases past --budget seconds are skipped (their rows say so). Writes
DIR/softmax_sweep.md and .json; prints the tables last.
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
# (rows, warps); none with warps > rows (the split's warps lie along the rows) and no one-warp launch
# (softmax.ForwardConfig refuses them: other bits than the default on the H200).
CONFIGS = [(2, 2), (4, 2), (4, 4), (8, 2), (8, 8), (16, 4), (16, 8)]
PERSISTENT = [(8, 4, 8, 2), (4, 4, 16, 2)]  # rows, warps, programs per SM, stages


def _bench_module():
    """benchmarks/kernels.py, loaded by path (this runs with `python3 -P`): do_bench wrappers, copy bandwidth."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Candidate:
    """ROW_SPLIT on or off and a FORWARD_CONFIGS[512] entry (None: `_config`'s choice)."""

    def __init__(self, split: bool, config=None) -> None:
        self.split, self.config = split, config

    @property
    def label(self) -> str:
        parts = ["split" if self.split else "shipped (no split)"]
        c = self.config
        if c is None:
            parts.append("default launch")
        else:
            parts.append(f"rows={c.rows} warps={c.warps}")
            if c.programs_per_sm:
                parts.append(f"persistent {c.programs_per_sm}/SM stages={c.stages}")
        return ", ".join(parts)

    def apply(self, softmax) -> None:
        softmax.ROW_SPLIT = self.split
        if self.config is None:
            softmax.FORWARD_CONFIGS.pop(BLOCK, None)
        else:
            softmax.FORWARD_CONFIGS[BLOCK] = self.config
        softmax._plan.cache_clear()
        softmax._launch_plan.cache_clear()


def _no_grad(fn):
    def call():
        with torch.no_grad():
            return fn()

    return call


class Cases:
    """The timed cases: name -> (function to replay, bytes it must move)."""

    def __init__(self, kb, masked_softmax) -> None:
        bf16 = torch.bfloat16
        torch.manual_seed(0)
        self.fns: dict[str, tuple] = {}
        x = torch.randn(32, 16, 512, 512, device="cuda", dtype=bf16, requires_grad=True)
        mask = torch.rand(32, 1, 1, 512, device="cuda") < 0.2
        n = x.numel()
        self.nbytes_main = 2 * 2 * n + mask.numel()
        deberta = functools.partial(masked_softmax, fill_value=torch.finfo(bf16).min, zero_masked=True)
        self.fns["pad [32,16,512,512] fwd"] = (
            _no_grad(functools.partial(deberta, x.detach(), mask)),
            4 * n + mask.numel(),
        )
        dy = torch.randn_like(x)
        self.fns["pad [32,16,512,512] fwd+bwd"] = (
            functools.partial(kb._fwd_bwd, deberta, (x, mask), [x], dy),
            10 * n + 2 * mask.numel(),
        )
        xb = torch.randn(16, 12, 512, 512, device="cuda", dtype=bf16, requires_grad=True)
        add = torch.where(torch.rand(16, 1, 1, 512, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
        bert = functools.partial(masked_softmax, scale=0.125, dropout_p=0.1)
        nb = xb.numel()
        self.fns["bert [16,12,512,512] fwd"] = (_no_grad(functools.partial(bert, xb.detach(), add)), 6 * nb)
        dyb = torch.randn_like(xb)
        self.fns["bert [16,12,512,512] fwd+bwd"] = (functools.partial(kb._fwd_bwd, bert, (xb, add), [xb], dyb), 12 * nb)  # fmt: skip

    def guard_cases(self, kb, masked_softmax) -> dict[str, tuple]:
        """Other rows the split applies to: bf16 1024 columns (4 pieces), float32 512 columns (4 pieces)."""
        out = {}
        for label, shape, dtype in (
            ("pad bf16 [16,16,1024,1024]", (16, 16, 1024, 1024), torch.bfloat16),
            ("pad fp32 [16,16,512,512]", (16, 16, 512, 512), torch.float32),
        ):
            x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
            mask = torch.rand(shape[0], 1, 1, shape[-1], device="cuda") < 0.2
            f = functools.partial(masked_softmax, fill_value=torch.finfo(dtype).min, zero_masked=True)
            size, mb = x.numel() * x.element_size(), mask.numel()
            out[f"{label} fwd"] = (_no_grad(functools.partial(f, x.detach(), mask)), 2 * size + mb)
            dy = torch.randn_like(x)
            out[f"{label} fwd+bwd"] = (
                functools.partial(kb._fwd_bwd, f, (x, mask), [x], dy),
                5 * size + 2 * mb,
            )
        return out


class Sweep:
    def __init__(self, kb, softmax, copy_gbs: float, out_dir: str, env: dict) -> None:
        self.kb, self.softmax, self.copy_gbs, self.out_dir, self.env = kb, softmax, copy_gbs, out_dir, env
        self.rows: list[dict] = []
        self.bits: list[dict] = []

    def time(self, cand: Candidate, fn) -> float:
        cand.apply(self.softmax)
        try:
            return self.kb.bench_graph(fn)
        except Exception as exc:  # one candidate's failure must not lose the sweep
            print(f"{cand.label}: failed: {exc!r}", flush=True)
            return float("nan")

    def note(self, phase: str, case: str, cand: Candidate, ms: float, nbytes: int, spread=None) -> dict:
        pct = 100 * nbytes / ms / 1e6 / self.copy_gbs
        row = {"phase": phase, "case": case, "label": cand.label, "split": cand.split,
               "config": None if cand.config is None else cand.config.__dict__, "ms": ms, "pct_copy": pct,
               "spread_ms": spread}  # fmt: skip
        self.rows.append(row)
        extra = "" if spread is None else f"  (rounds {spread})"
        print(f"[{phase}] {case:34s} {cand.label:52s} {ms:.4f} ms  {pct:5.1f}% copy{extra}", flush=True)
        self.save()
        return row

    def save(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "softmax_sweep.json"), "w") as f:
            json.dump({"env": self.env, "rows": self.rows, "bits": self.bits}, f, indent=1)


def candidates(softmax, quick: bool) -> list[Candidate]:
    fc = softmax.ForwardConfig
    out = [Candidate(False), Candidate(True)]
    out += [Candidate(True, fc(rows=r, warps=w)) for r, w in (CONFIGS[2:5] if quick else CONFIGS)]
    if not quick:
        out += [Candidate(True, fc(r, w, programs_per_sm=n, stages=s)) for r, w, n, s in PERSISTENT]
    return out


def phase_main(sweep: Sweep, cases: Cases, cands: list[Candidate]) -> list[tuple[float, Candidate]]:
    fn, nbytes = cases.fns["pad [32,16,512,512] fwd"]
    timed = []
    for cand in cands:
        ms = sweep.time(cand, fn)
        sweep.note("1", "pad [32,16,512,512] fwd", cand, ms, nbytes)
        timed.append((ms, cand))
    return timed


def _run(softmax, masked_softmax, cand: Candidate, x, mask, dy, kw):
    """(y, dx) of one call with a fixed dropout seed."""
    cand.apply(softmax)
    xg = x.detach().requires_grad_(True)
    with softmax._rng.fixed_dropout_seed((7, 8, 9)):
        y = masked_softmax(xg, mask, **kw)
    (dx,) = torch.autograd.grad(y, [xg], dy)
    return y.detach(), dx


def phase_bits(sweep: Sweep, softmax, masked_softmax, reference, cands: list[Candidate]) -> None:
    """Every split configuration against the split's default launch (must be equal), and the split against
    the shipped kernel and both against the float32 reference (how far, for the record)."""
    small = softmax.SMALL_NUMEL
    softmax.SMALL_NUMEL = 0  # these small batches would run the eager chain otherwise
    try:
        _bits(sweep, softmax, masked_softmax, reference, cands)
    finally:
        softmax.SMALL_NUMEL = small
    sweep.save()


def _bits(sweep: Sweep, softmax, masked_softmax, reference, cands: list[Candidate]) -> None:
    bf16 = torch.bfloat16
    torch.manual_seed(3)
    x = torch.randn(2, 12, 512, 512, device="cuda", dtype=bf16) * 3
    add = torch.where(torch.rand(2, 1, 1, 512, device="cuda") < 0.2, -1e4, 0.0).to(bf16)
    pad = torch.rand(2, 1, 1, 512, device="cuda") < 0.3
    dy = torch.randn_like(x)
    cases = {
        "bert add, scale, dropout 0.1": (add, dict(scale=0.125, dropout_p=0.1)),
        "pad, fill min, zero masked": (pad, dict(fill_value=torch.finfo(bf16).min, zero_masked=True)),
    }
    for case, (mask, kw) in cases.items():
        base = _run(softmax, masked_softmax, Candidate(True), x, mask, dy, kw)
        for cand in cands:
            if not cand.split or cand.config is None:
                continue
            y, dx = _run(softmax, masked_softmax, cand, x, mask, dy, kw)
            row = {"case": case, "label": cand.label, "y_equal": torch.equal(y, base[0]),
                   "dx_equal": torch.equal(dx, base[1])}  # fmt: skip
            sweep.bits.append(row)
            print(f"[bits] {case:30s} {cand.label:52s} y equal {row['y_equal']}  dx equal {row['dx_equal']}")
        shipped = _run(softmax, masked_softmax, Candidate(False), x, mask, dy, kw)
        row = {
            "case": case,
            "label": "split default vs shipped",
            "same_zeros": torch.equal(base[0] == 0, shipped[0] == 0),
        }
        for name, a, b in (("y", base[0], shipped[0]), ("dx", base[1], shipped[1])):
            row[f"{name}_differ"] = int((a != b).sum())
            row[f"{name}_max_diff"] = float((a.float() - b.float()).abs().max())
        if kw.get("dropout_p", 0) == 0:
            ref = reference(x.float(), mask.float() if mask.is_floating_point() else mask, **kw)
            row["y_err_split"] = float((base[0].float() - ref).abs().max())
            row["y_err_shipped"] = float((shipped[0].float() - ref).abs().max())
        sweep.bits.append(row)
        print(f"[bits] {case:30s} {json.dumps(row)}", flush=True)


def phase_rounds(sweep: Sweep, cases: dict, finalists: list[Candidate], phase: str, rounds: int = 3) -> None:
    """Each case for each finalist, `rounds` interleaved rounds; the median is noted with the spread."""
    for case, (fn, nbytes) in cases.items():
        times: dict[int, list[float]] = {i: [] for i in range(len(finalists))}
        for _ in range(rounds):
            for i, cand in enumerate(finalists):
                times[i].append(sweep.time(cand, fn))
        for i, cand in enumerate(finalists):
            ts = times[i]
            sweep.note(phase, case, cand, statistics.median(ts), nbytes, [round(t, 4) for t in ts])


def report(sweep: Sweep, decision: str) -> None:
    env = sweep.env
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; copy {env['copy_GBps']:.0f} GB/s "
        f"(2 GiB, read + write). Command: `{env['command']}`. GPU time (CUDA graph replays, median).",
        "",
        "| phase | case | candidate | ms | % copy | rounds |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in sweep.rows:
        spread = "" if r["spread_ms"] is None else " / ".join(f"{t:.4f}" for t in r["spread_ms"])
        lines.append(
            f"| {r['phase']} | {r['case']} | {r['label']} | {r['ms']:.4f} | {r['pct_copy']:.1f}% | {spread} |"
        )
    lines += ["", "Bits:", ""]
    lines += [f"- {json.dumps(b)}" for b in sweep.bits]
    lines += ["", f"Decision: {decision}"]
    with open(os.path.join(sweep.out_dir, "softmax_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument(
        "--out", default=os.environ.get("OUT", "benchmarks"), help="folder for softmax_sweep.md/json"
    )
    ap.add_argument("--quick", action="store_true", help="fewer candidates (a smoke test)")
    ap.add_argument(
        "--confirm", action="store_true", help="only bits and the rounds: shipped against the split's default"
    )
    ap.add_argument(
        "--budget", type=float, default=190.0, help="seconds after which later phases are skipped"
    )
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from opadvisor.kernels import masked_softmax, reference_masked_softmax, softmax

    kb = _bench_module()
    copy_gbs = kb.copy_bandwidth()
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_gbs, "command": "python3 " + " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    sweep = Sweep(kb, softmax, copy_gbs, args.out, env)
    cases = Cases(kb, masked_softmax)
    shipped_split = softmax.ROW_SPLIT
    cands = candidates(softmax, args.quick)
    timed = [] if args.confirm else phase_main(sweep, cases, cands)
    left = lambda: args.budget - (time.time() - t0)  # noqa: E731
    if left() > 0:
        phase_bits(sweep, softmax, masked_softmax, reference_masked_softmax, cands)
    split_best = [c for _, c in sorted((t for t in timed if t[1].split), key=lambda t: t[0])]
    finalists = [Candidate(False), Candidate(True)]
    finalists += [c for c in split_best if c.config is not None][:2]
    if left() > 0:
        phase_rounds(sweep, cases.fns, finalists, "3")
    if left() > 30 and not args.confirm:
        phase_rounds(sweep, cases.guard_cases(kb, masked_softmax), finalists[:2], "4", rounds=2)
    Candidate(shipped_split).apply(softmax)
    finals = [r for r in sweep.rows if r["phase"] == "3" and r["case"] == "pad [32,16,512,512] fwd"]
    best = min(finals or sweep.rows, key=lambda r: r["ms"])
    report(
        sweep,
        f"fastest main-case forward: {best['label']} ({best['ms']:.4f} ms, {best['pct_copy']:.1f}% copy)",
    )
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
