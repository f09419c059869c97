"""End to end: each example at a realistic size, before and after `opadvisor apply`, eager and compiled.

    python benchmarks/e2e.py --out benchmarks/e2e.md          # on a GPU, with opadvisor installed

For each example script (examples/bert_train.py, examples/gpt_train.py) this copies it to a temporary folder
twice (an untouched original, and a working copy), then in the working copy runs what a user would:

    opadvisor profile SCRIPT --steps 3 --warmup 3 -- SIZES
    opadvisor apply --rule sdpa_attention --unsafe     # the whole attention -> SDPA (first: it covers the
    opadvisor apply --rule all                         #  softmax chain), then every safe fix that remains
    opadvisor verify --steps 5 --no-timing --no-reprofile --format json   # the rewrite is still correct

and times four variants, each in a fresh process under verify's harness (`opadvisor.verify.harness`, timing
mode: CUDA synchronised at each optimizer step, the first --warmup steps dropped, median of --steps):
original eager, original with --compile (torch.compile of the model), rewritten eager, rewritten with
--compile. With --graphs it then applies sparse_launch's unsafe fix on top (`opadvisor apply --rule
sparse_launch --unsafe`: the model in `opadvisor.kernels.cuda_graphed`), verifies it, and times two more.
The table (markdown) goes to stdout and to --out, with the device, the versions and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from opadvisor.verify.compare import StepTimes, step_times
from opadvisor.verify.runner import ChildSpec, run_child

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = {"bert": "bert_train.py", "gpt": "gpt_train.py"}


@dataclass
class Row:
    example: str
    variant: str
    times: StepTimes | None
    error: str | None = None


def opadvisor(cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opadvisor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def applied_lines(output: str) -> list[str]:
    """The `file:line: rule: what` lines apply prints for each rewrite it made."""
    return [
        ln.strip()
        for ln in output.splitlines()
        if ln.count(":") >= 3
        and "not applied" not in ln
        and ": note: " not in ln
        and ": skipped: " not in ln
        and ln.split(":", 1)[0].endswith(".py")
    ]


def time_variant(
    script: Path, args: list[str], opts: argparse.Namespace
) -> tuple[StepTimes | None, str | None]:
    spec = ChildSpec(
        script=str(script),
        argv=[script.name, *args],
        cwd=str(script.parent),
        steps=opts.steps,
        warmup=opts.warmup,
        mode="timing",
    )
    res = run_child(spec, timeout=opts.timeout)
    if res.error is not None:
        return None, res.error.strip().splitlines()[-1]
    return step_times(res.result or {}, opts.warmup), None


class Log(list):
    """Lines of what each step printed; each also goes to stderr as it happens (progress)."""

    def append(self, line: str) -> None:
        super().append(line)
        print(line.splitlines()[0] if line else line, file=sys.stderr, flush=True)


def bench_example(name: str, tmp: Path, opts: argparse.Namespace, log: list[str]) -> tuple[list[Row], dict]:
    src = EXAMPLES / SCRIPTS[name]
    orig_dir, work_dir = tmp / name / "original", tmp / name / "work"
    orig_dir.mkdir(parents=True)
    work_dir.mkdir(parents=True)
    orig, work = orig_dir / src.name, work_dir / src.name
    shutil.copy(src, orig)
    shutil.copy(src, work)
    sizes = [
        "--device",
        opts.device,
        "--dtype",
        opts.dtype,
        "--hidden",
        str(opts.hidden),
        "--layers",
        str(opts.layers),
        "--heads",
        str(opts.heads),
        "--seq",
        str(opts.seq),
        "--batch",
        str(opts.batch),
        "--steps",
        str(opts.warmup + opts.steps + 5),
    ]
    info: dict = {"sizes": " ".join(sizes), "applied": [], "parity": None}

    proc = opadvisor(
        work_dir, "profile", src.name, "--steps", "3", "--warmup", "3", "--", *sizes, timeout=opts.timeout
    )
    log.append(f"[{name}] profile: exit {proc.returncode}")
    if proc.returncode != 0:
        info["error"] = "profile failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    else:
        for rule_args in (["--rule", "sdpa_attention", "--unsafe"], ["--rule", "all"]):
            proc = opadvisor(work_dir, "apply", *rule_args, timeout=opts.timeout)
            log.append(
                f"[{name}] apply {' '.join(rule_args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}"
                f"{proc.stderr[-1000:]}"
            )
            info["applied"] += applied_lines(proc.stdout + "\n" + proc.stderr)
        if opts.parity and info["applied"]:
            info["parity"] = parity(work_dir, opts)
            log.append(f"[{name}] verify: {info['parity']}")

    rows = []
    variants = [
        ("original, eager", orig, []),
        ("original, torch.compile", orig, ["--compile"]),
        ("opadvisor apply, eager", work, []),
        ("opadvisor apply, torch.compile", work, ["--compile"]),
    ]
    graph_variants = [
        ("apply + CUDA graphs (sparse_launch, unsafe), eager", work, []),
        ("apply + CUDA graphs (sparse_launch, unsafe), torch.compile", work, ["--compile"]),
    ]
    for variant, script, extra in variants:
        if script is work and not info["applied"]:
            rows.append(Row(name, variant, None, "nothing applied"))
            continue
        rows.append(_timed_row(name, variant, script, [*sizes, *extra], opts, log))
    # on top of the timed rewrite, in the same folder (the run's paths): the model in cuda_graphed
    if opts.graphs and info["applied"] and _apply_cuda_graphs(work_dir, opts, log, info):
        for variant, script, extra in graph_variants:
            rows.append(_timed_row(name, variant, script, [*sizes, *extra], opts, log))
    return rows, info


def _timed_row(
    name: str, variant: str, script: Path, args: list[str], opts: argparse.Namespace, log: list[str]
) -> Row:
    t0 = time.perf_counter()
    times, error = time_variant(script, args, opts)
    log.append(
        f"[{name}] {variant}: {times.median_ms if times else error} ({time.perf_counter() - t0:.0f} s)"
    )
    return Row(name, variant, times, error)


def parity(work_dir: Path, opts: argparse.Namespace) -> str:
    """`opadvisor verify`'s parity verdict for the rewrite in `work_dir` (5 steps, dropout off)."""
    proc = opadvisor(
        work_dir, "verify", "--steps", "5", "--no-timing", "--no-reprofile", "--format", "json",
        timeout=opts.timeout,
    )  # fmt: skip
    try:
        p = json.loads(proc.stdout)["parity"]
        return f"{'passed' if p['ok'] else 'FAILED'} ({p['message']})"
    except (json.JSONDecodeError, KeyError):
        return f"verify exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"


