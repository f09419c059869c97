"""`opadvisor suggest` on the bundled examples (CPU profiles): every pattern they hold, nothing else.

The GPU side (gemm_align on the bf16 heads, sparse_launch, GPU times) is in test_gpu_rules.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from rules_testlib import MY_RULES, REPO
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA


def line_of(lines, text):
    return next(i for i, t in enumerate(lines, 1) if text in t)


def expected(example):
    lines = (REPO / "examples" / f"{example}.py").read_text().splitlines()
    if example == "bert_train":
        return {
            ("sdpa_attention", line_of(lines, "scores = q @ k"), line_of(lines, "ctx = probs @ v")),
            (
                "fused_softmax",
                line_of(lines, "scores.masked_fill(~mask"),
                line_of(lines, "probs = self.attn_dropout"),
            ),
            ("fused_dropout_add", *[line_of(lines, "self.out_dropout(self.out_proj")] * 2),
            ("fused_dropout_add", *[line_of(lines, "self.ffn_dropout(self.ffn_out")] * 2),
        }
    return {
        ("sdpa_attention", line_of(lines, "att = (q @ k"), line_of(lines, "y = att @ v")),
        ("fused_softmax", line_of(lines, "att = att.masked_fill"), line_of(lines, "att = self.attn_dropout")),
        ("fused_dropout_add", *[line_of(lines, "self.resid_dropout(self.c_proj")] * 2),
        ("fused_dropout_add", *[line_of(lines, "self.mlp_dropout(self.mlp_proj")] * 2),
    }


@pytest.mark.parametrize("example", ["bert_train", "gpt_train"])
def test_example_findings(example, rules_profile):
    run = rules_profile(example, REPO / "examples" / f"{example}.py")
    res = CliRunner().invoke(app, ["suggest", str(run), "--format", "json", "--select", ",".join(MY_RULES)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SUGGEST_SCHEMA)
    got = {(f["rule"], f["line"], f["end_line"]) for f in doc["findings"]}
    assert got == expected(example)
    # fp32 on the CPU: the odd LM head is not gemm_align's (16-bit only); sparse_launch needs a GPU profile
    assert [n["rule"] for n in doc["notes"]] == ["sparse_launch"]
