"""What a failed CUDA-graph capture costs afterwards, on the DeBERTa-style example (examples/deberta_train.py).

    python benchmarks/graph_fallback.py --out $OUT/graph_fallback.md --json $OUT/graph_fallback.json

Its forward copies a Python number to the GPU (`torch.tensor(mid - 1).type_as(relative_pos)` in
make_log_bucket_position), so `cuda_graphed(model)` cannot capture it and falls back to the eager forward.
Each variant trains the model (DeBERTa-v3-base sizes by default, bf16 autocast, AdamW) in a fresh process,
CUDA-synchronised at each step end, and reports the median step after the warm-up (the capture attempt is
in step 1):

    eager                  the example as written
    graphed-fails          cuda_graphed(model): the capture fails at line 78, then every call runs eagerly
    graphed-fails-as-before
                           the same with what the failed attempt left behind kept (no collection, the
                           warm-up stream's cached memory kept: cuda_graphed before this change)
    rewritten-eager        line 78 as `opadvisor apply --rule sparse_launch --unsafe` writes it
                           (torch.full on the device): the same program, no host copy
    rewritten-graphed      the rewrite and cuda_graphed: the capture succeeds, forward and backward replay

What it checks: "graphed-fails" costs no more than "eager" (the fallback adds one attribute check per
call); "rewritten-graphed" is the fastest. Beside each time: reserved memory, the caching allocator's
retries (a sign of memory pressure: frees and synchronisations) and whether the graph captured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "deberta_train.py"
BLOCKER = "torch.tensor(mid - 1).type_as(relative_pos)"
REWRITTEN = "torch.full((), mid - 1, dtype=relative_pos.dtype, device=relative_pos.device)"
VARIANTS = {
    "eager": (False, False, False),  # (rewritten, graphed, keep what a failed capture left)
    "graphed-fails": (False, True, False),
    "graphed-fails-as-before": (False, True, True),
    "rewritten-eager": (True, False, False),
    "rewritten-graphed": (True, True, False),
}


def _load(rewritten: bool, tmp: Path):
    source = EXAMPLE.read_text(encoding="utf-8")
    if BLOCKER not in source:
        raise SystemExit(f"{EXAMPLE} no longer holds {BLOCKER!r}")
    path = tmp / "deberta_variant.py"
    path.write_text(source.replace(BLOCKER, REWRITTEN) if rewritten else source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("deberta_variant", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def child(variant: str, opts: argparse.Namespace) -> dict:
    """One variant, in this process: per-step times (ms) and what the allocator and the graph did."""
    import torch
    import torch.nn.functional as F
    from opadvisor.kernels import cuda_graphed, graphs

    rewritten, graphed, keep = VARIANTS[variant]
    if keep:  # cuda_graphed before this change: nothing freed after a failed capture
        graphs._leave_no_trace = lambda device: None
    ex = _load(rewritten, Path(tempfile.mkdtemp(prefix="graph-fallback-")))  # kept: warnings quote its lines
    device = torch.device(opts.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    args = argparse.Namespace(batch=opts.batch, seq=opts.seq)
    torch.manual_seed(0)
    model = ex.DebertaForSequenceClassification(
        opts.vocab, opts.hidden, opts.layers, opts.heads, opts.buckets, opts.seq, 2, 0.1
    ).to(device)
    if graphed:
        model = cuda_graphed(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(opts.warmup + opts.steps):
        ids, mask, labels = (t.to(device) for t in ex.synthetic_batch(args, min(opts.vocab, 1000), gen))
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids, mask), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        sync()
        times.append((time.perf_counter() - t0) * 1000.0)
    stats = torch.cuda.memory_stats() if device.type == "cuda" else {}
    forward = model.__dict__.get("forward")
    return {
        "variant": variant,
        "times_ms": times[opts.warmup :],
        "first_step_ms": times[0],
        "reserved_gib": torch.cuda.memory_reserved() / 2**30 if device.type == "cuda" else 0.0,
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "captured": bool(getattr(forward, "graphs", None)),
        "capture_failed": bool(getattr(forward, "failed", False)),
        "reason": getattr(forward, "disabled_reason", None),
    }


def run(variant: str, opts: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, *opts.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, check=False)
    if proc.returncode != 0:
        return {"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    warned = [ln.strip()[:300] for ln in proc.stderr.splitlines() if "cuda_graphed" in ln]
    row["warnings"] = warned
    return row


def markdown(rows: list[dict], header: dict) -> str:
    out = [f"## A failed CUDA-graph capture, afterwards ({header['device']})", ""]
    out += [f"- {k}: {v}" for k, v in header.items()]
    out += [
        "",
        "| variant | median step ms | p25 - p75 | vs eager | first step ms | reserved GiB | alloc retries | graph |",
    ]
    out += ["|---|---:|---:|---:|---:|---:|---:|---|"]
    base = next(
        (statistics.median(r["times_ms"]) for r in rows if r["variant"] == "eager" and "times_ms" in r), None
    )
    for r in rows:
        if "error" in r:
            out.append(f"| {r['variant']} | failed: {r['error']} | | | | | | |")
            continue
        t = sorted(r["times_ms"])
        med = statistics.median(t)
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [med, med, med]
        graph = "captured" if r["captured"] else ("capture failed" if r["capture_failed"] else "-")
        vs = f"{med / base:.2f}x" if base else "-"
        out.append(
            f"| {r['variant']} | {med:.2f} | {q[0]:.2f} - {q[2]:.2f} | {vs} | {r['first_step_ms']:.0f} | "
            f"{r['reserved_gib']:.1f} | {r['alloc_retries']} | {graph} |"
        )
    warned = [w for r in rows for w in r.get("warnings", [])[:1]]
    if warned:
        out += ["", "What cuda_graphed said (first line per variant):"] + [f"    {w}" for w in warned]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument(
        "--warmup", type=int, default=5, help="steps before timing (the capture is in step 1)"
    )
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128100)
    parser.add_argument("--buckets", type=int, default=256)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS)
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke test of the script
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(opts.child, opts)))
        return 0
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/graph_fallback.py needs a CUDA device", file=sys.stderr)
        return 2
    names = [v.strip() for v in opts.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}")
    keys = ("steps", "warmup", "hidden", "layers", "heads", "seq", "batch", "vocab", "buckets", "device")
    opts.passthrough = [a for k in keys for a in (f"--{k}", str(getattr(opts, k)))]
    header = {
        "device": torch.cuda.get_device_name(0) if opts.device == "cuda" else opts.device,
        "torch": torch.__version__,
        "command": "python benchmarks/graph_fallback.py " + " ".join(sys.argv[1:]),
        "model": " ".join(opts.passthrough[4:-2]) + ", bf16 autocast, AdamW",
        "timing": f"median of {opts.steps} steps after {opts.warmup}, each variant in a fresh process",
    }
    rows = []
    for name in names:
        t0 = time.perf_counter()
        rows.append(run(name, opts))
        print(f"[{name}] done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        text = markdown(rows, header)
        if opts.out:
            opts.out.write_text(text, encoding="utf-8")
        if opts.json:
            opts.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
