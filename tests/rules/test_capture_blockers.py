"""sparse_launch's capture blockers: the ops inside the model's forward that a CUDA graph cannot capture,
found in a GPU profile (an H200 profile of examples/bert_train.py kept in tests/data, with one of its ops
moved into the model's forward, as a profile of such a model records it), carried as the finding's facts,
and the fix refused where no exact rewrite exists (suggest's dry run: fix "none", fix_blocked names the
line)."""

from __future__ import annotations

import pytest
from rules_testlib import REPO, gpu_fixture

from opadvisor.rewrite.check import check_fixes
from opadvisor.rules.engine import analyse
from opadvisor.rules.launch.sparse_launch import SCALAR_TENSOR, SparseLaunchFacts

EXAMPLE = REPO / "examples" / "bert_train.py"


def _line(text: str) -> int:
    return next(i for i, t in enumerate(EXAMPLE.read_text().splitlines(), 1) if text in t)


def _first(profile, name: str):
    return next(o for o in profile.ops if o.name == name and o.step is not None)


def _root(profile, op):
    while op.parent is not None:
        op = profile.ops[op.parent]
    return op


def _into_forward(profile, op, line: int) -> None:
    """Record `op` (and the ops above it) as run by the model's forward at `line`."""
    cur = op
    while True:
        cur.module, cur.line, cur.function = "", line, "forward"
        if cur.parent is None:
            break
        cur = profile.ops[cur.parent]


def _sparse(profile):
    findings = analyse([profile], select=["sparse_launch"]).findings
    assert findings and all(f.rule == "sparse_launch" for f in findings)
    return findings


def test_no_blockers_when_the_forward_copies_nothing():
    """bert_train's host copies and .item() are in the training loop, outside the model: nothing blocks."""
    for f in _sparse(gpu_fixture("bert_train")):
        assert f.fix == "unsafe" and f.facts(SparseLaunchFacts).graph().blockers == []


def test_a_number_copied_to_the_gpu_in_forward_is_a_blocker_with_a_rewrite():
    profile = gpu_fixture("bert_train")
    copy = next(profile.ops[m.op] for m in profile.memcpys if m.op is not None and "HtoD" in m.name)
    copy.input_shapes = [[], [], None]  # a 0-dim host tensor: torch.tensor(<number>)
    line = _line("scores = q @ k")
    _into_forward(profile, copy, line)
    for f in _sparse(profile):
        facts = f.facts(SparseLaunchFacts).graph()
        [b] = facts.blockers
        assert (b.path, b.line, b.rewrite) == (str(EXAMPLE), line, SCALAR_TENSOR)
        assert b.src_dtype == b.dst_dtype == "int64" and "Python number" in b.why
        assert facts.lines["blocker 0"][0] == line and facts.unfixable() == []
        assert "after rewriting the copies of Python numbers" in f.advice


def test_item_in_forward_blocks_the_graph_fix_with_its_line():
    profile = gpu_fixture("bert_train")
    item = _first(profile, "aten::_local_scalar_dense")
    line = _line("scores = q @ k")
    _into_forward(profile, item, line)
    findings = _sparse(profile)
    for f in findings:
        [b] = f.facts(SparseLaunchFacts).graph().unfixable()
        assert b.line == line and b.rewrite is None and "reads a value on the host" in b.why
        assert f"{EXAMPLE}:{line}" in f.advice and "once the forward can be captured" in f.advice
    check_fixes(findings)  # suggest's dry run: the fix is not offered
    for f in findings:
        assert f.fix == "none"
        assert f"CUDA graph capture would stop at {EXAMPLE}:{line}" in f.fix_blocked
        assert "reads a value on the host" in f.fix_blocked


def test_a_cpu_tensor_moved_in_forward_blocks_the_fix():
    profile = gpu_fixture("bert_train")
    copy = next(profile.ops[m.op] for m in profile.memcpys if m.op is not None and "HtoD" in m.name)
    _into_forward(profile, copy, _line("scores = q @ k"))
    findings = _sparse(profile)
    [b] = findings[0].facts(SparseLaunchFacts).graph().blockers
    assert b.rewrite is None and "copies a CPU tensor to the GPU" in b.why
    check_fixes(findings)
    assert {f.fix for f in findings} == {"none"}


