"""Helpers of the report and diff tests: the bundled BERT example before and after `opadvisor apply` (CPU),
and the GPU profiles kept under tests/data, written as run folders."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cli_testlib
from cli_testlib import Done

from opadvisor.profile.model import Profile, save_profile

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ExampleRuns:
    project: Path  # a copy of the example, where apply rewrote it
    before: Path  # run folder of the original (holds apply's backup)
    after: Path  # run folder of the rewritten script


def opadvisor(cwd: Path, *args: str) -> subprocess.CompletedProcess | Done:
    """`opadvisor ARGS` in `cwd` (profile in a child process, the others in this one: cli_testlib); the test
    fails with the output when it exits non-zero."""
    proc = cli_testlib.opadvisor(cwd, *args)
    assert proc.returncode == 0, (
        f"opadvisor {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def make_example_runs(folder: Path, example_project: Callable[[str, Path], Path]) -> ExampleRuns:
    """examples/bert_train.py profiled on the CPU, fused_softmax applied, profiled again. The first run is
    a copy of tests/conftest.py's `example_project` (made once a test run), moved where `profile --out
    before` would have written it: the folder `before`, the run's id its name, no latest."""
    project = example_project("bert_train.py", folder / "project")
    (run,) = (project / ".opadvisor" / "runs").iterdir()
    profile = json.loads((run / "profile.json").read_text())
    profile["run_id"] = "before"
    (run / "profile.json").write_text(json.dumps(profile))
    run.rename(project / "before")
    shutil.rmtree(project / ".opadvisor")
    opadvisor(project, "apply", "--rule", "fused_softmax", "before")
    cli_testlib.profile_example("bert_train.py", project, "--out", "after")
    return ExampleRuns(project, project / "before", project / "after")


def write_run(folder: Path, profiles: list[Profile]) -> Path:
    """A run folder holding `profiles` (one: profile.json; several: profile.rank<N>.json)."""
    folder.mkdir(parents=True)
    if len(profiles) == 1:
        save_profile(profiles[0], folder / "profile.json")
    else:
        for p in profiles:
            save_profile(p, folder / f"profile.rank{p.rank}.json")
    return folder
