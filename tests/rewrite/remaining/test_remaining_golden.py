"""Golden tests of the codemods in `remaining_helpers.RULES` (fused_optimizer, dataloader_stall,
manual_layernorm, fp32_gemm, sparse_launch, fused_cross_entropy).

One parametrized test over `fixtures/<rule>/<case>.in.py`: the output must equal `<case>.out.py` byte for
byte, parse again (libcst and Python's own parser), and be a fixed point (the codemod run on its own
output, with the same options and the targets moved with the lines they named, changes nothing). `OPADVISOR_REGEN_FIXTURES=1 pytest ...` rewrites the
`.out.py` files from the current codemods, for review with `git diff`.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from remaining_helpers import RULES, cases, expected_path, options, run

REGEN = os.environ.get("OPADVISOR_REGEN_FIXTURES") == "1"


@pytest.mark.parametrize("case", cases(), ids=lambda p: f"{p.parent.name}/{p.name.removesuffix('.in.py')}")
def test_fixture(case: Path) -> None:
    rule = case.parent.name
    source = case.read_text()
    opts = options(source)
    out, codemod = run(rule, source, opts.targets, **opts.kwargs)

    expected = expected_path(case)
    if REGEN:
        expected.write_text(out)
    assert out == expected.read_text()
    ast.parse(out)  # the output is Python

    if opts.changes is not None:
        assert len(codemod.changes) == opts.changes, codemod.changes
    if out == source:
        assert not codemod.changes
    for reason in opts.skipped:
        assert any(reason in note.message for note in codemod.skipped), (reason, codemod.skipped)

    rerun_targets = opts.rerun_targets if opts.rerun_targets is not None else opts.targets
    again, second = run(rule, out, rerun_targets, **opts.kwargs)
    assert again == out, "not idempotent"
    assert not second.changes


def test_every_rule_has_fixtures() -> None:
    rules = {case.parent.name for case in cases()}
    assert rules == set(RULES)
    for case in cases():
        assert expected_path(case).exists(), f"{case} has no .out.py"
