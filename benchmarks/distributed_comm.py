"""Issue 34 end to end on several ranks: the naive FSDP2 and DDP examples, profiled, fixed and verified.

    python benchmarks/distributed_comm.py --out /tmp/dist --example fsdp          # 2 GPUs, GPT-2-medium size
    python benchmarks/distributed_comm.py --out /tmp/dist --example ddp
    python benchmarks/distributed_comm.py --out /tmp/dist --example fsdp_reshard  # per-block units kept
    python benchmarks/distributed_comm.py --out /tmp/dist-cpu --device cpu --size tiny   # a CPU check (gloo)

For each example (examples/fsdp_train.py: one fully_shard on the root, float32 all-gathers under bf16
autocast, gradients reduce-scattered on every micro-step; examples/ddp_gpt_train.py:
find_unused_parameters=True, bucket_cap_mb=1, all-reduce on every micro-step, no gradient_as_bucket_view)
it copies the script into OUT/<example>/ and runs what a user would:

    opadvisor profile --nproc-per-node N --warmup W --steps S --out OUT/<example>/run SCRIPT -- --size ...
    opadvisor suggest OUT/<example>/run --format json
    opadvisor apply --rule all --unsafe OUT/<example>/run       # fsdp_fp32_gather's fix is unsafe
    opadvisor verify OUT/<example>/run --format json            # both programs on N ranks: losses, step times

`--example fsdp_reshard` measures `fsdp_reshard` alone: the FSDP example is first brought to one unit per
block with 16-bit gathers and no sync on accumulation micro-steps (`apply --rule fsdp_root_only`, then
`apply --rule all --unsafe`, on a first profile kept in OUT/fsdp_reshard/prepare); that script is the
original the chain above profiles, and apply runs `--rule fsdp_reshard --unsafe` alone, so verify times
per-block units resharding after forward (FSDP2's default) against `reshard_after_forward=False` (measured
by hand on 2 H200s at --size medium: 617 -> 442 ms/step).

Everything each command printed is kept beside its JSON; OUT/<example>/summary.json holds the findings
(rule, line, measured time, estimated saving), what apply rewrote, the parity verdict and the step times
before and after with the speedup (verify's: rank 0's steps, CUDA synchronised at each optimizer step), and
OUT/summary.json the device, versions and both examples. Each example takes a few minutes on 2 H200s at
--size medium; run one --example per command where commands are limited in time.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opadvisor.rules.registry import rule_ids

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = {"fsdp": "fsdp_train.py", "ddp": "ddp_gpt_train.py", "fsdp_reshard": "fsdp_train.py"}
# issue 34's rules: the data-parallel ones of the registry
ISSUE_RULES = tuple(r for r in rule_ids() if r.startswith(("ddp_", "fsdp_")) or r == "grad_accum_sync")
# the fixes each example's chain applies; fsdp_reshard's is measured alone, on the script the others made
APPLY = {"fsdp_reshard": ["--rule", "fsdp_reshard", "--unsafe"]}
PREPARE = {"fsdp_reshard": [["--rule", "fsdp_root_only"], ["--rule", "all", "--unsafe"]]}


def run(cmd: list[str], cwd: Path, log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`cmd` in `cwd`; its output kept in `log` (.out / .err), the command line first."""
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    took = time.monotonic() - started
    log.with_suffix(".out").write_text(
        f"$ {shlex.join(cmd)}\n# exit {proc.returncode} in {took:.1f} s\n{proc.stdout}"
    )
    log.with_suffix(".err").write_text(proc.stderr)
    print(f"  {shlex.join(cmd[2:6])} ... exit {proc.returncode} ({took:.0f} s)", flush=True)
    return proc


def opadvisor(args: list[str], cwd: Path, log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "opadvisor", *args], cwd, log, timeout)


