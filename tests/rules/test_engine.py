"""The engine and the shared helpers on synthetic profiles: matching semantics, merging, sources, speed."""

from __future__ import annotations

import time

import pytest

from opadvisor.errors import UserError
from opadvisor.profile.model import Op, Profile, Step
from opadvisor.rules._attention import attention_sites
from opadvisor.rules._chains import Chain, Link, find_chains, matmul_mnk, names, out_shape
from opadvisor.rules._index import index_of, module_related, owner_module
from opadvisor.rules.engine import analyse, run_rules, select_rules

FILE = "/nonexistent/model.py"


def op(i, name, shapes=(), scalars=(), line=10, module="layers.0.attn", cls="Attn", fn="forward", **kw):
    return Op(
        id=i,
        name=name,
        step=0,
        start_us=float(i),
        duration_us=1.0,
        input_shapes=[list(s) if s is not None else None for s in shapes],
        input_dtypes=["float"] * len(shapes),
        scalars=list(scalars) or [None] * len(shapes),
        file=FILE,
        line=line,
        function=fn,
        module=module,
        module_class=cls,
        **kw,
    )


def profile(ops):
    return Profile(steps=[Step(0, 0.0, 1000.0, 1.0)], ops=ops)


S = [2, 4, 8, 8]


def bert_chain(start=0, module="layers.0.attn"):
    """matmul, div, add(mask), softmax, dropout, matmul: ids from `start`."""
    return [
        op(start, "aten::matmul", [S, S], module=module),
        op(start + 1, "aten::div", [S, []], [None, 2.0], module=module),
        op(start + 2, "aten::add", [S, [2, 1, 1, 8]], [None, None, 1], module=module),
        op(start + 3, "aten::softmax", [S, None], [None, -1, None], module=module),
        op(
            start + 4,
            "aten::dropout",
            [S, None, None],
            [None, 0.1, True],
            module=module + ".drop",
            cls="Dropout",
        ),
        op(start + 5, "aten::matmul", [S, S], module=module),
    ]


def test_attention_chain_on_synthetic_ops():
    findings = run_rules([profile(bert_chain())], select=["fused_softmax", "sdpa_attention"])
    assert sorted(f.rule for f in findings) == ["fused_softmax", "sdpa_attention"]


def _zero(i):
    return op(i, "aten::masked_fill", [S, [2, 1, 1, 8], None], [None, None, 0.0])


def _dropout(i):
    return op(
        i, "aten::dropout", [S, None, None], [None, 0.1, True], module="layers.0.attn.drop", cls="Dropout"
    )


@pytest.mark.parametrize("order", ["zero, dropout", "dropout, zero"])
def test_attention_chain_zero_and_dropout_in_either_order(order):
    """The declaration lets the zeroing and the dropout swap (they commute): the profile binds both in
    either order, and the product after them, as the source matcher does."""
    ops = bert_chain()[:4]
    ops += [_zero(4), _dropout(5)] if order == "zero, dropout" else [_dropout(4), _zero(5)]
    ops.append(op(6, "aten::matmul", [S, S]))
    (site,) = attention_sites(index_of(profile(ops)))
    assert set(site.match.ops) == {"qk", "scale", "mask", "softmax", "zero", "dropout", "pv"}
    assert [o.id for o in site.match.order] == list(range(7))
    (finding,) = run_rules([profile(ops)], select=["fused_softmax"])
    assert finding.details["ops"] == ["scale", "mask", "softmax", *order.split(", ")]  # in the order they ran


def test_a_real_op_of_another_function_breaks_the_chain():
    ops = bert_chain()
    # a helper in another function does real work between mask and softmax: not one chain any more
    ops.insert(3, op(3, "aten::mul", [S, S], fn="helper", line=50))
    for i, o in enumerate(ops):
        o.id = i
    assert run_rules([profile(ops)], select=["fused_softmax"]) == []
    # a view in another function is fine
    ops[3] = op(3, "aten::view", [S, None], fn="helper", line=50)
    assert len(run_rules([profile(ops)], select=["fused_softmax"])) == 1


def test_layers_are_separate_frames():
    ops = bert_chain(0, "layers.0.attn")[:3] + bert_chain(3, "layers.1.attn")[3:]
    for i, o in enumerate(ops):
        o.id = i
    # layer 0's mask and layer 1's softmax, adjacent in time: not a chain
    assert run_rules([profile(ops)], select=["fused_softmax"]) == []
    assert (
        owner_module(ops[4]) == "layers.1.attn"
        and module_related("a.b", "a.b.c")
        and not module_related("h.0", "h.1")
    )


