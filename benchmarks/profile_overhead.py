"""What `opadvisor profile` costs: whole-process wall time against the plain script, and the run's sizes.

    python benchmarks/profile_overhead.py [--script examples/bert_train.py] [-- script args]

Runs the plain script for warm-up + window steps (default 3 + 5 = 8), then `opadvisor profile` on the
same script told to train far longer (it stops itself after the window), each as a fresh process with
startup included, `--repeat` times; prints the median wall times, their ratio, the sizes of profile.json
and trace.json.gz, and how the recorded kernels link to ops (a check that GPU attribution works).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--script", default="examples/bert_train.py")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="copy the last run's profile.json here")
    parser.add_argument("script_args", nargs="*")
    args = parser.parse_args()
    script = Path(args.script).resolve()
    total = args.warmup + args.steps
    plain, profiled, run_dir = [], [], None
    for _ in range(args.repeat):
        work = Path(tempfile.mkdtemp(prefix="opadvisor-overhead-"))
        plain.append(timed([sys.executable, str(script), *args.script_args, "--steps", str(total)], work))
        profiled.append(
            timed(
                [
                    sys.executable,
                    "-m",
                    "opadvisor",
                    "profile",
                    str(script),
                    "--warmup",
                    str(args.warmup),
                    "--steps",
                    str(args.steps),
                    "--",
                    *args.script_args,
                    "--steps",
                    "100000",
                ],
                work,
            )
        )
        run_dir = next((work / ".opadvisor" / "runs").iterdir())
    profile_path, trace_path = run_dir / "profile.json", run_dir / "trace.json.gz"
    with gzip.open(trace_path, "rb") as fh:
        trace_bytes = len(fh.read())
    prof = json.loads(profile_path.read_text())
    ops = prof["ops"]
    with_kernels = [o for o in ops if o["kernels"]]
    by_name: dict[str, int] = {}
    for o in ops:
        if o["kernels"]:
            by_name[o["name"]] = by_name.get(o["name"], 0) + len(o["kernels"])
    p, q = statistics.median(plain), statistics.median(profiled)
    print(f"device: {prof['environment'].get('gpu_name') or 'CPU'}; torch {prof['environment']['torch']}")
    print(f"script: {script.name} {' '.join(args.script_args)}; window {args.warmup}+{args.steps} steps")
    print(
        f"plain script, {total} steps, whole process: {p:.2f} s (runs: {', '.join(f'{x:.2f}' for x in plain)})"
    )
    print(
        f"opadvisor profile, same steps, whole process: {q:.2f} s (runs: {', '.join(f'{x:.2f}' for x in profiled)})"
    )
    print(f"ratio: {q / p:.2f}x")
    print(
        f"profile.json: {profile_path.stat().st_size / 1e6:.2f} MB; trace.json.gz: "
        f"{trace_path.stat().st_size / 1e6:.2f} MB ({trace_bytes / 1e6:.1f} MB uncompressed)"
    )
    print(
        f"ops kept: {len(ops)}; ops with kernels: {len(with_kernels)}; "
        f"median step {statistics.median(s['wall_ms'] for s in prof['steps']):.1f} ms"
    )
    for name in (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::native_dropout",
    ):
        print(f"  kernels launched by {name}: {by_name.get(name, 0)}")
    if args.keep:
        args.keep.write_bytes(profile_path.read_bytes())


if __name__ == "__main__":
    main()
