"""The chain rules and gemm_align on real CPU profiles of the scripts in scripts/: right lines, no false hits."""

from __future__ import annotations

import math

import pytest
from rules_testlib import SCRIPTS, expected_lines

from opadvisor.profile.runs import load_run
from opadvisor.rules.engine import analyse

MINE = ["fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"]


def found(run_dir, rules=MINE):
    _, profiles = load_run(str(run_dir))
    return analyse(profiles, select=rules)


def at(report, rule):
    return sorted((f.line, f.end_line) for f in report.findings if f.rule == rule)


def one(report, rule):
    hits = [f for f in report.findings if f.rule == rule]
    assert len(hits) == 1, [(f.rule, f.line, f.end_line) for f in report.findings]
    return hits[0]


def test_bert_attention(rules_profile):
    script = SCRIPTS / "bert_attention.py"
    report = found(rules_profile("bert_attention"))
    soft = one(report, "fused_softmax")
    assert (soft.line, soft.end_line) == expected_lines(script, "fused_softmax")
    assert soft.evidence.ops == ["aten::add", "aten::softmax", "aten::dropout"]
    assert soft.evidence.occurrences == 2  # two layers, one site
    assert soft.evidence.time_basis == "cpu" and soft.time_ms_per_step > 0
    assert soft.est_saving_ms_per_step is None  # no kernel times on a CPU profile: no invented saving
    assert soft.details["mask_kind"] == "additive" and soft.details["dropout_p"] == pytest.approx(0.1)
    assert soft.fix == "safe" and soft.function == "forward" and soft.source_status == "ok"
    assert soft.path == str(script)

    sdpa = one(report, "sdpa_attention")
    assert (sdpa.line, sdpa.end_line) == expected_lines(script, "sdpa_attention")
    assert sdpa.evidence.ops[0] == "aten::matmul" and sdpa.evidence.ops[-1] == "aten::matmul"
    # both stand, each names the other and which one is the bigger win
    assert soft.alternative.rule == "sdpa_attention" and sdpa.alternative.rule == "fused_softmax"
    assert sdpa.alternative.bigger_win is True and soft.alternative.bigger_win is False
    # the suggest JSON keeps them in "details" (schema 1)
    assert sdpa.details_json()["alternative"] == {
        "rule": "fused_softmax",
        "line": soft.line,
        "end_line": soft.end_line,
        "bigger_win": True,
    }
    assert "alternative" not in sdpa.details
    assert "sdpa_attention there is the bigger win" in soft.message

    add = one(report, "fused_dropout_add")
    assert (add.line, add.end_line) == expected_lines(script, "fused_dropout_add")
    assert add.details["bias"] == "linear" and add.details["inplace"] is False
    assert at(report, "gemm_align") == []  # float32: not this rule's business
    assert [n.rule for n in report.notes] == ["sparse_launch"]  # needs a GPU profile: a note, not a finding


def test_deberta_xsoftmax_and_inplace_residual(rules_profile):
    script = SCRIPTS / "deberta_xsoftmax.py"
    report = found(rules_profile("deberta_xsoftmax"))
    soft = one(report, "fused_softmax")
    assert (soft.line, soft.end_line) == expected_lines(script, "fused_softmax")
    assert soft.details["zero_fill"] is True and soft.details["mask_kind"] == "masked_fill"
    assert soft.details["fill_value"] == pytest.approx(-3.4028234663852886e38)
    # q @ k^T is in another function: the softmax is reported, the whole attention is not
    assert at(report, "sdpa_attention") == []
    add = one(report, "fused_dropout_add")
    assert (add.line, add.end_line) == expected_lines(script, "fused_dropout_add")
    assert add.details["inplace"] is True and "+= residual" in add.message


def test_annotated_transformer_and_gpt_causal_mask(rules_profile):
    script = SCRIPTS / "annotated_transformer.py"
    report = found(rules_profile("annotated_transformer"))
    assert at(report, "fused_softmax") == sorted(
        [expected_lines(script, "fused_softmax"), expected_lines(script, "gpt softmax")]
    )
    assert at(report, "sdpa_attention") == sorted(
        [expected_lines(script, "sdpa_attention"), expected_lines(script, "gpt sdpa")]
    )
    assert at(report, "fused_dropout_add") == [expected_lines(script, "gpt dropout_add")]
    fills = {f.line: f.details["fill_value"] for f in report.findings if f.rule == "fused_softmax"}
    assert fills[expected_lines(script, "fused_softmax")[0]] == pytest.approx(-1e9)
    gpt = next(
        f
        for f in report.findings
        if f.rule == "fused_softmax" and f.line == expected_lines(script, "gpt softmax")[0]
    )
    assert gpt.details["fill_value"] == -math.inf
    assert any("NaN" in n for n in gpt.evidence.notes)


def test_negatives(rules_profile):
    """SDPA already, a top-k sampling mask before softmax, dropout without residual, residual without dropout."""
    report = found(rules_profile("negatives"))
    assert report.findings == []


def test_gemm_align_bf16_on_cpu(rules_profile):
    """A CPU profile of a bf16 run counts; the odd fp32 Linear and the aligned bf16 one do not."""
    script = SCRIPTS / "bf16_gemm.py"
    report = found(rules_profile("bf16_gemm"), ["gemm_align"])
    f = one(report, "gemm_align")
    line = expected_lines(script, "gemm_align")
    assert (f.line, f.end_line) == line  # the construction call: `apply` swaps in a padded linear there
    assert f.fix == "safe"
    assert f.details["kind"] == "linear"
    assert (f.details["in_features"], f.details["out_features"]) == (64, 30522)
    assert f.details["pad_to"] == 8 and f.details["padded_out_features"] == 30528
    assert f.details["odd"] == ["N"]
    assert "N=30522" in f.message and f"bf16_gemm.py:{line[0]}" in f.message
    assert f.evidence.dtypes == ["bfloat16"] and f.evidence.time_basis == "cpu"
