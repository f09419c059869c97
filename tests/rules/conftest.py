"""Shared fixtures for the rule tests: real profiles of the small scripts in scripts/, made once per session.

`rules_profile("bert_attention")` runs `opadvisor profile tests/rules/scripts/bert_attention.py` (2 steps
after 1 warm-up, on the CPU here) into a temporary run folder and returns that folder; every test that
asks for the same script shares it. `expected_lines(path, "fused_softmax")` reads the `# expect: LABEL`
(or `# expect: LABEL start` / `... end`) comments a script marks its patterns with. GPU profiles are
fixtures under tests/data/ (`gpu_fixture(name)`), made on a GPU machine and relocated to this checkout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from opadvisor.profile.model import Profile, profile_from_dict

RULES_TESTS = Path(__file__).resolve().parent
SCRIPTS = RULES_TESTS / "scripts"
REPO = RULES_TESTS.parents[1]
DATA = REPO / "tests" / "data"


def profile_script(script: Path, out: Path, *script_args: str, steps: int = 2, warmup: int = 1) -> Path:
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(script), "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), "--out", str(out)]
    if script_args:
        cmd += ["--", *script_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"profiling {script.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return out


@pytest.fixture(scope="session")
def rules_profile(tmp_path_factory):
    """name -> run folder of scripts/<name>.py, profiled once per session."""
    cache: dict[str, Path] = {}

    def get(name: str, script: Path | None = None) -> Path:
        if name not in cache:
            path = script or SCRIPTS / f"{name}.py"
            cache[name] = profile_script(path, tmp_path_factory.mktemp(name) / "run")
        return cache[name]

    return get


_MARK = re.compile(r"#\s*expect:\s*(?P<label>[\w ]+?)(?:\s+(?P<edge>start|end))?\s*$")


def expected_lines(path: Path, label: str) -> tuple[int, int]:
    """(first, last) line of the pattern a script marks with `# expect: LABEL [start|end]`."""
    start = end = None
    for i, text in enumerate(path.read_text().splitlines(), 1):
        m = _MARK.search(text)
        if not m or m.group("label").strip() != label:
            continue
        if m.group("edge") in (None, "start"):
            start = i
        if m.group("edge") in (None, "end"):
            end = i
    assert start is not None and end is not None, f"{path.name} has no '# expect: {label}' mark"
    return start, end


def relocate(data: dict, root: Path) -> dict:
    """A profile.json made in another checkout, with its paths moved under `root` (this checkout)."""
    old = data.get("cwd", "").rstrip("/")
    new = str(root)

    def move(p):
        return new + p[len(old) :] if isinstance(p, str) and old and p.startswith(old + "/") else p

    data["script"] = move(data.get("script"))
    data["sources"] = {move(k): v for k, v in data.get("sources", {}).items()}
    for key in ("ops", "annotations", "constructions"):
        for item in data.get(key, []):
            item["file"] = move(item.get("file"))
    data["cwd"] = new
    return data


def gpu_fixture(name: str) -> Profile:
    """tests/data/gpu_<name>.profile.json as a Profile in this checkout; skips when the file is absent."""
    path = DATA / f"gpu_{name}.profile.json"
    if not path.is_file():
        pytest.skip(
            f"GPU fixture {path.relative_to(REPO)} is absent (made by a GPU run: see tests/data/README.md)"
        )
    return profile_from_dict(relocate(json.loads(path.read_text()), REPO))
