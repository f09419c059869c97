"""What a real GPU profile (recorded on an H200, kept in tests/data) holds: kernels linked to their ops."""

from __future__ import annotations

from conftest import load_fixture_profile


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
