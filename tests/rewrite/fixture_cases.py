"""The codemod fixtures, `tests/rewrite/fixtures/<rule>/<case>.in.py` with `<case>.out.py`, and how to run one.

A fixture may start with comment lines the golden test reads (ordinary comments, so they are in the
expected output too):

    # codemod-args: {"targets": [[12, 14]], "mode": "autocast"}   codemod options; targets as [line, end_line]
    # rerun-targets: [[13, 15]]                                   the same targets in the output's lines
    # expect-changes: 2                                           how many changes the codemod records
    # expect-skipped: read again on line                          a skip whose reason contains this (repeatable)

A case named `*_unsafe` runs with unsafe fixes allowed (as `opadvisor apply --unsafe`). Every rule with a
codemod has a folder here (tests/rewrite/test_fixtures.py checks it against the registry). A case with
`make_inputs()` is also profiled on the CPU and its findings applied: `<case>.profiled.out.py`, where it
exists, is what that gives when the profile's facts lead elsewhere than the source alone (gemm_align finds
nothing in a float32 CPU profile; fused_softmax does not report a softmax without a mask).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst
from libcst.codemod import CodemodContext

from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rewrite.registry import get_codemod

FIXTURES = Path(__file__).parent / "fixtures"
_HEADER = re.compile(r"^# (codemod-args|rerun-targets|expect-changes|expect-skipped): (.*)$")


@dataclass
class Options:
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] | None = None
    rerun_targets: list[Target] | None = None  # for the idempotence run; default: `targets`
    changes: int | None = None
    skipped: list[str] = field(default_factory=list)


def fixture_target(rule: str, line: int, end_line: int, facts: dict | None = None) -> Target:
    """A target written by hand: `facts` names only what the case asserts, the other fields take the facts
    class's defaults (a finding's facts always carry all of them); none (or {}): a target without facts."""
    cls = get_codemod(rule).FACTS
    return Target(
        line, end_line, cls.from_details(facts, partial=True) if facts and cls is not None else None
    )


def options(source: str, rule: str) -> Options:
    opts = Options()
    for line in source.splitlines():
        match = _HEADER.match(line)
        if not match:
            continue
        key, value = match.groups()
        if key == "codemod-args":
            kwargs = json.loads(value)
            targets = kwargs.pop("targets", None)
            if targets is not None:
                opts.targets = [fixture_target(rule, a, b, *d) for a, b, *d in targets]
            opts.kwargs = kwargs
        elif key == "rerun-targets":
            opts.rerun_targets = [Target(a, b) for a, b in json.loads(value)]
        elif key == "expect-changes":
            opts.changes = int(value)
        else:
            opts.skipped.append(value.strip())
    return opts


def run(
    rule: str, source: str, targets: list[Target] | None = None, **kwargs: Any
) -> tuple[str, RuleCodemod]:
    """The rewritten source and the codemod (its `changes` and `skipped` notes), without the engine."""
    codemod = get_codemod(rule)(CodemodContext(), targets, **kwargs)
    return codemod.transform_module(cst.parse_module(source)).code, codemod


def cases(rule: str | None = None) -> list[Path]:
    return sorted(FIXTURES.glob(f"{rule or '*'}/*.in.py"))


def expected_path(case: Path) -> Path:
    return case.with_name(case.name.removesuffix(".in.py") + ".out.py")


def case_id(case: Path) -> str:
    return f"{case.parent.name}/{case.name.removesuffix('.in.py')}"
