"""Helpers of the rule tests: profile a script, read its `# expect:` marks, load a GPU fixture.

`expected_lines(path, "fused_softmax")` reads the `# expect: LABEL` (or `# expect: LABEL start` / `... end`)
comments a script marks its patterns with. GPU profiles are fixtures under tests/data/ (recorded with
tests/data/record_gpu_fixtures.py on a GPU machine); `gpu_fixture(name)` loads one rebased on this
checkout and skips the test, saying why, when it is absent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

RULES_TESTS = Path(__file__).resolve().parent
SCRIPTS = RULES_TESTS / "scripts"
REPO = RULES_TESTS.parents[1]
DATA = REPO / "tests" / "data"
MY_RULES = ["fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"]


def profile_script(script: Path, out: Path, *script_args: str, steps: int = 2, warmup: int = 1) -> Path:
    """Run `opadvisor profile` on a script into `out` (a new folder); fail the test with its output if it fails."""
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
    return out


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


def gpu_fixture(name: str):
    """tests/data/<name>.profile.json as a Profile of this checkout (fails when the file is missing)."""
    from fixture_profiles import load_fixture_profile

    return load_fixture_profile(name)
