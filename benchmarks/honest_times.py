"""Plain vs profiled step, scaled idle findings, and verify's timing on an example, end to end.

    python benchmarks/honest_times.py [--example bert_train.py] [--verify-repeats 3] -- SCRIPT_ARGS

In a fresh folder holding a copy of examples/<example> as train.py, as a user would:

1. `opadvisor profile train.py --warmup 6 --calibrate 4 --steps 5 -- ARGS`, then `opadvisor suggest
   --format json`: the plain step (timed without the profiler) beside the profiled one, GPU busy, the idle
   scale, and each idle-based finding (sparse_launch, host_sync, dataloader_stall) as profiled and as
   scaled to the plain step;
2. `opadvisor apply --rule all` (the safe fixes), then `opadvisor verify --steps 10 --warmup 5 --repeats R
   --format json`: the whole-step verdict with its 95% interval, the time of each rule as it was added (they
   add up to the whole step's), which implementation each fused call ran, the worst gradient tensor and
   the tolerances used.

Every JSON document goes to $OUT/<example stem>/ (or --out); a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IDLE_RULES = ("sparse_launch", "host_sync", "dataloader_stall")


def opadvisor(cwd: Path, *args: str, ok: tuple[int, ...] = (0,)) -> str:
    proc = subprocess.run([sys.executable, "-m", "opadvisor", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode not in ok:
        sys.exit(f"opadvisor {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def summary(suggest: dict, verify: dict | None) -> str:
    cal = suggest["calibration"]
    lines = [
        "| plain step ms | profiled step ms | GPU busy ms | idle plain ms | idle profiled ms | idle scale |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {_ms(cal['plain_step_ms'])} | {_ms(cal['profiled_step_ms'])} | {_ms(cal['gpu_busy_ms'])} | "
        f"{_ms(cal['plain_idle_ms'])} | {_ms(cal['profiled_idle_ms'])} | {cal['idle_scale']:.3f} |",
        "",
        "| idle-based finding | line | saving ms (scaled) | profiled ms |",
        "|---|---:|---:|---:|",
    ]
    for f in suggest["findings"]:
        if f["rule"] in IDLE_RULES:
            lines.append(
                f"| {f['rule']} | {f['line']} | {_ms(f['est_saving_ms_per_step'])} | "
                f"{_ms(f['profiled_time_ms_per_step'])} |"
            )
    if verify is None:
        return "\n".join(lines)
    t = verify.get("timing") or {}
    lines += [
        "",
        f"verify: parity {'ok' if verify['parity']['ok'] else 'FAILED'} ({verify['parity']['message']})",
        f"step {_ms(t.get('before', {}).get('median_ms'))} -> {_ms(t.get('after', {}).get('median_ms'))} ms: "
        f"{t.get('verdict')}, {t.get('speedup', 0):.3f}x "
        f"(95% {t.get('speedup_low', 0):.3f}x .. {t.get('speedup_high', 0):.3f}x)",
        "",
        "| rule added | before ms | after ms | saved ms | 95% interval ms | verdict |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in t.get("rules") or []:
        lines.append(
            f"| {r['rule']} | {_ms(r['before']['median_ms'])} | {_ms(r['after']['median_ms'])} | "
            f"{_ms(r['saved_ms'])} | {_ms(r['saved_low_ms'])} .. {_ms(r['saved_high_ms'])} | {r['verdict']} |"
        )
    if t.get("rules"):
        lines.append(f"| sum of rows | | | {_ms(sum(r['saved_ms'] for r in t['rules']))} | | |")
    for c in verify.get("fused_calls", []):
        lines.append(f"fused calls: {c['op']} ({', '.join(c['rules']) or '-'}): {c['counts']}")
    grads = verify["parity"].get("gradients") or {}
    worst = grads.get("worst") or {}
    lines.append(
        f"gradients: {grads.get('compared')} compared, worst {worst.get('name')} rel {worst.get('rel_error')} "
        f"(tolerance {grads.get('tolerance')})"
    )
    lines += [f"warning: {w}" for w in verify.get("warnings", [])]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--example", default="bert_train.py")
    ap.add_argument("--verify-repeats", type=int, default=3)
    ap.add_argument("--no-verify", action="store_true", help="profile and suggest only")
    ap.add_argument("--out", type=Path, help="where the JSON goes (default $OUT/<example stem>)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = ap.parse_args(argv[:cut])
    script_args = argv[cut + 1 :]
    stem = Path(opts.example).stem
    out = opts.out or (Path(os.environ["OUT"]) / stem if "OUT" in os.environ else None)
    work = Path(tempfile.mkdtemp(prefix=f"opadvisor-honest-{stem}-"))
    shutil.copy(ROOT / "examples" / opts.example, work / "train.py")
    run_args = [*script_args, "--steps", "1000"]  # the script is stopped after what each command needs
    print(f"honest_times: profiling {opts.example} ...", file=sys.stderr, flush=True)
    opadvisor(
        work, "profile", "train.py", "--warmup", "6", "--calibrate", "4", "--steps", "5", "--", *run_args
    )
    suggest = json.loads(opadvisor(work, "suggest", "--format", "json"))
    verify = None
    if not opts.no_verify:
        print("honest_times: apply --rule all, verify ...", file=sys.stderr, flush=True)
        opadvisor(work, "apply", "--rule", "all")
        verify = json.loads(
            opadvisor(
                work,
                "verify",
                "--steps",
                "10",
                "--warmup",
                "5",
                "--repeats",
                str(opts.verify_repeats),
                "--format",
                "json",
                ok=(0, 1),
            )
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "suggest.json").write_text(json.dumps(suggest, indent=1))
        if verify is not None:
            (out / "verify.json").write_text(json.dumps(verify, indent=1))
    print(f"\nexamples/{opts.example} {' '.join(script_args)}\n")
    print(summary(suggest, verify))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
