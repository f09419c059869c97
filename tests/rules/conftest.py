"""Shared fixtures for the rule tests: real profiles of the small scripts in scripts/, made once per session.

`rules_profile("bert_attention")` runs `opadvisor profile tests/rules/scripts/bert_attention.py` (2 steps
after 1 warm-up, on the CPU here) into a temporary run folder and returns that folder; every test that
asks for the same script shares it. Helpers (expected lines, GPU fixtures) are in rules_testlib.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rules_testlib import SCRIPTS, profile_script


@pytest.fixture(scope="session")
def rules_profile(made_once):
    """name -> run folder of scripts/<name>.py (or of `script`), profiled once per test run."""

    def get(name: str, script: Path | None = None, *args: str) -> Path:
        path = script or SCRIPTS / f"{name}.py"
        key = "-".join(["rules", name, *(a.strip("-") for a in args)])
        return made_once(key, lambda folder: profile_script(path, folder / "run", *args)) / "run"

    return get
