"""Real model families as user code, end to end through the real CLI (issue 29's proving ground).

    python3 benchmarks/realcode.py --family all --size base --jobs 4 --out /tmp/realcode  # one GPU, bf16: ~8 min
    python3 benchmarks/realcode.py --family llama --family bert --size base --out DIR
    python3 benchmarks/realcode.py --family all --size tiny --device cpu --out DIR # the CPU smoke run

For each family (benchmarks/realcode_families.py: transformers Llama, GPT-2, BERT, DeBERTa-v2, T5, ViT; timm
ViT, ConvNeXt, Swin; vit-pytorch ViT) it lays out a user's project in DIR/<family>/: the model's file(s)
vendored from the installed package into src/<pkg>/ and a train.py that puts src/ on sys.path itself, then
does what a user does, each command in a fresh process with a timeout:

    opadvisor profile train.py --warmup W --steps S -- --size SIZE --device DEVICE [--bf16]
    opadvisor suggest --format json
    opadvisor apply --rule all                      (the safe fixes)
    opadvisor verify --format json --no-reprofile   (parity; with --timing on CUDA: the step times)

and records per family: each command's exit status and seconds, the number of findings and where they point
(the vendored files under src/, the script, a library), the safe fixes offered and the rewrites applied,
verify's parity and step times. `failures` lists what went wrong in words (a command failing or timing out,
findings pinned on train.py while none name src/, safe fixes offered and none applied, a parity failure).
The table is printed and DIR/realcode.json written. Exit 1 when any family has a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from realcode_families import FAMILIES, Family, available, build_project


@dataclass
class Command:
    args: list[str]
    returncode: int | None  # None: timed out
    seconds: float
    stdout: str = ""
    stderr: str = ""

    @property
    def failed(self) -> bool:
        return self.returncode is None or self.returncode not in (0, 1)

    def says(self) -> str:
        """The command and how it ended, with the last lines it printed."""
        how = "timed out" if self.returncode is None else f"exit {self.returncode}"
        tail = "\n".join((self.stderr or self.stdout).strip().splitlines()[-6:])
        return f"`opadvisor {' '.join(self.args)}` {how} after {self.seconds:.1f} s: {tail}"


@dataclass
class FamilyResult:
    family: str
    size: str
    device: str
    skipped: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # command -> seconds
    findings: int = 0
    findings_in_src: int = 0  # pointing at the vendored model files
    findings_on_script: int = 0  # pointing at train.py
    findings_in_library: int = 0  # in an installed package (the model's config helpers, torch.nn)
    rules_found: list[str] = field(default_factory=list)
    places: list[str] = field(default_factory=list)  # "rule path:line" of each finding
    safe_offered: list[str] = field(default_factory=list)  # "rule src/x.py:line" with an apply command
    applied: list[str] = field(default_factory=list)  # "path:line: rule: message" lines apply printed
    not_applied: list[str] = field(default_factory=list)  # "...: rule: not applied: why"
    apply_log: str = ""  # what apply printed on stderr (its last 60 lines)
    parity: bool | None = None
    parity_message: str = ""
    step_ms_before: float | None = None
    step_ms_after: float | None = None
    speedup: float | None = None
    failures: list[str] = field(default_factory=list)


def opadvisor(project: Path, args: list[str], timeout: float, src_on_pythonpath: bool = False) -> Command:
    """One CLI command in a fresh process, in the project folder; no download of any kind. With
    `src_on_pythonpath`, src/ is on PYTHONPATH too (what attribution needed before issue 29's fix: it tells an
    attribution failure from what comes after it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONUNBUFFERED": "1"}
    if src_on_pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(project / "src"), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "opadvisor", *args],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Command(args, None, time.perf_counter() - start, out, err)
    return Command(args, done.returncode, time.perf_counter() - start, done.stdout, done.stderr)


@dataclass
class Settings:
    size: str = "tiny"
    device: str = "cpu"
    bf16: bool = False
    warmup: int = 1  # profile's warm-up steps
    steps: int = 2  # profile's recorded steps
    verify_steps: int = 3
    timing: bool = False  # verify times both programs (GPU)
    timeout: float = 300.0  # per command
    src_on_pythonpath: bool = False  # also put src/ on PYTHONPATH (see opadvisor())


def _script_args(s: Settings) -> list[str]:
    total = s.warmup + s.steps + 2  # the script would train longer: profile stops it
    return ["--size", s.size, "--device", s.device, "--steps", str(total), *(["--bf16"] if s.bf16 else [])]


def _read_findings(result: FamilyResult, report: dict[str, Any]) -> None:
    findings = report.get("findings", [])
    result.findings = len(findings)
    result.rules_found = sorted({f["rule"] for f in findings})
    for f in findings:
        path = f["path"]
        result.places.append(f"{f['rule']} {path}:{f['line']}")
        if f.get("library"):
            result.findings_in_library += 1
        elif path.startswith("src/") or "/src/" in path:
            result.findings_in_src += 1
        elif path.endswith("train.py"):
            result.findings_on_script += 1
        if f["fix"] == "safe" and f.get("apply"):
            result.safe_offered.append(f"{f['rule']} {path}:{f['line']}")


_APPLIED = re.compile(r"^(?P<path>[^:\s]+):(?P<line>\d+)(-\d+)?: (?P<rule>[a-z0-9_]+): (?!skipped:|note:)")


