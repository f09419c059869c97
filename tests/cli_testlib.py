"""Helpers shared by the end-to-end tests: run an opadvisor command in this process, copy a profiled project.

`opadvisor_here(cwd, "apply", "--rule", "all")` runs the command as `python -m opadvisor` would, from `cwd`,
but in the test's own process: a child would spend 1.5-2 s importing torch again, for commands (suggest,
apply, diff, report, verify's parent) that start nothing of the user's in their own process. Profiling a
script stays a child process (it runs the script in the profiling process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Done:
    """What a test reads of a finished command (the fields of subprocess.CompletedProcess it reads)."""

    returncode: int
    stdout: str
    stderr: str


def opadvisor_here(cwd: Path, *args: str) -> Done:
    """`opadvisor ARGS` run from `cwd` in this process; an exception other than an exit is raised again (a
    crash fails the test with its own traceback, not as exit code 1)."""
    from typer.testing import CliRunner

    from opadvisor.cli import app

    old = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(old)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        detail = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"opadvisor {' '.join(args)} raised:\n{detail}") from result.exception
    return Done(result.exit_code, result.stdout, result.stderr)


def opadvisor(cwd: Path, *args: str, timeout: float = 600) -> Done | subprocess.CompletedProcess:
    """`opadvisor ARGS` from `cwd`: `profile` in a child process (it runs the user's script in its own
    process, as a user's `opadvisor profile` does), every other command in this process."""
    if args[0] != "profile":
        return opadvisor_here(cwd, *args)
    cmd = [sys.executable, "-m", "opadvisor", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def copy_project(source: Path, dest: Path) -> Path:
    """A private copy of a profiled project (`source` is shared: never changed), its runs' absolute paths
    moved to the copy, so that apply and verify find the copy's files."""
    shutil.copytree(source, dest, symlinks=True)
    for profile in (dest / ".opadvisor" / "runs").glob("*/profile*.json"):
        profile.write_text(profile.read_text().replace(str(source), str(dest)))
    return dest


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The examples as the end-to-end tests profile them: tiny sizes on the CPU (a vocabulary of 1003: no multiple
# of 8), 2 steps recorded after 1 warm-up; the script's own --steps leaves verify's 3 steps room.
TINY = "--device cpu --hidden 32 --layers 1 --heads 2 --seq 16 --batch 4 --vocab 1003 --steps 20"
EXAMPLE_ARGS = {"lstm_train.py": "--device cpu --seq 20 --steps 20"}  # the others: TINY


def example_args(name: str) -> list[str]:
    return EXAMPLE_ARGS.get(name, TINY).split()


def profile_example(name: str, project: Path, *out: str) -> None:
    """examples/<name> copied into `project` (when not there yet) and profiled there with its example_args
    (into `out`, e.g. ("--out", "after"), when given; else a new run under .opadvisor/runs)."""
    if not (project / name).exists():
        shutil.copy(EXAMPLES / name, project / name)
    proc = opadvisor(
        project, "profile", name, "--steps", "2", "--warmup", "1", *out, "--", *example_args(name)
    )
    assert proc.returncode == 0, f"profiling {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


REPO = EXAMPLES.parent


def profile_script(script: Path, out: Path, *script_args: str, steps: int = 2, warmup: int = 1) -> Path:
    """Run `opadvisor profile` on a script into `out` (a new folder), from the checkout's root; what it
    printed goes to `<out>.stdout.txt` and `<out>.stderr.txt` beside it. Fails the test with its output if it fails."""
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(script), "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), "--out", str(out)]
    if script_args:
        cmd += ["--", *script_args]
    # without Triton's interpreter (tests/kernels sets it for the whole session): a script that calls
    # opadvisor.kernels would run the fused kernels element by element on the CPU (killed for memory)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, (
        f"profiling {script.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    out.with_name(f"{out.name}.stdout.txt").write_text(proc.stdout)
    out.with_name(f"{out.name}.stderr.txt").write_text(proc.stderr)
    return out
