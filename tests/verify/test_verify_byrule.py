"""Per-rule time: carrying lines into the rewritten file, and the time of the ops at them."""

from __future__ import annotations

from pathlib import Path

from verify_helpers import fake_apply, make_project

from opadvisor.profile.model import Environment, Op, Profile, Step
from opadvisor.verify.applied import load_applied
from opadvisor.verify.byrule import map_lines, rule_times, site_time_ms

OLD = "a\nb\nc\nd\ne\nf\n"


def test_map_lines_moves_equal_lines_and_maps_blocks_to_their_replacement() -> None:
    new = "a\nX\nd\ne\nNEW\nf\n"  # b,c -> X; NEW inserted before f
    assert map_lines(OLD, new, [1]) == {1}
    assert map_lines(OLD, new, [2, 3]) == {2}
    assert map_lines(OLD, new, [4, 5]) == {3, 4}
    assert map_lines(OLD, new, [6]) == {6}
    assert map_lines(OLD, "a\nf\n", [3]) == {2}  # deleted: the line now at its place


def _op(i: int, file: str, line: int, dur: float, parent: int | None = None, gpu: float | None = None) -> Op:
    return Op(
        id=i,
        name=f"op{i}",
        step=0,
        start_us=0.0,
        duration_us=dur,
        file=file,
        line=line,
        parent=parent,
        gpu_time_us=gpu,
    )


def test_site_time_counts_outermost_ops_per_step(tmp_path: Path) -> None:
    f = str(tmp_path / "m.py")
    ops = [
        _op(0, f, 3, 1000.0),
        _op(1, f, 3, 600.0, parent=0),
        _op(2, f, 4, 500.0),
        _op(3, f, 9, 7000.0),
        _op(4, f, 4, 250.0, parent=3),
    ]  # nested under an op elsewhere: counted
    prof = Profile(steps=[Step(0, 0, 1, 1.0), Step(1, 1, 2, 1.0)], ops=ops)
    assert site_time_ms(prof, {f: {3, 4}}) == (1000.0 + 500.0 + 250.0) / 1000 / 2
    gpu = Profile(
        steps=[Step(0, 0, 1, 1.0)],
        ops=[_op(0, f, 3, 1000.0, gpu=40.0)],
        environment=Environment(device="cuda"),
    )
    assert site_time_ms(gpu, {f: {3}}) == 0.04
    assert site_time_ms(Profile(), {f: {3}}) is None


def test_rule_times_compares_the_sites_before_and_after(tmp_path: Path) -> None:
    project, run_dir = make_project(tmp_path, {"train.py": OLD}, "train.py", [])
    path = str((project / "train.py").resolve())
    fake_apply(run_dir, project / "train.py", "b\nc\n", "X\n", rule="fused_softmax")  # change at line 2
    before = Profile(steps=[Step(0, 0, 1, 1.0)], ops=[_op(0, path, 2, 3000.0), _op(1, path, 3, 1000.0)])
    after = Profile(steps=[Step(0, 0, 1, 1.0)], ops=[_op(0, path, 2, 1500.0), _op(1, path, 3, 9.0)])
    rows, notes = rule_times(before, load_applied(run_dir), after=after)
    # no findings in these hand-made profiles: the sites are apply's change lines (line 2 only)
    assert [(r.rule, r.before_ms, r.after_ms, r.saved_ms, r.basis) for r in rows] == [
        ("fused_softmax", 3.0, 1.5, 1.5, "cpu")
    ]
