"""Helpers of the rule tests: profile a script, read its `# expect:` marks, load a GPU fixture.

`expected_lines(path, "fused_softmax")` reads the `# expect: LABEL` (or `# expect: LABEL start` / `... end`)
comments a script marks its patterns with. GPU profiles are fixtures under tests/data/ (recorded with
tests/data/record_gpu_fixtures.py on a GPU machine); `gpu_fixture(name)` loads one rebased on this
checkout and skips the test, saying why, when it is absent.
"""

from __future__ import annotations

import re
from pathlib import Path

from cli_testlib import profile_script  # noqa: F401 - the rule tests' helper, shared

RULES_TESTS = Path(__file__).resolve().parent
SCRIPTS = RULES_TESTS / "scripts"
REPO = RULES_TESTS.parents[1]
DATA = REPO / "tests" / "data"
MY_RULES = ["fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"]


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
