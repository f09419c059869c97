"""applied.json: the original program is the earliest backup of each rewritten file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verify_helpers import fake_apply, make_project

from opadvisor.errors import UserError
from opadvisor.verify.applied import NOTHING_APPLIED, load_applied


def _project(tmp_path: Path) -> tuple[Path, Path]:
    return make_project(tmp_path, {"train.py": "a = 1\nb = 2\n", "model.py": "c = 3\n"}, "train.py", [])


def _two_rules_three_edits(tmp_path: Path):
    """fused_softmax then gemm_align on train.py, gemm_align on model.py: (project, run, Applied)."""
    project, run_dir = _project(tmp_path)
    fake_apply(run_dir, project / "train.py", "a = 1", "a = 10", rule="fused_softmax")
    fake_apply(run_dir, project / "train.py", "b = 2", "b = 20", rule="gemm_align")
    fake_apply(run_dir, project / "model.py", "c = 3", "c = 30", rule="gemm_align")
    return project, run_dir, load_applied(run_dir)


def test_nothing_applied(tmp_path: Path) -> None:
    _, run_dir = _project(tmp_path)
    with pytest.raises(UserError, match=NOTHING_APPLIED):
        load_applied(run_dir)


def test_earliest_backup_is_the_original(tmp_path: Path) -> None:
    project, run_dir, applied = _two_rules_three_edits(tmp_path)
    assert applied.rules == ["fused_softmax", "gemm_align"]
    by_name = {f.path.name: f for f in applied.files}
    assert by_name["train.py"].original.read_text() == "a = 1\nb = 2\n"
    assert by_name["train.py"].rules == ["fused_softmax", "gemm_align"]
    assert [(c.rule, c.line) for c in by_name["train.py"].changes] == [
        ("fused_softmax", 1),
        ("gemm_align", 2),
    ]
    assert by_name["model.py"].original.read_text() == "c = 3\n"
    assert not any(f.edited_since for f in applied.files)
    assert applied.sources()[str((project / "model.py").resolve())] == str(by_name["model.py"].original)


def test_edited_after_apply_is_noticed(tmp_path: Path) -> None:
    project, run_dir = _project(tmp_path)
    fake_apply(run_dir, project / "train.py", "a = 1", "a = 10")
    (project / "train.py").write_text("a = 11\nb = 2\n")
    assert load_applied(run_dir).files[0].edited_since


def test_tampered_or_missing_backup_is_a_user_error(tmp_path: Path) -> None:
    project, run_dir = _project(tmp_path)
    fake_apply(run_dir, project / "train.py", "a = 1", "a = 10")
    backup = run_dir / json.loads((run_dir / "applied.json").read_text())["applied"][0]["backup"]
    backup.write_text("something else\n")
    with pytest.raises(UserError, match="does not match"):
        load_applied(run_dir)
    backup.unlink()
    with pytest.raises(UserError, match="missing"):
        load_applied(run_dir)


def test_malformed_applied_json(tmp_path: Path) -> None:
    _, run_dir = _project(tmp_path)
    (run_dir / "applied.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        load_applied(run_dir)
    (run_dir / "applied.json").write_text(json.dumps({"schema": 1, "applied": [{"rule": "x"}]}))
    with pytest.raises(UserError, match="malformed"):
        load_applied(run_dir)


def _text(sources: dict[str, str], project: Path, name: str) -> str:
    """What the program runs for `name`: its replacement, or the file on disk when not replaced."""
    return Path(sources.get(str((project / name).resolve()), project / name)).read_text()


def test_program_with_the_first_rules_applied(tmp_path: Path) -> None:
    project, run_dir, applied = _two_rules_three_edits(tmp_path)
    order, why = applied.rule_order()
    assert (order, why) == (["fused_softmax", "gemm_align"], None)
    none = applied.program([])
    assert (
        _text(none, project, "train.py") == "a = 1\nb = 2\n" and _text(none, project, "model.py") == "c = 3\n"
    )
    first = applied.program(["fused_softmax"])
    assert _text(first, project, "train.py") == "a = 10\nb = 2\n"  # the snapshot after fused_softmax
    assert _text(first, project, "model.py") == "c = 3\n"
    assert applied.program(order) == {}  # every file as it is now: the rewrite


@pytest.mark.parametrize(
    ("edits", "why"),
    [
        (  # the files disagree on the order of the two rules
            [("train.py", "a = 1", "a = 10", "fused_softmax"), ("train.py", "b = 2", "b = 20", "gemm_align"),
             ("model.py", "c = 3", "c = 30", "gemm_align"), ("model.py", "c = 30", "c = 31", "fused_softmax")],
            "the rules were applied to the files in different orders",
        ),
        (  # one file had a rule applied again after another one
            [("train.py", "a = 1", "a = 10", "fused_softmax"), ("train.py", "b = 2", "b = 20", "gemm_align"),
             ("train.py", "a = 10", "a = 11", "fused_softmax")],
            "train.py had fused_softmax, gemm_align, fused_softmax applied in that order",
        ),
    ],
)  # fmt: skip
def test_rules_that_cannot_be_timed_one_by_one_say_why(tmp_path: Path, edits, why) -> None:
    project, run_dir = _project(tmp_path)
    for name, old, new, rule in edits:
        fake_apply(run_dir, project / name, old, new, rule=rule)
    assert load_applied(run_dir).rule_order() == ([], why)


def test_a_missing_snapshot_is_said(tmp_path: Path) -> None:
    project, run_dir = _project(tmp_path)
    fake_apply(run_dir, project / "train.py", "a = 1", "a = 10", rule="fused_softmax")
    fake_apply(run_dir, project / "train.py", "b = 2", "b = 20", rule="gemm_align")
    data = json.loads((run_dir / "applied.json").read_text())
    del data["applied"][0]["after"]  # applied by an opadvisor that kept no snapshots
    (run_dir / "applied.json").write_text(json.dumps(data))
    applied = load_applied(run_dir)
    order, why = applied.rule_order()
    assert order == [] and "no snapshot of its fused_softmax rewrite" in why
    assert applied.program([]) and applied.program(["fused_softmax", "gemm_align"]) == {}


def test_the_programs_verify_times(tmp_path: Path) -> None:
    from opadvisor.verify.core import timing_programs

    project, run_dir = _project(tmp_path)
    fake_apply(run_dir, project / "train.py", "a = 1", "a = 10", rule="fused_softmax")
    programs, why = timing_programs(load_applied(run_dir), per_rule=True)
    assert [p.label for p in programs] == ["original", "rewrite"] and why is None  # one rule: the whole step
    fake_apply(run_dir, project / "model.py", "c = 3", "c = 30", rule="gemm_align")
    applied = load_applied(run_dir)
    programs, why = timing_programs(applied, per_rule=True)
    assert [(p.label, p.rules) for p in programs] == [
        ("original", []),
        ("+fused_softmax", ["fused_softmax"]),
        ("rewrite", ["fused_softmax", "gemm_align"]),
    ]
    assert why is None and programs[0].sources == applied.sources() and programs[-1].sources == {}
    programs, why = timing_programs(applied, per_rule=False)
    assert [p.label for p in programs] == ["original", "rewrite"] and "--no-per-rule" in why