def _apply_cuda_graphs(work_dir: Path, opts: argparse.Namespace, log: list[str], info: dict) -> bool:
    """sparse_launch's unsafe fix (the model wrapped in `cuda_graphed`) on top of the rewrite in `work_dir`;
    True when apply wrote it."""
    proc = opadvisor(work_dir, "apply", "--rule", "sparse_launch", "--unsafe", timeout=opts.timeout)
    lines = applied_lines(proc.stdout + "\n" + proc.stderr)
    log.append(
        f"[graphs] apply --rule sparse_launch --unsafe: exit {proc.returncode}\n{proc.stdout[-2000:]}"
        f"{proc.stderr[-1000:]}"
    )
    info["graphs_applied"] = lines
    if opts.parity and lines:
        info["graphs_parity"] = parity(work_dir, opts)
        log.append(f"[graphs] verify: {info['graphs_parity']}")
    return bool(lines)


def markdown(
    rows: list[Row], infos: dict[str, dict], opts: argparse.Namespace, header: dict[str, str]
) -> str:
    out = [f"## End to end: examples before and after `opadvisor apply` ({header['device']})", ""]
    out += [f"- {k}: {v}" for k, v in header.items()]
    out += [
        "",
        "| example | variant | median step ms | p25 - p75 ms | speedup vs original eager |",
        "|---|---|---:|---:|---:|",
    ]
    for name in infos:
        base = next((r.times for r in rows if r.example == name and r.variant == "original, eager"), None)
        for r in (r for r in rows if r.example == name):
            if r.times is None:
                out.append(f"| {name} | {r.variant} | - | - | {r.error} |")
                continue
            sp = f"{base.median_ms / r.times.median_ms:.2f}x" if base else "-"
            out.append(
                f"| {name} | {r.variant} | {r.times.median_ms:.2f} | "
                f"{r.times.p25_ms:.2f} - {r.times.p75_ms:.2f} | {sp} |"
            )
    for name, info in infos.items():
        out += ["", f"**{name}** (`{SCRIPTS[name]} {info['sizes']}`)"]
        if info.get("error"):
            out.append(f"- {info['error']}")
        out.append("- rewrites applied: " + ("none" if not info["applied"] else ""))
        out += [f"  - `{line}`" for line in info["applied"]]
        if info["parity"]:
            out.append(f"- loss parity (opadvisor verify, 5 steps, dropout off): {info['parity']}")
        if info.get("graphs_applied"):
            out.append("- then, for the CUDA-graphs rows (`apply --rule sparse_launch --unsafe`):")
            out += [f"  - `{line}`" for line in info["graphs_applied"]]
        if info.get("graphs_parity"):
            out.append(
                f"- loss parity of that rewrite (all of it against the original): {info['graphs_parity']}"
            )
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--examples", default="bert,gpt", help="comma-separated: bert, gpt")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of this script")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="steps before timing (compilation, autotuning)")
    parser.add_argument("--no-parity", dest="parity", action="store_false", help="skip opadvisor verify")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="also time the rewrite with sparse_launch's unsafe fix (the model in cuda_graphed), eager and compiled",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess")
    parser.add_argument("--log", type=Path, help="write what each step printed here")
    parser.add_argument(
        "--keep", type=Path, help="work in this new folder and keep it (the original and rewritten copies)"
    )
    opts = parser.parse_args()

    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/e2e.py needs a CUDA device (--device cpu runs a smoke test)", file=sys.stderr)
        return 2
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    header = {
        "device": torch.cuda.get_device_name(0) if opts.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "command": "python benchmarks/e2e.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "timing": f"median of {opts.steps} steps after {opts.warmup} warm-up steps, each variant in a fresh "
        "process (CUDA synchronised at each optimizer step; data, loss.item() and optimizer included)",
    }
    rows: list[Row] = []
    infos: dict[str, dict] = {}
    log = Log()
    text = ""
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=False)
    with (
        contextlib.nullcontext(opts.keep)
        if opts.keep
        else tempfile.TemporaryDirectory(prefix="opadvisor-e2e-") as tmp
    ):
        for name in [n.strip() for n in opts.examples.split(",") if n.strip()]:
            if name not in SCRIPTS:
                parser.error(f"unknown example {name!r}; choose from {', '.join(SCRIPTS)}")
            ex_rows, infos[name] = bench_example(name, Path(tmp), opts, log)
            rows += ex_rows
            text = markdown(rows, infos, opts, header)
            if opts.out:  # after each example, so a run cut short keeps what it measured
                opts.out.write_text(text, encoding="utf-8")
            if opts.log:
                opts.log.write_text("\n".join(log) + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
