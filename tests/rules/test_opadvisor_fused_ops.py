"""A rewritten script, profiled again: the ops opadvisor's fused ops issue themselves (their plain chain
below a size threshold, their reference code on a CPU) are marked in the profile, counted in the step, and
never read as a pattern of the model's at the line that called the fused op."""

from __future__ import annotations

from collections import Counter

from rules_testlib import SCRIPTS

from opadvisor.profile.model import load_profile
from opadvisor.rules import engine

SCRIPT = SCRIPTS / "opadvisor_fused.py"
PATTERN_RULES = {"fused_dropout_add", "fused_softmax", "fuse_region", "manual_layernorm", "sdpa_attention"}


def _line(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def _pattern_findings(profile) -> list:
    return [f for f in engine.analyse([profile]).findings if f.rule in PATTERN_RULES]


def test_fused_ops_own_work_is_marked_and_holds_no_pattern(rules_profile) -> None:
    profile = load_profile(rules_profile("opadvisor_fused") / "profile.json")
    marked = Counter(op.fused_op for op in profile.ops if op.step is not None and op.fused_op)
    assert {"dropout_add.bias_dropout_add", "softmax.masked_softmax", "activations.quick_gelu"} <= set(marked)
    assert any(op.is_backward for op in profile.ops if op.fused_op == "dropout_add.bias_dropout_add")
    # the model's own ops are not marked: its matrix products and its LayerNorm
    model_ops = [op for op in profile.ops if op.step is not None and not op.fused_op and not op.is_backward]
    assert {"aten::linear", "aten::layer_norm"} <= {op.name for op in model_ops}
    assert _pattern_findings(profile) == []


def test_without_the_mark_the_same_ops_read_as_the_callers_pattern(rules_profile) -> None:
    # the control: the same profile with the mark taken off shows the finding the mark prevents (the
    # fused op's reference chain, read as a dropout-add written at the caller's line)
    profile = load_profile(rules_profile("opadvisor_fused") / "profile.json")
    for op in profile.ops:
        op.fused_op = None
    lines = {f.line for f in _pattern_findings(profile) if f.rule == "fused_dropout_add"}
    assert _line("bias_dropout_add(self.proj(ctx)") in lines