def test_blocker_in_library_code_has_no_rewrite():
    profile = gpu_fixture("bert_train")
    copy = next(profile.ops[m.op] for m in profile.memcpys if m.op is not None and "HtoD" in m.name)
    copy.input_shapes = [[], [], None]
    copy.lib_file, copy.lib_line = "somelib/model.py", 12
    _into_forward(profile, copy, _line("scores = q @ k"))
    [b] = _sparse(profile)[0].facts(SparseLaunchFacts).graph().blockers
    assert b.rewrite is None and b.library_file == "somelib/model.py"
    assert b.where().startswith("somelib/model.py:12 (called from")


@pytest.mark.parametrize("value", [3, -2, 0, 2**40 + 1, True, 0.1, -1e-30, 3.0e38, 1e-45])
@pytest.mark.parametrize("dtype", [None, "int64", "int32", "float32", "float64", "bfloat16", "float16"])
def test_full_is_the_same_tensor_as_tensor_of_a_number(value, dtype):
    """What the rewrite relies on: `torch.full((), c, device=d)` infers the dtype `torch.tensor(c)` infers
    for a Python number and holds the same value, and `.type_as(t)` after it casts the same way; with the
    dtype given (`dtype=t.dtype` where the profile saw no cast) the same tensor too."""
    import torch

    before = torch.tensor(value)
    after = torch.full((), value)
    assert after.dtype == before.dtype and after.shape == before.shape == ()
    assert torch.equal(after, before) or (before.isnan() and after.isnan())
    if dtype is not None:
        t = torch.zeros(2, dtype=getattr(torch, dtype))
        cast_before, cast_after = before.type_as(t), after.type_as(t)
        assert cast_after.dtype == cast_before.dtype
        assert torch.equal(cast_after, cast_before) or bool(cast_before.isnan() & cast_after.isnan())
        if before.dtype == t.dtype:  # the short form the rewrite writes where the copy did not cast
            assert torch.equal(torch.full((), value, dtype=t.dtype), cast_before)


LIBRARY = """\
def mask_can_be_skipped(mask):
    if not is_tracing(mask) and mask.all():
        return True
    return False


def mask_is_full(mask):
    return bool(mask.all())
"""


@pytest.mark.parametrize(("function", "skipped"), [("mask_can_be_skipped", True), ("mask_is_full", False)])
def test_a_host_read_the_library_skips_under_capture_blocks_nothing(tmp_path, function, skipped):
    # transformers' masking_utils reads `if mask.all():` on the host every step, after `is_tracing(mask)`,
    # which counts a CUDA stream capture: under capture the read never runs (cuda_graphed captured such
    # a BERT on the H200), so it must not stop the graph fix; the same read without that check does.
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib" / "masks.py").write_text(LIBRARY, encoding="utf-8")
    profile = gpu_fixture("bert_train")
    profile.libraries["fakelib"] = {"root": str(tmp_path)}
    read = _root(profile, _first(profile, "aten::_local_scalar_dense"))  # aten::item
    read.name = "aten::is_nonzero"
    line = next(i for i, t in enumerate(LIBRARY.splitlines(), 1) if f"def {function}" in t) + 1
    for op in [read, *(o for o in profile.ops if o.parent == read.id)]:
        op.lib_file, op.lib_line = "fakelib/masks.py", line
    _into_forward(profile, read, _line("scores = q @ k"))
    findings = _sparse(profile)
    [b] = findings[0].facts(SparseLaunchFacts).graph().blockers
    assert b.skipped_when_capturing is skipped and b.library_file == "fakelib/masks.py"
    check_fixes(findings)
    assert {f.fix for f in findings if f.path == str(EXAMPLE)} == ({"unsafe"} if skipped else {"none"})
