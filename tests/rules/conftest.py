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
def rules_profile(tmp_path_factory):
    """name -> run folder of scripts/<name>.py (or of `script`), profiled once per session."""
    cache: dict[str, Path] = {}

    def get(name: str, script: Path | None = None, *args: str) -> Path:
        if name not in cache:
            path = script or SCRIPTS / f"{name}.py"
            cache[name] = profile_script(path, tmp_path_factory.mktemp(name) / "run", *args)
        return cache[name]

    return get
