"""Helpers of the library-code tests: run opadvisor in a project folder, find a script's marked lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cli_testlib import Done, opadvisor_here

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def process_env() -> dict[str, str]:
    """The environment of the processes these tests start: nothing downloaded (tests/conftest.py has put
    tests/cpu_torchvision on PYTHONPATH, so timm imports on a CPU-only torch)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


# Commands that run nothing of the user's in their own process run in the test's (cli_testlib): a child
# would import torch and transformers again. `profile` runs the script in its process: a child.
IN_PROCESS = ("apply", "suggest", "verify")


def run_opadvisor(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess | Done:
    if args[0] in IN_PROCESS:
        done = opadvisor_here(cwd, *args)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "opadvisor", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=900,
            env=process_env(),
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


def assert_verify_parity(project: Path) -> None:
    """`opadvisor verify` (parity only: a few steps, no timing) passes on the project's applied fixes."""
    done = run_opadvisor(
        project, "verify", "--steps", "4", "--warmup", "1", "--no-reprofile", "--no-timing", check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parity passed" in done.stdout