def _read_verify(result: FamilyResult, command: Command) -> None:
    try:
        report = json.loads(command.stdout)
    except json.JSONDecodeError:
        result.failures.append("verify printed no JSON: " + command.says())
        return
    result.parity = bool(report["parity"]["ok"])
    result.parity_message = report["parity"]["message"]
    if not result.parity:
        result.failures.append(f"verify: parity failed: {result.parity_message}")
    timing = report.get("timing")
    if timing:
        result.step_ms_before = timing["before"]["median_ms"]
        result.step_ms_after = timing["after"]["median_ms"]
        result.speedup = timing["speedup"]


def _step(result: FamilyResult, name: str, project: Path, args: list[str], s: Settings) -> Command | None:
    """Run one command; record its time; a failure goes into the result and ends the family (None)."""
    command = opadvisor(project, args, s.timeout, s.src_on_pythonpath)
    result.seconds[name] = round(command.seconds, 2)
    if command.failed:
        result.failures.append(f"{name}: " + command.says())
        return None
    return command


def run_family(family: Family, project: Path, s: Settings) -> FamilyResult:
    """profile -> suggest -> apply --rule all -> verify on a fresh project of `family` in `project`."""
    result = FamilyResult(family.name, s.size, s.device)
    missing = available(family)
    if missing is not None:
        result.skipped = missing
        return result
    project.mkdir(parents=True, exist_ok=True)
    build_project(family, project)
    profile = [
        "profile",
        "train.py",
        "--warmup",
        str(s.warmup),
        "--steps",
        str(s.steps),
        "--",
        *_script_args(s),
    ]
    if _step(result, "profile", project, profile, s) is None:
        return result
    suggest = _step(result, "suggest", project, ["suggest", "--format", "json"], s)
    if suggest is None:
        return result
    _read_findings(result, json.loads(suggest.stdout))
    if result.findings and not result.findings_in_src:
        result.failures.append(
            f"suggest: none of {result.findings} findings names the model files under src/ "
            f"({result.findings_on_script} on train.py, {result.findings_in_library} in a library: "
            f"{', '.join(result.places[:3])})"
        )
    apply = _step(result, "apply", project, ["apply", "--rule", "all"], s)
    if apply is None:
        return result
    lines = apply.stderr.splitlines()
    result.apply_log = "\n".join(lines[-60:])
    result.applied = [line for line in lines if _APPLIED.match(line) and ": not applied:" not in line]
    result.not_applied = [line for line in lines if ": not applied:" in line]
    if result.safe_offered and not result.applied:
        result.failures.append(
            f"apply --rule all: {len(result.safe_offered)} safe fixes offered, none applied: "
            + " | ".join(apply.stderr.strip().splitlines()[-4:])
        )
    if not result.applied:
        return result
    verify = ["verify", "--format", "json", "--no-reprofile", "--steps", str(s.verify_steps), "--warmup", "1"]
    verify += ["--repeats", "1", "--no-per-rule"] if s.timing else ["--no-timing"]
    command = opadvisor(project, verify, s.timeout, s.src_on_pythonpath)
    result.seconds["verify"] = round(command.seconds, 2)
    if command.returncode is None:
        result.failures.append("verify: " + command.says())
    else:
        _read_verify(result, command)
    return result


def _row(r: FamilyResult) -> str:
    if r.skipped:
        return f"{r.family:<14} skipped: {r.skipped}"
    secs = " ".join(f"{k} {v:.1f}s" for k, v in r.seconds.items())
    timing = (
        f" step {r.step_ms_before:.1f} -> {r.step_ms_after:.1f} ms ({r.speedup:.2f}x)" if r.speedup else ""
    )
    return (
        f"{r.family:<14} findings {r.findings} (src {r.findings_in_src}, train.py {r.findings_on_script}, "
        f"library {r.findings_in_library}); safe offered {len(r.safe_offered)}, applied {len(r.applied)}; "
        f"parity {r.parity}{timing}; {secs}" + ("".join(f"\n    FAIL {f}" for f in r.failures))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", default=[], help=f"all or one of {', '.join(FAMILIES)}")
    parser.add_argument("--size", choices=["tiny", "base"], default="base")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--no-bf16", action="store_true", help="fp32 (default on CUDA: bf16 autocast)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="families at once (their step times then share the GPU: compare times only from --jobs 1)",
    )
    parser.add_argument(
        "--src-on-pythonpath",
        action="store_true",
        help="also put each project's src/ on PYTHONPATH (tells a sys.path attribution failure from the rest)",
    )
    parser.add_argument(
        "--no-timing",
        action="store_true",
        help="verify's parity only (step times from --jobs > 1 are not comparable)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the projects and realcode.json")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(FAMILIES) if not args.family or "all" in args.family else args.family
    s = Settings(
        size=args.size,
        device=device,
        bf16=device == "cuda" and not args.no_bf16,
        warmup=2 if device == "cuda" else 1,
        steps=2,
        verify_steps=6 if device == "cuda" else 3,
        timing=device == "cuda" and not args.no_timing,
        timeout=args.timeout,
        src_on_pythonpath=args.src_on_pythonpath,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[FamilyResult] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each family is its own processes
        for result in pool.map(lambda name: run_family(FAMILIES[name], args.out / name, s), names):
            print(_row(result), flush=True)
            results.append(result)
            (args.out / "realcode.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"wrote {args.out / 'realcode.json'}")
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
