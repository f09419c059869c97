"""What the profiler's detail costs a step, and whether calibration measures GPU idle honestly.

    python benchmarks/profiler_cost.py [--script examples/bert_train.py] [--warmup 6 --steps 5]
        [--variants full,shapes,light] -- SCRIPT_ARGS

For each variant, a fresh process runs the script under `opadvisor profile`'s session (the same code: the
plain warm-up steps are timed by the calibration, the window by the profiler) with the profiler recording

    full    shapes and Python stacks: what `opadvisor profile` records (the rules need both)
    shapes  shapes, no stacks
    light   neither: ops and kernels only

and reports per step (medians; GPU busy and idle are means over the window): the plain step (the
calibration: CUDA-synchronised, no profiler), the profiled step, GPU busy time, GPU idle under the profiler
(step length - busy) and in the plain step (plain - busy), and the idle scale `suggest` applies
(plain idle / profiled idle). If the light pass's profiled step is close to the plain one, a light pass
would measure idle directly; otherwise calibration (the scale) is what keeps the idle findings honest.

Writes $OUT/profiler_cost.json (or --json) and prints a markdown table last. Needs a GPU for the idle
columns (on a CPU it still times the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"full": (True, True), "shapes": (True, False), "light": (False, False)}

_CHILD = """
import json, sys
from pathlib import Path
from opadvisor.profile.runner import run_script
from opadvisor.profile.session import SessionConfig
from opadvisor.rules._index import index_of

cfg = json.loads(sys.argv[1])
config = SessionConfig(warmup=cfg["warmup"], steps=cfg["steps"], calibrate=cfg["calibrate"],
                       record_shapes=cfg["shapes"], with_stack=cfg["stack"])
outcome = run_script(Path(cfg["script"]), cfg["args"], config, out=Path(cfg["out"]))
if outcome.profile is None:
    sys.exit(f"nothing recorded: {outcome.status}")
cal = index_of(outcome.profile).calibration
print("RESULT " + json.dumps(cal.to_json()))
"""


def run_variant(name: str, opts: argparse.Namespace, script_args: list[str]) -> dict:
    shapes, stack = VARIANTS[name]
    with tempfile.TemporaryDirectory(prefix="opadvisor-profcost-") as tmp:
        cfg = {
            "script": str(opts.script.resolve()),
            "args": script_args,
            "warmup": opts.warmup,
            "steps": opts.steps,
            "calibrate": opts.calibrate,
            "shapes": shapes,
            "stack": stack,
            "out": str(Path(tmp) / "run"),
        }
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True, cwd=tmp
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"variant {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"variant": name, "record_shapes": shapes, "with_stack": stack, **json.loads(lines[-1][7:])}


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    out = [
        "| variant | plain ms | profiled ms | profiled / plain | GPU busy ms | idle profiled ms | idle plain ms "
        "| idle scale |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        plain, prof = r["plain_step_ms"], r["profiled_step_ms"]
        ratio = prof / plain if plain and prof else None
        out.append(
            f"| {r['variant']} | {_fmt(plain)} | {_fmt(prof)} | {_fmt(ratio)} | {_fmt(r['gpu_busy_ms'])} | "
            f"{_fmt(r['profiled_idle_ms'])} | {_fmt(r['plain_idle_ms'])} | {_fmt(r['idle_scale'], '.3f')} |"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", type=Path, default=Path("examples/bert_train.py"))
    ap.add_argument("--warmup", type=int, default=6, help="warm-up steps (the last --calibrate are timed)")
    ap.add_argument("--calibrate", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="steps recorded by the profiler")
    ap.add_argument("--variants", default="full,shapes,light")
    ap.add_argument("--json", type=Path, help="where to write the results (default $OUT/profiler_cost.json)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = ap.parse_args(argv[:cut])
    script_args = argv[cut + 1 :]
    names = [v.strip() for v in opts.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    rows = []
    for name in names:
        print(f"profiler_cost: {name} ...", file=sys.stderr, flush=True)
        rows.append(run_variant(name, opts, script_args))
    dest = opts.json or (Path(os.environ["OUT"]) / "profiler_cost.json" if "OUT" in os.environ else None)
    if dest is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps({"script": str(opts.script), "args": script_args, "rows": rows}, indent=1))
    print(f"\n{opts.script} {' '.join(script_args)}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