def test_matcher_optional_links_and_skips():
    chain = Chain(
        (
            Link("a", names("add"), optional=True),
            Link("b", names("mul")),
            Link("c", names("relu"), optional=True),
        )
    )
    ops = [
        op(0, "aten::add"),
        op(1, "aten::view"),
        op(2, "aten::mul"),
        op(3, "aten::sin"),
        op(4, "aten::mul"),
        op(5, "aten::relu"),
    ]
    got = [[o.name for o in m.order] for m in find_chains(index_of(profile(ops)), chain)]
    assert got == [["aten::add", "aten::mul"], ["aten::mul", "aten::relu"]]


def test_matmul_shapes():
    lin = Op(0, "aten::linear", 0, 0.0, 1.0, input_shapes=[[4, 7, 64], [30522, 64], [30522]])
    assert matmul_mnk(lin) == (1, 28, 30522, 64) and out_shape(lin) == [4, 7, 30522]
    mm = Op(0, "aten::matmul", 0, 0.0, 1.0, input_shapes=[[2, 4, 8, 16], [2, 4, 16, 8]])
    assert matmul_mnk(mm) == (8, 8, 8, 16) and out_shape(mm) == [2, 4, 8, 8]
    folded = Op(0, "aten::matmul", 0, 0.0, 1.0, input_shapes=[[3, 5, 64], [64, 10]])
    assert matmul_mnk(folded) == (1, 15, 10, 64)


def test_select_ignore_and_unknown_rule():
    assert select_rules(["gemm_align"]) == ["gemm_align"]
    assert "gemm_align" not in select_rules(None, ["gemm_align"])
    with pytest.raises(UserError, match="unknown rule 'nope'"):
        select_rules(["nope"])


def test_multi_rank_findings_merge():
    a, b = profile(bert_chain()), profile(bert_chain())
    b.rank, b.world_size = 1, 2
    a.world_size = 2
    report = analyse([a, b], select=["fused_softmax", "sparse_launch"])
    assert len(report.findings) == 1 and report.findings[0].ranks == [0, 1]
    assert report.notes[0].rule == "sparse_launch" and report.notes[0].ranks == [0, 1]


def test_source_status_changed_and_missing(tmp_path):
    src = tmp_path / "model.py"
    src.write_text("x = 1\n" * 20)
    ops = bert_chain()
    for o in ops:
        o.file = str(src)
    p = profile(ops)
    p.sources = {str(src): "0" * 64}  # not the file's hash: it changed since profiling
    assert {f.source_status for f in run_rules([p], select=["fused_softmax"])} == {"changed"}
    src.unlink()
    assert {f.source_status for f in run_rules([p], select=["fused_softmax"])} == {"missing"}


def test_a_failing_rule_is_a_note_not_a_crash(monkeypatch):
    from opadvisor.rules.dropout_add import fused_dropout_add

    def boom(profile):
        raise RuntimeError("bad")

    monkeypatch.setattr(fused_dropout_add, "detect", boom)
    report = analyse([profile(bert_chain())], select=["fused_dropout_add", "fused_softmax"])
    assert [f.rule for f in report.findings] == ["fused_softmax"]
    assert report.notes[0].rule == "fused_dropout_add" and "RuntimeError" in report.notes[0].message


def _big_profile(layers):
    ops = []
    for layer in range(layers):
        for k, o in enumerate(bert_chain(len(ops), f"layers.{layer}.attn")):
            o.line = 10 + k
            ops.append(o)
        for k in range(20):  # filler: other ops of the layer
            ops.append(
                op(len(ops), "aten::gelu", [[2, 8, 32]], module=f"layers.{layer}.mlp", cls="Mlp", line=40 + k)
            )
    return profile(ops)


def test_engine_is_linear_on_big_profiles():
    """Tens of thousands of ops: indexed once, no quadratic scan (time per op roughly constant)."""

    def timed(layers):
        p = _big_profile(layers)
        t = time.perf_counter()
        found = run_rules([p])
        return time.perf_counter() - t, len(p.ops), found

    t_small, n_small, _ = timed(500)
    t_big, n_big, found = timed(2500)
    assert n_big > 60_000
    assert t_big < 20.0, f"{n_big} ops took {t_big:.1f} s"
    assert t_big / n_big < 4 * t_small / n_small, (t_small, t_big)
    assert any(f.rule == "fused_softmax" and f.evidence.occurrences == 2500 for f in found)
