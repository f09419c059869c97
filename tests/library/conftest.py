"""Library-code tests: tiny transformers / torch.nn models whose code lives in installed packages.

`library_run(name)` profiles scripts/<name>.py once per session, on the CPU, inside a project folder of
its own (a copy of the script), and returns that folder's run; `project_copy(name, tmp_path)` gives a test
a private copy of that project (script, run and all, paths moved) to apply fixes in.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_testlib import copy_project
from library_testlib import SCRIPTS, run_opadvisor

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models come from config objects


@pytest.fixture(scope="session")
def library_run(made_once):
    def make(name: str, project: Path) -> None:
        shutil.copy(SCRIPTS / f"{name}.py", project / f"{name}.py")
        run_opadvisor(project, "profile", f"{name}.py", "--steps", "2", "--warmup", "1")

    def get(name: str) -> Path:
        return made_once(f"library-{name}", lambda project: make(name, project))

    return get


@pytest.fixture
def project_copy(library_run):
    """A private copy of a profiled project, its run's absolute paths moved to the copy."""

    def get(name: str, dest: Path) -> Path:
        return copy_project(library_run(name), dest)

    return get
