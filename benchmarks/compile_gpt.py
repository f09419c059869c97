"""Issue 33's GPU row: a compiled GPT-2-sized script with four planted torch.compile problems, before and
after `opadvisor apply --rule all`, and its compile time whole against block by block.

    python3 benchmarks/compile_gpt.py --out DIR                                 # one GPU: ~5 min
    python3 benchmarks/compile_gpt.py --out DIR --tiny --backend aot_eager      # CPU smoke run
    python3 benchmarks/compile_gpt.py --out DIR --model llama   # transformers' Llama compiled whole, as is

DIR/a/train.py is benchmarks/compile/gpt_train.py (or llama_train.py: a transformers Llama, nothing planted)
as the user wrote it (a `.item()`, a print of a tensor and
an `if` on a tensor in the forward, a sequence length that changes every step, the model compiled whole).
The pipeline, as a user runs it: `opadvisor profile`, `suggest`, `apply --rule all` (DIR/c/train.py). Each
variant then trains for --steps steps in a fresh process with empty inductor and Triton caches (a cold
start, as on a new machine), and the step times it prints give: the first step's time, the compile time
(the time every step took beyond the steady step, summed: the first compile and any recompile), the
steady ms/step (median of the last half), and the losses. Variant b is c with its block-by-block compile put
back to one whole-model compile with the same arguments (a benchmark edit, not opadvisor's): b against c is
the compile time regional compilation saves, the breaks fixed in both. Writes DIR/compile_gpt.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = {
    "gpt": Path(__file__).resolve().parent / "compile" / "gpt_train.py",  # four planted problems
    "llama": Path(__file__).resolve().parent / "compile" / "llama_train.py",  # transformers' Llama, as is
}
STEP = re.compile(r"^step (\d+) loss ([-\d.eE+naif]+) ms ([\d.]+)$", re.M)
REGIONAL = re.compile(
    r"^(?P<indent>[ \t]*)# regional compilation:[^\n]*\n"
    r"(?P=indent)for (?P<var>\w+) in (?P<model>[\w.]+)\.\w+:[^\n]*\n"
    r"(?P=indent)[ \t]+(?P=var)\.compile\((?P<args>[^\n]*)\)\n"
    r"(?P=indent)(?P<bound>\w+) = (?P=model)\n",
    re.M,
)


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 900) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit {done.returncode}")
    return {"seconds": round(seconds, 2), "stdout": done.stdout, "stderr": done.stderr}


def opadvisor(cwd: Path, *args: str) -> dict[str, Any]:
    return run([sys.executable, "-m", "opadvisor", *args], cwd)


def train(cwd: Path, script_args: list[str]) -> dict[str, Any]:
    """One cold run of cwd/train.py: fresh inductor and Triton caches, its steps parsed."""
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
            "TRITON_CACHE_DIR": f"{cache}/triton",
        }
        done = run([sys.executable, "train.py", *script_args], cwd, env)
    steps = [(int(i), float(loss), float(ms)) for i, loss, ms in STEP.findall(done["stdout"])]
    if not steps:
        raise SystemExit(f"{cwd}/train.py printed no steps: {done['stderr'][-2000:]}")
    ms = [s[2] for s in steps]
    steady = statistics.median(ms[len(ms) // 2 :])
    return {
        "wall_s": done["seconds"],
        "first_step_s": round(ms[0] / 1000, 2),
        "compile_s": round(sum(max(0.0, m - steady) for m in ms) / 1000, 2),
        "steady_ms": round(steady, 2),
        "losses": [s[1] for s in steps],
    }


def whole_again(source: str) -> str:
    """c's source with its regional compilation put back to one compile of the whole model."""
    match = REGIONAL.search(source)
    if match is None:
        return source  # nothing regional to undo: b is c
    g = match.groupdict()
    args = f", {g['args']}" if g["args"] else ""
    return (
        source[: match.start()]
        + f"{g['indent']}{g['bound']} = torch.compile({g['model']}{args})\n"
        + source[match.end() :]
    )


def pipeline(out: Path, script: Path, script_args: list[str], profile_args: list[str]) -> dict[str, Any]:
    a, b, c = (out / v for v in "abc")
    for d in (a, b, c):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    shutil.copy(script, a / "train.py")
    result: dict[str, Any] = {"a": train(a, script_args)}
    print("a (as written):", {k: v for k, v in result["a"].items() if k != "losses"}, flush=True)

    shutil.copy(script, c / "train.py")
    result["profile_s"] = opadvisor(c, "profile", "train.py", *profile_args)["seconds"]
    suggested = opadvisor(c, "suggest", "--format", "json")
    findings = json.loads(suggested["stdout"])["findings"]
    result["suggest_s"] = suggested["seconds"]
    result["findings"] = [
        {
            "rule": f["rule"],
            "line": f["line"],
            "ms": f.get("time_ms_per_step"),
            "fix": f["fix"],
            "message": f["message"],
        }
        for f in findings
    ]
    applied = opadvisor(c, "apply", "--rule", "all")
    result["apply_s"], result["apply_says"] = applied["seconds"], applied["stdout"].strip().splitlines()
    result["c"] = train(c, script_args)
    print("c (apply --rule all):", {k: v for k, v in result["c"].items() if k != "losses"}, flush=True)

    (b / "train.py").write_text(whole_again((c / "train.py").read_text()))
    result["b"] = train(b, script_args)
    print("b (c compiled whole):", {k: v for k, v in result["b"].items() if k != "losses"}, flush=True)
    for v in "bc":
        pairs = zip(result["a"]["losses"], result[v]["losses"], strict=False)
        result[v]["max_loss_rel_diff_vs_a"] = max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(SCRIPTS), default="gpt")
    parser.add_argument("--steps", type=int, default=30, help="steps of each timed run")
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    script_args = ["--steps", str(args.steps), "--backend", args.backend, *(["--tiny"] if args.tiny else [])]
    profile_args = ["--warmup", "3", "--steps", "3", "--", "--steps", "8", *script_args[2:]]
    result = pipeline(args.out, SCRIPTS[args.model], script_args, profile_args)
    (args.out / "compile_gpt.json").write_text(json.dumps(result, indent=1))
    for f in result["findings"]:
        print(f"finding {f['rule']} :{f['line']} fix {f['fix']}: {f['message'][:160]}")
    print("| variant | first step s | compile s | steady ms/step | max loss rel diff vs a |")
    for v, name in (
        ("a", "a: as written (compiled whole)"),
        ("b", "b: c compiled whole again"),
        ("c", "c: apply --rule all"),
    ):
        r = result[v]
        print(
            f"| {name} | {r['first_step_s']} | {r['compile_s']} | {r['steady_ms']} | {r.get('max_loss_rel_diff_vs_a', 0):.2e} |"
        )


if __name__ == "__main__":
    main()
