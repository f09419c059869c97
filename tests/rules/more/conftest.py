"""Fixtures for the tests of host_sync, dataloader_stall, fp32_gemm, manual_layernorm and fused_optimizer.

- `cpu_profile(name)`: a script of scripts/ profiled on the CPU with `opadvisor profile --steps 2
  --warmup 1`, once per test session; "example:bert_train" is the example as tests/rules profiles it.
- `gpu_profile(name)`: the CUDA profile tests/data/<name>.profile.json (recorded on an H200 by
  tests/data/record_gpu_fixtures.py, rebased on this checkout); the test is skipped while it is absent.
- `lines(name, label)`: the (first, last) lines a script marks with `# expect: LABEL [start|end]`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from rules_testlib import REPO, expected_lines, gpu_fixture, profile_script

from opadvisor.profile.model import Profile, load_profile
from opadvisor.rules._source import source_status

SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = REPO / "examples"


def script_path(name: str) -> Path:
    if name.startswith("example:"):
        return EXAMPLES / f"{name.split(':', 1)[1]}.py"
    return SCRIPTS / f"{name}.py"


def lines(name: str, label: str) -> tuple[int, int]:
    return expected_lines(script_path(name), label)


def line_of(name: str, needle: str) -> int:
    """The one line of a script (or example) that contains `needle`."""
    path = script_path(name)
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text]
    assert len(hits) == 1, f"{path}: expected one line with {needle!r}, found {hits}"
    return hits[0]


@pytest.fixture(scope="session")
def cpu_profile(made_once, rules_profile) -> Callable[[str], Profile]:
    """name -> CPU Profile of scripts/<name>.py, or of an example ("example:bert_train").

    The examples come from tests/rules' `rules_profile` fixture (profiled once per session for every rule
    test); a test that needs their CPU behaviour is skipped where that profile ran on CUDA.
    """
    cache: dict[str, Profile] = {}

    def get(name: str) -> Profile:
        if name not in cache:
            if name.startswith("example:"):
                stem = name.split(":", 1)[1]
                run = rules_profile(stem, script_path(name))
            else:
                run = made_once(f"cpu-{name}", lambda folder: _cpu_profile(name, folder / "run")) / "run"
            cache[name] = load_profile(run / "profile.json")
        if cache[name].has_gpu:
            pytest.skip(
                f"{name} was profiled on CUDA on this machine; its GPU profile is tested from tests/data"
            )
        return cache[name]

    return get


def _cpu_profile(name: str, run: Path) -> None:
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU profile, even on a GPU machine
    try:
        profile_script(script_path(name), run)
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@pytest.fixture(scope="session")
def gpu_profile() -> Callable[[str], Profile]:
    cache: dict[str, Profile] = {}

    def get(name: str) -> Profile:
        if name not in cache:
            prof = gpu_fixture(name)  # skips the test while tests/data/<name>.profile.json is absent
            assert prof.has_gpu, f"tests/data/{name}.profile.json is not a CUDA profile"
            if source_status(prof, prof.script) != "ok":
                pytest.fail(
                    f"tests/data/{name}.profile.json was recorded from another version of "
                    f"{Path(prof.script).relative_to(REPO)}: re-record it with tests/data/record_gpu_fixtures.py"
                )
            cache[name] = prof
        return cache[name]

    return get
