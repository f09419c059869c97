"""graph_break and recompile on real profiled scripts compiled with torch.compile (issue 33; CPU, aot_eager).

What dynamo recorded while the script ran (profile/compiled.py: its structured trace) becomes findings at
the user's lines, with dynamo's reason, the kind of break, the measured host time at the break, and the
compile time the recompiles cost. A clean compiled script gets neither; an --eager run is not judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rules_testlib import REPO, SCRIPTS, expected_lines, profile_script

from opadvisor.profile.compiled import CompileRecorder
from opadvisor.profile.model import CompiledFrame, load_profile, profile_from_dict, profile_to_dict
from opadvisor.rules import graph_break, recompile
from opadvisor.rules._compiled import break_kind
from opadvisor.rules.compile_facts import GraphBreakFacts, RecompileFacts
from opadvisor.rules.engine import NotApplicable

BREAKS = SCRIPTS / "compiled_breaks.py"


@pytest.fixture(scope="module")
def breaks_profile(rules_profile):
    return load_profile(rules_profile("compiled_breaks", None, "--steps", "8") / "profile.json")


def test_each_planted_break_is_found_at_its_line_with_its_kind_and_cost(breaks_profile):
    findings = {f.details["kind"]: f for f in graph_break.detect(breaks_profile)}
    assert set(findings) == {"scalar_read", "print", "tensor_branch"}
    for kind, finding in findings.items():
        line, _ = expected_lines(BREAKS, kind)
        assert (Path(finding.path), finding.line) == (BREAKS, line), kind
        facts = GraphBreakFacts.from_details(finding.details)
        assert facts is not None and facts.line == line and facts.reason
        assert facts.function == "TinyLM.forward" and facts.compiled_function == "forward"
        assert facts.compile_line == expected_lines(BREAKS, "recompile")[0]
        assert facts.graphs_per_step == 4  # the forward and the three frames resumed after its breaks
        assert finding.time_ms_per_step is not None and finding.time_ms_per_step > 0
        assert finding.fix == "safe"
        assert "graph break" in finding.message and "at the break" in finding.message
    assert "item" in findings["scalar_read"].details["reason"].lower()


def test_the_changing_sequence_length_is_a_recompile_at_the_compile_call(breaks_profile):
    (finding,) = recompile.detect(breaks_profile)
    facts = RecompileFacts.from_details(finding.details)
    assert facts is not None and facts.kind == "shape"
    assert (facts.input, facts.dim) == ("ids", 1)
    assert facts.values[:2] == ["12", "13"]
    assert facts.recompiles >= 1 and facts.compile_s > 0
    assert (Path(finding.path), finding.line) == (BREAKS, expected_lines(BREAKS, "recompile")[0])
    assert finding.fix == "safe" and "dynamic" not in facts.compile_kwargs
    assert finding.time_ms_per_step is not None and finding.time_ms_per_step > 0
    assert "recompiled forward" in finding.message and "size of `ids`" in finding.message


def test_suggest_reports_them_and_the_compile_time(rules_profile):
    run = rules_profile("compiled_breaks", None, "--steps", "8")
    proc = subprocess.run(
        [sys.executable, "-m", "opadvisor", "suggest", str(run), "--format", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rules = sorted(f["rule"] for f in report["findings"] if f["rule"] in ("graph_break", "recompile"))
    assert rules == ["graph_break"] * 3 + ["recompile"]
    compiled = report["compiled"]
    assert compiled["graphs"] == 4
    assert compiled["compile_s"] > compiled["compile_s_first_step"] > 0  # the recompile came later


def test_a_clean_compiled_script_has_neither(rules_profile):
    profile = load_profile(rules_profile("compiled_clean") / "profile.json")
    assert profile.compiled_frames  # it was compiled, and recorded
    assert graph_break.detect(profile) == [] and recompile.detect(profile) == []


def test_an_eager_run_is_not_judged(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(SCRIPTS / "compiled_clean.py"), "--eager"]
    proc = subprocess.run([*cmd, "--steps", "2", "--warmup", "1", "--out", str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    profile = load_profile(run / "profile.json")
    assert profile.compiled_frames == []
    for rule in (graph_break, recompile):
        with pytest.raises(NotApplicable, match="--eager"):
            rule.detect(profile)


def test_the_recorder_reads_dynamo_records():
    """The structured trace's records as torch 2.13 emits them (interned file names, a break, metrics)."""
    rec = CompileRecorder(lambda: 3)
    ids = {"frame_id": 2, "frame_compile_id": 1, "attempt": 0}
    rec.on_record({"str": ["/nowhere/model.py", 7]}, None)
    rec.on_record({"dynamo_start": {"stack": [{"line": 30, "name": "forward", "filename": 7}]}, **ids}, None)
    rec.on_record({"artifact": {"name": "recompile_reasons", "encoding": "json"}, **ids},
                  "2/0: tensor 'x' size mismatch at index 1. expected 8, actual 9")  # fmt: skip
    text = (
        "Graph break in user code at /nowhere/model.py:31\n"
        "Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call:\n\n"
        "Unsupported Tensor.item() call with capture_scalar_outputs=False\n"
        "  Explanation: Dynamo does not support tracing `Tensor.item()`.\n"
        "  Hint: Set `torch._dynamo.config.capture_scalar_outputs = True`.\n"
    )
    rec.on_record({"artifact": {"name": "dynamo_graph_break_reason", "encoding": "string"}, **ids}, text)
    metrics = {"co_name": "forward", "co_filename": "/nowhere/model.py", "co_firstlineno": 29,
               "entire_frame_compile_time_s": 0.25, "graph_op_count": 6, "fail_type": None}  # fmt: skip
    rec.on_record({"compilation_metrics": metrics, **ids}, None)
    (frame,) = rec.frames
    assert frame == CompiledFrame(
        compile_id="2/1", function="forward", file="/nowhere/model.py", line=29, step=3, compile_s=0.25,
        graph_ops=6, recompile_reasons=["2/0: tensor 'x' size mismatch at index 1. expected 8, actual 9"],
        break_reason="Unsupported Tensor.item() call with capture_scalar_outputs=False",
        break_explanation="Dynamo does not support tracing `Tensor.item()`.",
        break_file="/nowhere/model.py", break_line=31,
    )  # fmt: skip
    assert break_kind(frame.break_reason, frame.break_explanation) == "scalar_read"


def test_compiled_frames_round_trip_through_profile_json(breaks_profile):
    again = profile_from_dict(json.loads(json.dumps(profile_to_dict(breaks_profile))))
    assert again.compiled_frames == breaks_profile.compiled_frames
