"""Issue 22 on the GPU: activation checkpointing through profile -> apply -> verify, and recurrent models.

    python benchmarks/memory_rnn.py checkpoint   # GPT example: peak memory and step time, before and after
    python benchmarks/memory_rnn.py lstm         # hfai's LSTM size: a loop of LSTMCell vs one fused call
    python benchmarks/memory_rnn.py lstm-e2e     # examples/lstm_train.py at that size: profile -> apply -> verify

Each mode fits in a few minutes on one H200; the numbers go to $OUT/<mode>.json (when OUT is set, else the
current folder) and a short table is printed last.

checkpoint: examples/gpt_train.py (default hidden 768, 12 layers, 12 heads, sequence 1024, batch 16, bf16
    autocast: GPT-2 small) is copied to a temporary project and run through what a user would:
        opadvisor profile gpt_train.py --memory --steps 3 --warmup 3 -- SIZES
        opadvisor suggest --format json            # the memory section and the activation_checkpointing finding
        opadvisor apply --rule activation_checkpointing
        opadvisor verify --steps 10 --warmup 3 --repeats 2 --no-reprofile --format json
    It reports the profile's peak (reserved, allocated) and activation memory, what the finding names and
    estimates (memory freed, recompute time), and verify's parity, peak memory and step time before and after.
    It also profiles the script once more with --no-activations: the profiled step time with and without
    the saved-tensor hooks (their overhead).

lstm: input 985, hidden 985, batch 4, sequence 1000 (hfai's configuration), forward + backward of
    (a) a Python loop over nn.LSTMCell, (b) opadvisor.kernels.cell_sequence on that cell (the rewrite),
    (c) nn.LSTM (cuDNN, packed weights), (d) nn.LSTM after a weight's `.data` was replaced (not packed any more:
    the cudnn_rnn case), (e) the same after flatten_parameters(); each in float32 and under bf16 autocast. Median of
    --reps wall times (CUDA synchronised before and after each) after --warmup runs. Also checks (b) against (a): outputs and gradients.

lstm-e2e: examples/lstm_train.py at that size through profile -> suggest -> apply --rule rnn_cell_loop ->
    verify (parity, then timing): the rule's finding and the measured step time before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
GIB = float(1 << 30)


def out_dir() -> Path:
    path = Path(os.environ.get("OUT") or ".")
    path.mkdir(parents=True, exist_ok=True)
    return path


def opadvisor(cwd: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "opadvisor", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    print(f"$ opadvisor {' '.join(args)}: exit {done.returncode}", file=sys.stderr, flush=True)
    return done


def need(done: subprocess.CompletedProcess[str], what: str) -> subprocess.CompletedProcess[str]:
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def environment() -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def median_profiled_step_ms(run: Path) -> float:
    data = json.loads((run / "profile.json").read_text())
    return statistics.median(s["wall_ms"] for s in data["steps"])


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


# ---- checkpoint --------------------------------------------------------------------------------------------
def bench_checkpoint(opts: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="opadvisor-ckpt-"))
    script = work / "gpt_train.py"
    shutil.copy(EXAMPLES / "gpt_train.py", script)
    sizes = ["--hidden", str(opts.hidden), "--layers", str(opts.layers), "--heads", str(opts.heads)]
    sizes += ["--seq", str(opts.seq), "--batch", str(opts.batch), "--dtype", "bf16", "--steps", "1000"]
    profile = ["profile", script.name, "--memory", "--steps", "3", "--warmup", "3"]
    need(opadvisor(work, *profile, "--out", "run", "--", *sizes), "profile")
    need(
        opadvisor(
            work,
            *profile[:2],
            "--no-activations",
            "--steps",
            "3",
            "--warmup",
            "3",
            "--out",
            "plain",
            "--",
            *sizes,
        ),
        "profile --no-activations",
    )
    doc = json.loads(need(opadvisor(work, "suggest", "run", "--format", "json"), "suggest").stdout)
    findings = [f for f in doc["findings"] if f["rule"] == "activation_checkpointing"]
    need(opadvisor(work, "apply", "--rule", "activation_checkpointing", "run"), "apply")
    diff = [ln for ln in script.read_text().splitlines() if "checkpoint" in ln]
    verify = [
        "verify",
        "run",
        "--steps",
        str(opts.steps),
        "--warmup",
        "3",
        "--repeats",
        "2",
        "--no-reprofile",
    ]
    report = json.loads(need(opadvisor(work, *verify, "--format", "json"), "verify").stdout)
    return {
        "mode": "checkpoint",
        "sizes": " ".join(sizes),
        "environment": environment(),
        "profile_memory": doc["memory"],
        "finding": findings[0] if findings else None,
        "rewritten_lines": diff,
        "profiled_step_ms": {
            "activations": median_profiled_step_ms(work / "run"),
            "no_activations": median_profiled_step_ms(work / "plain"),
        },
        "verify": {"ok": report["ok"], "parity": report["parity"]["message"], "timing": report["timing"]},
    }


def table_checkpoint(res: dict[str, Any]) -> str:
    mem, f, t = res["profile_memory"] or {}, res["finding"] or {}, res["verify"]["timing"] or {}
    d = f.get("details", {})
    peaks = t.get("peak_memory") or {}
    before, after = peaks.get("before") or {}, peaks.get("after") or {}
    steps = res["profiled_step_ms"]
    rows = [
        (
            "profile: peak reserved / device",
            f"{gib(mem.get('peak_reserved_bytes'))} / {gib(mem.get('device_bytes'))}",
        ),
        ("profile: saved for backward per step", gib(mem.get("saved_bytes_per_step"))),
        (
            "finding: blocks, their activations",
            f"{len(d.get('modules', []))} blocks, {gib(d.get('activation_bytes'))}",
        ),
        (
            "finding: est. freed, est. recompute",
            f"{gib(d.get('est_memory_saving_bytes'))}, {d.get('extra_compute_ms_per_step') or 0:.1f} ms/step",
        ),
        ("verify: parity", res["verify"]["parity"]),
        (
            "verify: peak allocated before -> after",
            f"{gib(before.get('allocated_bytes'))} -> {gib(after.get('allocated_bytes'))}",
        ),
        (
            "verify: peak reserved before -> after",
            f"{gib(before.get('reserved_bytes'))} -> {gib(after.get('reserved_bytes'))}",
        ),
        (
            "verify: median step before -> after",
            f"{t.get('before', {}).get('median_ms', 0):.1f} -> {t.get('after', {}).get('median_ms', 0):.1f} ms",
        ),
        ("profiled step, hooks on / off", f"{steps['activations']:.1f} / {steps['no_activations']:.1f} ms"),
    ]
    return "\n".join(f"{k:<42} {v}" for k, v in rows)


# ---- lstm (micro) ---------------------------------------------------------------------------------------------
def bench_lstm(opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from opadvisor.kernels import cell_sequence
    from torch import nn

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke test at small sizes
    cell = nn.LSTMCell(opts.input, opts.hidden).to(dev)
    lstm = nn.LSTM(opts.input, opts.hidden).to(dev)
    scattered, repacked = (nn.LSTM(opts.input, opts.hidden).to(dev) for _ in range(2))
    for layer in (scattered, repacked):  # a weight's .data replaced after .to(): out of the packed buffer
        layer.weight_hh_l0.data = layer.weight_hh_l0.detach().clone()
    x = torch.randn(opts.seq, opts.batch, opts.input, device=dev, requires_grad=True)

    def loop() -> torch.Tensor:
        h = x.new_zeros(opts.batch, opts.hidden)
        c = x.new_zeros(opts.batch, opts.hidden)
        outs = []
        for t in range(x.size(0)):
            h, c = cell(x[t], (h, c))
            outs.append(h)
        return torch.stack(outs)

    def flattened() -> torch.Tensor:  # what the cudnn_rnn fix writes: flatten_parameters() before the call
        repacked.flatten_parameters()
        return repacked(x)[0]

    variants = {
        "loop of nn.LSTMCell": loop,
        "cell_sequence(cell) (the rewrite)": lambda: cell_sequence(cell, x)[0],
        "nn.LSTM (packed weights)": lambda: lstm(x)[0],
        "nn.LSTM (a weight's .data replaced)": lambda: scattered(x)[0],
    }
    results: dict[str, Any] = {
        "mode": "lstm",
        "environment": environment(),
        "config": dict(vars(opts)),
        "rows": [],
    }
    for dtype in ("fp32", "bf16"):
        for name, fn in [*variants.items(), ("nn.LSTM (.data replaced, flatten_parameters())", flattened)]:
            ms = time_fwd_bwd(fn, dtype, opts.warmup, opts.reps)
            results["rows"].append({"variant": name, "dtype": dtype, "ms": ms})
            print(f"{name:<44} {dtype}: {ms:.2f} ms", file=sys.stderr, flush=True)
    results["check"] = check_rewrite(loop, lambda: cell_sequence(cell, x)[0], [x, *cell.parameters()])
    return results


def time_fwd_bwd(fn, dtype: str, warmup: int, reps: int) -> float:
    import warnings

    import torch

    cuda = torch.cuda.is_available()
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the not-packed variant warns at every call: measured, not shown
        for i in range(warmup + reps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                out = fn()
            out.float().sum().backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def check_rewrite(loop, rewrite, leaves) -> dict[str, float]:
    """Largest differences between the loop and the rewrite: outputs and every gradient (float32)."""
    import torch

    grads = []
    outs = []
    for fn in (loop, rewrite):
        for t in leaves:
            t.grad = None
        out = fn()
        out.sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in leaves])
    return {
        "output_max_abs_diff": float((outs[0] - outs[1]).abs().max()),
        "grad_max_rel_diff": max(
            float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in zip(*grads, strict=True)
        ),
        "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def table_lstm(res: dict[str, Any]) -> str:
    rows = res["rows"]
    base = {r["dtype"]: r["ms"] for r in rows if r["variant"] == "loop of nn.LSTMCell"}
    lines = [f"{'variant':<44} {'dtype':<5} {'fwd+bwd ms':>10} {'vs loop':>8}"]
    for r in rows:
        lines.append(
            f"{r['variant']:<44} {r['dtype']:<5} {r['ms']:>10.2f} {base[r['dtype']] / r['ms']:>7.1f}x"
        )
    c = res["check"]
    lines.append(
        f"rewrite vs loop (fp32): output max diff {c['output_max_abs_diff']:.2e}, grad max rel diff {c['grad_max_rel_diff']:.2e}"
    )
    return "\n".join(lines)


# ---- lstm-e2e ---------------------------------------------------------------------------------------------------
def bench_lstm_e2e(opts: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="opadvisor-lstm-"))
    script = work / "lstm_train.py"
    shutil.copy(EXAMPLES / "lstm_train.py", script)
    sizes = ["--input", str(opts.input), "--hidden", str(opts.hidden), "--batch", str(opts.batch)]
    sizes += ["--seq", str(opts.seq), "--steps", "1000"]
    need(
        opadvisor(
            work, "profile", script.name, "--steps", "2", "--warmup", "2", "--out", "run", "--", *sizes
        ),
        "profile",
    )
    doc = json.loads(need(opadvisor(work, "suggest", "run", "--format", "json"), "suggest").stdout)
    findings = [f for f in doc["findings"] if f["rule"] in ("rnn_cell_loop", "cudnn_rnn")]
    need(opadvisor(work, "apply", "--rule", "rnn_cell_loop", "run"), "apply")
    verify = ["verify", "run", "--steps", "5", "--warmup", "2", "--no-reprofile", "--format", "json"]
    report = json.loads(need(opadvisor(work, *verify), "verify").stdout)
    return {
        "mode": "lstm-e2e",
        "sizes": " ".join(sizes),
        "environment": environment(),
        "findings": findings,
        "rewritten": [ln.strip() for ln in script.read_text().splitlines() if "cell_sequence" in ln],
        "verify": {"ok": report["ok"], "parity": report["parity"]["message"], "timing": report["timing"]},
    }


def table_lstm_e2e(res: dict[str, Any]) -> str:
    t = res["verify"]["timing"] or {}
    lines = [f"{f['rule']}: {f['message']}" for f in res["findings"]]
    lines.append(f"rewritten: {'; '.join(res['rewritten'])}")
    lines.append(f"verify parity: {res['verify']['parity']}")
    if t:
        lines.append(
            f"median step: {t['before']['median_ms']:.1f} ms -> {t['after']['median_ms']:.1f} ms ({t['speedup']:.2f}x)"
        )
    return "\n".join(lines)


MODES = {
    "checkpoint": (bench_checkpoint, table_checkpoint),
    "lstm": (bench_lstm, table_lstm),
    "lstm-e2e": (bench_lstm_e2e, table_lstm_e2e),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--hidden", type=int, default=None, help="checkpoint: 768; lstm: 985")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=None, help="checkpoint: 1024; lstm: 1000")
    parser.add_argument("--batch", type=int, default=None, help="checkpoint: 16; lstm: 4")
    parser.add_argument("--input", type=int, default=985)
    parser.add_argument("--steps", type=int, default=10, help="verify's timed steps (checkpoint)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    opts = parser.parse_args()
    lstm = opts.mode.startswith("lstm")
    opts.hidden = opts.hidden or (985 if lstm else 768)
    opts.seq = opts.seq or (1000 if lstm else 1024)
    opts.batch = opts.batch or (4 if lstm else 16)
    bench, table = MODES[opts.mode]
    started = time.perf_counter()
    result = bench(opts)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    path = out_dir() / f"{opts.mode.replace('-', '_')}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    print(table(result))


if __name__ == "__main__":
    main()
