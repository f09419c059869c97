#!/usr/bin/env python3
"""Which backward (mask mode, launch configuration) gets bias_dropout_add's forward + backward closest to copy
bandwidth.

    python3 -P benchmarks/bda_sweep.py [--out DIR] [--quick] [--budget SECONDS] [--rounds N] [--rep MS]

The cases: bf16 x, bias, residual and dy at [16384,4096], [8192,4096], [16384,1024] (benchmarks/kernels.py's
shapes) and BERT-base's [8192,768], p=0.1, GPU time alone (triton.testing.do_bench_cudagraph: CUDA-graph
replays, median; no launch or Python time; the kernels run at every size, as under graph capture). Each
candidate is a MASK_MODE ("philox": the backward recomputes the keep mask from the seed; "bits": the forward
stores it, one bit an element) and a `dropout_add.BackwardConfig` set as BACKWARD_CONFIG: the backward
kernel's tile (rows x block, warps), programs per multiprocessor, fewest rows a program, pipelined loads
(stages), a prefetch of the next rows, and the tile of `bias_grad_kernel` (the partial dbias sums added up).

Phase 1 times the backward alone (dx + partial dbias + bias_grad_kernel, the launches autograd makes) at
[16384,4096] for mask mode x tile x programs per multiprocessor; phase 2 takes each mode's three best and
tries stages, prefetch and fewest rows; phase 3 tries the sum kernel's tiles on each mode's best. The shipped
candidate and each mode's two best are then timed at every shape: backward alone, forward + backward through
autograd (the measurement of kernels.py's "graph" column: its own bench_graph and _fwd_bwd), the forward per
mode, the backward without dbias (what the sums cost), and checked on the GPU (dx bit for bit against the
shipped candidate's, dbias against a float64 sum, twice the same bits). Beside each time: % of the copy
bandwidth measured in this process (a 2 GiB device-to-device copy, bytes read + written: kernels.py's
"% copy"; bytes as kernels.py counts them: forward x, residual, y; backward dy, dx; a stored mask's bytes are
not counted, so they cost percent), and the compiled backward kernel's registers per thread and spills.
Writes DIR/bda_sweep.md and .json (also after each phase); prints the table last. `--budget` stops starting
new phase-1/2/3 candidates after that many seconds so the finals still run. About two minutes on an H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

P = 0.1
SEED = (1, 2, 3)
DEVICE = "cuda"
SHAPES = [(16384, 4096), (8192, 4096), (16384, 1024), (8192, 768)]
MASKS = ("philox", "bits")
# (rows, block, warps) x programs per multiprocessor: phase 1
TILES = [
    (1, 2048, 4),
    (2, 1024, 4),
    (4, 512, 4),
    (8, 256, 4),
    (16, 256, 4),
    (16, 256, 8),
    (8, 512, 8),
    (4, 256, 2),
]
PER_SM = (4, 8, 16)
# phase 2's changes to the best tiles
CHANGES = ({"stages": 3}, {"prefetch": True}, {"min_rows": 64}, {"prefetch": True, "min_rows": 64})
# bias_grad_kernel tiles (sum_rows, sum_cols, sum_warps): phase 3
SUM_TILES = [(32, 64, 4), (128, 16, 4), (64, 32, 4), (256, 8, 4)]


class Candidate(NamedTuple):
    """MASK_MODE (how the backward gets the keep mask) and BACKWARD_CONFIG."""

    mask: str
    config: object


def _bench_module():
    """benchmarks/kernels.py, loaded by path (this runs with `python3 -P`, which puts no script folder on
    sys.path): its CUDA-graph timer, copy bandwidth and fwd+bwd helper."""
    spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _shape_label(shape) -> str:
    return f"[{shape[0]},{shape[1]}]"


def _label(cand: Candidate) -> str:
    c = cand.config
    parts = [f"{cand.mask}: {c.rows}x{c.block} w{c.warps} {c.programs_per_sm}/SM"]
    if c.min_rows > 1:
        parts.append(f"min_rows={c.min_rows}")
    if c.stages > 1:
        parts.append(f"stages={c.stages}")
    if c.prefetch:
        parts.append("prefetch")
    if c.interleave:
        parts.append("interleave")
    parts.append(f"sum {c.sum_rows}x{c.sum_cols} w{c.sum_warps}")
    return ", ".join(parts)


class Case:
    """One shape's bf16 tensors (x, bias, residual with grad; dy), the masks the forward stores per
    MASK_MODE, and the byte counts (kernels.py's: the stored mask's bytes are not counted)."""

    def __init__(self, rows: int, cols: int) -> None:
        bf16 = torch.bfloat16
        self.label = _shape_label((rows, cols))
        self.x = torch.randn(rows, cols, device=DEVICE, dtype=bf16, requires_grad=True)
        self.b = torch.randn(cols, device=DEVICE, dtype=bf16, requires_grad=True)
        self.r = torch.randn(rows, cols, device=DEVICE, dtype=bf16, requires_grad=True)
        self.dy = torch.randn(rows, cols, device=DEVICE, dtype=bf16)
        self.masks: dict[str, torch.Tensor | None] = {}
        n = rows * cols
        self.bytes = {"fwd": 3 * 2 * n, "bwd": 2 * 2 * n, "bwd no dbias": 2 * 2 * n, "fwd+bwd": 5 * 2 * n}

    def mask(self, da, mask: str):
        """The keep mask the forward stores in MASK_MODE `mask` (None for "philox"), for SEED."""
        if mask not in self.masks:
            with torch.no_grad():
                self.masks[mask] = da._forward(self.x, self.b, self.r, P, SEED)[1]
        return self.masks[mask]


class Sweep:
    def __init__(self, kb, dropout_add, bias_dropout_add, copy_gbs: float, out_dir: str, env: dict) -> None:
        self.kb, self.da, self.bda, self.copy_gbs = kb, dropout_add, bias_dropout_add, copy_gbs
        self.out_dir, self.env = out_dir, env
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.cases: dict[tuple[int, int], Case] = {}

    def case(self, shape) -> Case:
        if shape not in self.cases:
            torch.manual_seed(0)
            self.cases[shape] = Case(*shape)
        return self.cases[shape]

    def set(self, cand: Candidate) -> None:
        self.da.MASK_MODE = cand.mask
        self.da.BACKWARD_CONFIG = cand.config
        self.da._bwd_plan.cache_clear()

    def fn(self, case: Case, mode: str):
        bf16 = torch.bfloat16
        if mode in ("bwd", "bwd no dbias"):
            b_dtype = bf16 if mode == "bwd" else None
            keep = case.mask(self.da, self.da.MASK_MODE)
            return functools.partial(self.da._backward_kernel, case.dy, keep, bf16, b_dtype, P, SEED)
        if mode == "fwd":
            args = (case.x.detach(), case.b.detach(), case.r.detach(), P)
            return functools.partial(_no_grad_call, self.bda, args)
        return functools.partial(
            self.kb._fwd_bwd, self.bda, (case.x, case.b, case.r, P), [case.x, case.b, case.r], case.dy
        )

    def time(self, cand: Candidate, shape, mode: str) -> float:
        self.set(cand)
        return self.kb.bench_graph(self.fn(self.case(shape), mode))

    def note(self, phase: str, cand: Candidate, shape, mode: str, ms: float) -> dict:
        case = self.case(shape)
        gbs = case.bytes[mode] / ms / 1e6
        regs, spills = self.registers(case, cand.mask) if mode == "bwd" else (None, None)
        row = {
            "phase": phase, "shape": case.label, "mode": mode, "mask": cand.mask,
            "config": dataclasses.asdict(cand.config), "label": _label(cand), "ms": ms, "GBps": gbs,
            "pct_copy": 100 * gbs / self.copy_gbs, "regs": regs, "spills": spills,
        }  # fmt: skip
        self.rows.append(row)
        print(
            f"[{phase}] {case.label:12s} {mode:12s} {row['label']:60s} {ms:.4f} ms {row['pct_copy']:5.1f}% copy "
            f"regs {regs} spills {spills}",
            flush=True,
        )
        return row

    def registers(self, case: Case, mask: str) -> tuple[int | None, int | None]:
        """(registers per thread, spills) of the backward kernel compiled for this case, if Triton says."""
        plan = self.da._bwd_plan(
            case.dy.shape, case.dy.stride(), (case.dy.dtype, case.dy.dtype, case.dy.dtype), case.dy.device,
            (None if mask == "philox" else mask, False), self.da.BACKWARD_CONFIG,
        )  # fmt: skip
        for compiled in plan.launch.compiled.values():
            return getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
        return None, None

    def run(self, cand: Candidate, shape, mode: str, phase: str) -> float:
        """Time and note; a configuration that fails to compile or run is reported and skipped."""
        try:
            ms = self.time(cand, shape, mode)
        except Exception as exc:  # one candidate's failure must not lose the sweep
            print(f"[{phase}] {_label(cand):60s} failed: {exc!r}", flush=True)
            return float("inf")
        return self.note(phase, cand, shape, mode, ms)["ms"]

    def check(self, cand: Candidate, shipped: Candidate, shape) -> dict:
        """dx bit for bit against the shipped candidate's, dbias against a float64 sum of the same dx
        (relative error), and the same dbias bits twice."""
        case = self.case(shape)
        bf16 = torch.bfloat16
        self.set(shipped)
        dx_ref, _ = self.da._backward_kernel(case.dy, case.mask(self.da, shipped.mask), bf16, bf16, P, SEED)
        self.set(cand)
        keep = case.mask(self.da, cand.mask)
        dx, db = self.da._backward_kernel(case.dy, keep, bf16, bf16, P, SEED)
        _, db2 = self.da._backward_kernel(case.dy, keep, bf16, bf16, P, SEED)
        exact = torch.where(self.da.philox_keep_like(case.dy, SEED, P), case.dy.double() / (1 - P), 0.0).sum(
            0
        )
        rel = ((db.double() - exact).norm() / exact.norm()).item()
        row = {
            "shape": case.label, "label": _label(cand), "dx_bits_equal_shipped": torch.equal(dx, dx_ref),
            "dbias_rel_err": rel, "dbias_deterministic": torch.equal(db, db2),
        }  # fmt: skip
        self.checks.append(row)
        print(f"[check] {row}", flush=True)
        return row

    def save(self, winner: str = "") -> None:
        report(self.out_dir, self.env, self.rows, self.checks, winner, print_table=False)


def _no_grad_call(f, args):
    with torch.no_grad():
        return f(*args)


def best_candidates(rows: list[dict], n: int, mask: str | None = None) -> list[Candidate]:
    """The n fastest distinct candidates among rows (backward alone at the first shape), of one mask mode
    or any."""
    from opadvisor.kernels import dropout_add

    seen: dict[str, dict] = {}
    for r in sorted(rows, key=lambda r: r["ms"]):
        if r["mode"] == "bwd" and r["shape"] == _shape_label(SHAPES[0]) and mask in (None, r["mask"]):
            seen.setdefault(r["label"], r)
    return [Candidate(r["mask"], dropout_add.BackwardConfig(**r["config"])) for r in list(seen.values())[:n]]


def phase1(sweep: Sweep, shipped: Candidate, quick: bool, deadline: float) -> None:
    tiles = TILES[:4] if quick else TILES
    for mask in MASKS:
        for rows, block, warps in tiles:
            for per_sm in (4, 16) if quick else PER_SM:
                if time.time() > deadline:
                    return
                config = dataclasses.replace(
                    shipped.config, rows=rows, block=block, warps=warps, programs_per_sm=per_sm
                )
                sweep.run(Candidate(mask, config), SHAPES[0], "bwd", "1")


def phase2(sweep: Sweep, deadline: float) -> None:
    for mask in MASKS:
        for base in best_candidates(sweep.rows, 3, mask):
            for change in CHANGES:
                if time.time() > deadline:
                    return
                sweep.run(Candidate(mask, dataclasses.replace(base.config, **change)), SHAPES[0], "bwd", "2")


def phase3(sweep: Sweep, deadline: float) -> None:
    for mask in MASKS:
        base = best_candidates(sweep.rows, 1, mask)[0]
        for sum_rows, sum_cols, sum_warps in SUM_TILES:
            if time.time() > deadline:
                return
            config = dataclasses.replace(
                base.config, sum_rows=sum_rows, sum_cols=sum_cols, sum_warps=sum_warps
            )
            sweep.run(Candidate(mask, config), SHAPES[0], "bwd", "3")


def finals(sweep: Sweep, shipped: Candidate, rounds: int) -> list[Candidate]:
    """The shipped candidate and the two best of each mask mode: backward alone at every shape (interleaved
    rounds, median), forward + backward at every shape, the forward once per shape and mask mode, the
    backward without dbias at the first shape, and the GPU checks."""
    finalists = [shipped]
    for mask in MASKS:
        finalists += [c for c in best_candidates(sweep.rows, 3, mask) if c not in finalists][:2]
    for shape in SHAPES:
        times: dict[int, list[float]] = {i: [] for i in range(len(finalists))}
        for _ in range(rounds):
            for i, cand in enumerate(finalists):
                times[i].append(sweep.time(cand, shape, "bwd"))
        for i, cand in enumerate(finalists):
            sweep.note("final", cand, shape, "bwd", statistics.median(times[i]))
        for cand in finalists:
            sweep.run(cand, shape, "fwd+bwd", "final")
        for mask in MASKS:
            sweep.run(next(c for c in finalists if c.mask == mask), shape, "fwd", "final")
        sweep.save()
    for cand in finalists:
        sweep.run(cand, SHAPES[0], "bwd no dbias", "final")
    for cand in finalists[1:]:
        for shape in (SHAPES[0], SHAPES[3]):
            sweep.check(cand, shipped, shape)
    return finalists


def report(
    out_dir: str, env: dict, rows: list[dict], checks: list[dict], winner: str, print_table: bool = True
) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bda_sweep.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "checks": checks, "winner": winner}, f, indent=1)
    lines = [
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; copy {env['copy_GBps']:.0f} GB/s "
        f"(2 GiB, read + write). Command: `{env['command']}`. bias_dropout_add bf16 p=0.1, GPU time (CUDA graph "
        "replays, median). bwd = dx + partial dbias + bias_grad_kernel; fwd+bwd through autograd.",
        "",
        "| phase | shape | pass | mask mode: backward config | ms | % copy | regs | spills |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    order = {"final": 0, "3": 1, "2": 2, "1": 3, "shipped": 4}
    for r in sorted(rows, key=lambda r: (order.get(r["phase"], 5), r["shape"], r["mode"], r["ms"])):
        lines.append(
            f"| {r['phase']} | {r['shape']} | {r['mode']} | {r['label']} | {r['ms']:.4f} | {r['pct_copy']:.1f}% | "
            f"{r['regs']} | {r['spills']} |"
        )
    if checks:
        lines += [
            "",
            "| check shape | config | dx bits = shipped | dbias rel err | dbias deterministic |",
            "|---|---|---|---:|---|",
        ]
        lines += [
            f"| {c['shape']} | {c['label']} | {c['dx_bits_equal_shipped']} | {c['dbias_rel_err']:.2e} | "
            f"{c['dbias_deterministic']} |"
            for c in checks
        ]
    if winner:
        lines += ["", f"Winner: {winner}"]
    with open(os.path.join(out_dir, "bda_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if print_table:
        print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"), help="folder for bda_sweep.md/json")
    ap.add_argument("--quick", action="store_true", help="fewer candidates (a smoke test)")
    ap.add_argument(
        "--budget", type=float, default=120.0, help="seconds after which phases 1-3 start no candidate"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the finals' backward timings"
    )
    ap.add_argument(
        "--rep", type=int, default=40, help="milliseconds of graph replays per timing (kernels.py: 60)"
    )
    args = ap.parse_args()
    t0 = time.time()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from opadvisor.kernels import bias_dropout_add, dropout_add

    dropout_add.SMALL_NUMEL = 0  # the kernels at every shape, as under graph capture (BERT-base included)
    kb = _bench_module()
    kb.REP_MS = args.rep
    copy_gbs = kb.copy_bandwidth()
    env = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "copy_GBps": copy_gbs, "command": "python3 " + " ".join(sys.argv),
        "multiprocessors": torch.cuda.get_device_properties(0).multi_processor_count,
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    sweep = Sweep(kb, dropout_add, bias_dropout_add, copy_gbs, args.out, env)
    shipped = Candidate(dropout_add.MASK_MODE, dropout_add.BACKWARD_CONFIG)
    deadline = t0 + args.budget
    sweep.run(shipped, SHAPES[0], "bwd", "shipped")
    phase1(sweep, shipped, args.quick, deadline)
    sweep.save()
    phase2(sweep, deadline)
    phase3(sweep, deadline)
    sweep.save()
    finalists = finals(sweep, shipped, args.rounds)
    sweep.set(shipped)
    final = [r for r in sweep.rows if r["phase"] == "final" and r["mode"] == "fwd+bwd"]
    top = min((r for r in final if r["shape"] == _shape_label(SHAPES[0])), key=lambda r: r["ms"])
    summary = "; ".join(
        f"{r['shape']} {r['ms']:.4f} ms {r['pct_copy']:.1f}%" for r in final if r["label"] == top["label"]
    )
    ship = "; ".join(
        f"{r['shape']} {r['ms']:.4f} ms {r['pct_copy']:.1f}%" for r in final if r["label"] == _label(shipped)
    )
    config = dropout_add.BackwardConfig(**top["config"])
    winner = f"MASK_MODE = {top['mask']!r}, BACKWARD_CONFIG = {config!r}: fwd+bwd {summary} (shipped: {ship})"
    report(args.out, env, sweep.rows, sweep.checks, winner)
    print(f"finalists {len(finalists)}; total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
