"""What the multi-rank gloo tests share: profiling a script on N ranks, suggest's JSON, and `verify`'s
parity of the applied run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli_testlib import opadvisor_here

TIMEOUT_S = 240


def profile_ranks(project: Path, script: str, *args: str, nproc: int = 2, warmup: int = 1) -> None:
    """`opadvisor profile --nproc-per-node N --steps 2` of `script` in `project` (args: the script's own)."""
    cmd = [sys.executable, "-m", "opadvisor", "profile", "--nproc-per-node", str(nproc), "--steps", "2"]
    cmd += ["--warmup", str(warmup), script, *(["--", *args] if args else [])]
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]


def suggest(project: Path) -> dict:
    done = opadvisor_here(project, "suggest", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def verify_parity(project: Path, steps: int = 2) -> dict:
    """`verify --quick` of the project's applied run: asserts it passed with the same losses on every rank
    for `steps` steps; returns verify's report."""
    (run,) = [p for p in (project / ".opadvisor" / "runs").iterdir() if (p / "applied.json").is_file()]
    done = opadvisor_here(project, "verify", str(run), "--quick", "--steps", str(steps), "--format", "json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["parity"]["ok"] and len(report["parity"]["steps"]) == steps
    return report