def example(name: str, ns: argparse.Namespace) -> dict[str, Any]:
    folder = ns.out / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    script = SCRIPTS[name]
    shutil.copy(EXAMPLES / script, folder / script)
    run_dir = folder / "run"
    out: dict[str, Any] = {"example": name, "script": script}
    script_args = [
        "--size",
        ns.size,
        "--device",
        ns.device,
        "--accum",
        str(ns.accum),
        "--steps",
        str(ns.script_steps),
    ]
    out["script_args"] = script_args
    profile = [
        "profile",
        "--nproc-per-node",
        str(ns.nproc),
        "--warmup",
        str(ns.warmup),
        "--steps",
        str(ns.steps),
    ]
    for i, rules in enumerate(PREPARE.get(name, [])):
        prepared = folder / "prepare"
        if i == 0:
            proc = opadvisor(
                [*profile, "--out", str(prepared), script, "--", *script_args], folder, prepared, ns.timeout
            )
            if proc.returncode != 0:
                return {**out, "error": f"profile to prepare failed: {_last(proc.stderr)}"}
        proc = opadvisor(["apply", *rules, str(prepared)], folder, folder / f"prepare-apply{i}", ns.timeout)
        if proc.returncode != 0:
            return {**out, "error": f"apply to prepare failed: {_last(proc.stderr)}"}
    proc = opadvisor(
        [*profile, "--out", str(run_dir), script, "--", *script_args], folder, folder / "profile", ns.timeout
    )
    if proc.returncode != 0:
        return {**out, "error": f"profile failed: {_last(proc.stderr)}"}
    proc = opadvisor(["suggest", str(run_dir), "--format", "json"], folder, folder / "suggest", ns.timeout)
    if proc.returncode != 0:
        return {**out, "error": f"suggest failed: {_last(proc.stderr)}"}
    suggested = json.loads(proc.stdout)
    (folder / "suggest.json").write_text(json.dumps(suggested, indent=1))
    out["findings"] = [_finding(f) for f in suggested["findings"] if f["rule"] in ISSUE_RULES]
    out["other_findings"] = sorted({f["rule"] for f in suggested["findings"] if f["rule"] not in ISSUE_RULES})
    out["cross_rank"] = {
        k: suggested.get("cross_rank", {}).get(k)
        for k in ("step_ms", "comm_ms", "exposed_comm_ms", "overlap", "basis")
    }
    original = (folder / script).read_text()
    fixes = APPLY.get(name, ["--rule", "all", "--unsafe"])
    proc = opadvisor(["apply", *fixes, str(run_dir)], folder, folder / "apply", ns.timeout)
    if proc.returncode != 0:
        return {**out, "error": f"apply failed: {_last(proc.stderr)}"}
    out["rewritten"] = (folder / script).read_text() != original
    out["apply_lines"] = [
        ln for ln in proc.stderr.splitlines() + proc.stdout.splitlines() if f"{script}:" in ln
    ]
    verify = [
        "verify",
        str(run_dir),
        "--format",
        "json",
        "--steps",
        str(ns.verify_steps),
        "--warmup",
        str(ns.warmup),
    ]
    verify += ["--repeats", str(ns.repeats), "--per-rule" if ns.per_rule else "--no-per-rule"]
    proc = opadvisor(verify, folder, folder / "verify", ns.timeout)
    if proc.returncode not in (0, 1):
        return {**out, "error": f"verify failed: {_last(proc.stderr)}"}
    report = json.loads(proc.stdout)
    (folder / "verify.json").write_text(json.dumps(report, indent=1))
    out["verify"] = _verdict(report)
    return out


def _finding(f: dict[str, Any]) -> dict[str, Any]:
    keys = ("rule", "line", "fix", "time_ms_per_step", "est_saving_ms_per_step", "time_basis", "message")
    return {k: f.get(k) for k in keys}


def _verdict(report: dict[str, Any]) -> dict[str, Any]:
    parity = report.get("parity") or {}
    timing = report.get("timing") or {}
    return {
        "parity_ok": parity.get("ok"),
        "parity_message": parity.get("message"),
        "precision": parity.get("precision"),
        "timing": timing,
        "notes": report.get("notes"),
    }


def _last(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
    return env


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for everything it writes")
    parser.add_argument("--example", choices=[*SCRIPTS, "all"], default="all")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) per run")
    parser.add_argument("--size", default="medium", help="the examples' --size: tiny, small, medium")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=3, help="steps before profiling / timing")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled")
    parser.add_argument("--verify-steps", type=int, default=6, help="steps verify compares and times")
    parser.add_argument("--repeats", type=int, default=2, help="verify's timing runs of each program")
    parser.add_argument("--per-rule", action="store_true", help="also time each applied rule (slower)")
    parser.add_argument(
        "--script-steps", type=int, default=40, help="the script's own --steps (room for verify)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each command may run")
    ns = parser.parse_args()
    ns.out = ns.out.resolve()
    ns.out.mkdir(parents=True, exist_ok=True)
    names = list(SCRIPTS) if ns.example == "all" else [ns.example]
    summary_path = ns.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary.update(
        environment=environment(ns.device), command=shlex.join(sys.argv), nproc=ns.nproc, size=ns.size
    )
    failed = False
    for name in names:
        print(f"{name}: {SCRIPTS[name]} --size {ns.size} on {ns.nproc} rank(s) ({ns.device})", flush=True)
        result = example(name, ns)
        (ns.out / name / "summary.json").write_text(json.dumps(result, indent=1))
        summary.setdefault("examples", {})[name] = result
        failed |= "error" in result or not (result.get("verify") or {}).get("parity_ok")
        print(
            json.dumps({k: result.get(k) for k in ("error", "findings", "verify")}, indent=1)[:4000],
            flush=True,
        )
    summary_path.write_text(json.dumps(summary, indent=1))
    print(f"written: {summary_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
