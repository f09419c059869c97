"""Helpers of the library-code tests: run opadvisor in a project folder, find a script's marked lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# sitecustomize that lets torchvision (timm's dependency) import on a CPU-only torch (see its docstring)
CPU_TORCHVISION = Path(__file__).resolve().parent / "cpu_torchvision"


def process_env() -> dict[str, str]:
    """The environment of the processes these tests start: nothing downloaded, timm importable."""
    path = os.pathsep.join(p for p in (str(CPU_TORCHVISION), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": path}


def run_opadvisor(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = process_env()
    done = subprocess.run(
        [sys.executable, "-m", "opadvisor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if check:
        assert done.returncode == 0, (
            f"opadvisor {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


def line_of(path: Path, mark: str) -> int:
    """The line of `path` carrying the comment `# expect: MARK`."""
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# expect: {mark}"):
            return i
    raise AssertionError(f"{path.name} has no '# expect: {mark}'")
