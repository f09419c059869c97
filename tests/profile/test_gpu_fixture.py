"""What a real GPU profile (recorded on an H200, kept in tests/data) holds: kernels linked to their ops."""

from __future__ import annotations

from fixture_profiles import load_fixture_profile


def test_gpu_profile_links_kernels_to_ops() -> None:
    prof = load_fixture_profile("bert_train")
    assert prof.has_gpu and prof.environment.capability and prof.environment.sm_count
    kernels_by_op: dict[str, int] = {}
    for op in prof.ops:
        kernels_by_op[op.name] = kernels_by_op.get(op.name, 0) + len(op.kernels)
    assert kernels_by_op.get("aten::mm", 0) + kernels_by_op.get("aten::addmm", 0) > 0
    assert kernels_by_op.get("aten::bmm", 0) > 0
    assert kernels_by_op.get("aten::_softmax", 0) > 0
    for op in prof.ops:
        for k in op.kernels:
            assert k.duration_us > 0 and k.name
    # GPU time rolls up to the op the user called
    softmax = [o for o in prof.ops if o.name == "aten::softmax" and o.step == 0]
    assert softmax and all(o.gpu_time_us and o.gpu_time_us > 0 for o in softmax)


def test_gpu_profile_steps_have_busy_time_and_gaps() -> None:
    prof = load_fixture_profile("bert_train")
    for step in prof.steps:
        assert step.kernel_count and step.kernel_count > 0
        assert 0 < step.gpu_busy_ms <= step.gpu_span_ms
        assert all(g.duration_us >= 10 for g in step.idle_gaps)


def test_backward_kernels_carry_the_forward_line() -> None:
    prof = load_fixture_profile("bert_train")
    backward_with_kernels = [o for o in prof.ops if o.is_backward and o.kernels]
    assert backward_with_kernels
    assert all(
        o.file and o.file.endswith("bert_train.py") for o in backward_with_kernels if o.forward_op is not None
    )


def test_item_sync_points_at_its_line() -> None:
    prof = load_fixture_profile("sync_item")
    source = prof.script
    line = next(i for i, t in enumerate(open(source).read().splitlines(), 1) if "loss.item()" in t)
    synced = [prof.ops[s.op] for s in prof.syncs if s.op is not None]
    assert any(o.name == "aten::_local_scalar_dense" and o.line == line for o in synced)


def test_profile_json_round_trips_exactly(tmp_path) -> None:
    from opadvisor.profile.model import load_profile, save_profile

    prof = load_fixture_profile("bert_train")
    save_profile(prof, tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json") == prof


def test_bad_profile_json_is_a_one_line_error(tmp_path) -> None:
    import pytest

    from opadvisor.profile.model import ProfileFormatError, load_profile

    path = tmp_path / "profile.json"
    path.write_text('{"schema": 1, "ops": [')
    with pytest.raises(ProfileFormatError, match="corrupt or truncated"):
        load_profile(path)
    path.write_text('{"schema": 99}')
    with pytest.raises(ProfileFormatError, match="schema version 99"):
        load_profile(path)
    path.write_text(
        '{"schema": 1, "ops": [{"id": 0, "name": "x", "step": 0, "start_us": 0, "duration_us": 1, "kernels": [{"name": 5, "start_us": 0, "duration_us": 1}]}], "kernel_names": []}'
    )
    with pytest.raises(ProfileFormatError, match="malformed"):
        load_profile(path)


def test_every_gpu_fixture_matches_the_sources_it_was_recorded_from() -> None:
    """A fixture recorded from another version of its script would test lines that no longer exist."""
    import hashlib
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    fixtures = sorted((root / "tests" / "data").glob("*.profile.json"))
    assert fixtures
    for fixture in fixtures:
        data = json.loads(fixture.read_text())
        assert any(op.get("kernels") for op in data["ops"]), f"{fixture.name} holds no GPU kernels"
        for rel, digest in data["sources"].items():
            path = root / rel
            assert path.is_file(), f"{fixture.name}: {rel} is gone"
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, (
                f"{fixture.name} was recorded from another version of {rel}: re-record it with "
                "tests/data/record_gpu_fixtures.py on a GPU"
            )
