"""Shared fixtures for the rule tests: real profiles of the small scripts in scripts/, made once per session.

`rules_profile("bert_attention")` runs `opadvisor profile tests/rules/scripts/bert_attention.py` (2 steps
after 1 warm-up, on the CPU here) into a temporary run folder and returns that folder; every test that
asks for the same script shares it. Helpers (expected lines, GPU fixtures) are in rules_testlib.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rules_testlib import SCRIPTS


@pytest.fixture(scope="session")
def rules_profile(script_run):
    """name -> run folder of scripts/<name>.py (or of `script`), profiled once per test run (tests/conftest.py's
    script_run: shared with the other test directories that profile the same script)."""

    def get(name: str, script: Path | None = None, *args: str) -> Path:
        return script_run(script or SCRIPTS / f"{name}.py", *args)

    return get
