"""graph_break and recompile on real profiled scripts compiled with torch.compile (issue 33; CPU, aot_eager).

What dynamo recorded while the script ran (profile/compiled.py: its structured trace) becomes findings at
the user's lines, with dynamo's reason, the kind of break, the measured host time at the break, and the
compile time the recompiles cost. A clean compiled script gets neither; an --eager run is not judged.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor
from rules_testlib import SCRIPTS, expected_lines

from opadvisor.profile.compiled import CompileRecorder
from opadvisor.profile.model import CompiledFrame, Profile, load_profile, profile_from_dict, profile_to_dict
from opadvisor.rules._compiled import break_kind
from opadvisor.rules.compile import graph_break, recompile, regional_compile
from opadvisor.rules.compile_facts import GraphBreakFacts, RecompileFacts

BREAKS = SCRIPTS / "compiled_breaks.py"


def _losses(cwd: Path, script: Path, *args: str) -> list[float]:
    proc = subprocess.run([sys.executable, str(script), "--steps", "6", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", proc.stdout)]


def test_four_planted_problems_are_found_fixed_and_compile_whole(tmp_path):
    """The done-when of issue 33 on the CPU, as a user runs it: profile, suggest, apply --rule all; the
    rewritten script then compiles with fullgraph=True and trains to the same losses. (One test, one
    profile: each profile of a compiled script costs seconds.)"""
    script = tmp_path / "train.py"
    shutil.copy(BREAKS, script)
    before = _losses(tmp_path, script)
    assert len(before) == 6
    done = opadvisor(tmp_path, "profile", "train.py", "--steps", "2", "--warmup", "2", "--", "--steps", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / ".opadvisor" / "runs" / (tmp_path / ".opadvisor" / "latest").read_text().strip()
    profile = load_profile(run / "profile.json")
    _check_breaks(profile, script)
    _check_recompile(profile, script)
    again = profile_from_dict(json.loads(json.dumps(profile_to_dict(profile))))
    assert again.compiled_frames == profile.compiled_frames

    report = opadvisor(tmp_path, "suggest", "--format", "json")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    ours = sorted(f["rule"] for f in data["findings"] if f["rule"] in ("graph_break", "recompile"))
    assert ours == ["graph_break"] * 3 + ["recompile"]
    assert all(f["fix"] == "safe" for f in data["findings"] if f["rule"] in ("graph_break", "recompile"))
    compiled = data["compiled"]
    assert compiled["graphs"] == 4
    assert compiled["compile_s"] > compiled["compile_s_first_step"] > 0  # the recompile came later

    applied = opadvisor(tmp_path, "apply", "--rule", "all")
    assert applied.returncode == 0, applied.stderr
    text = script.read_text()
    assert "torch.where(y.max() > 0, y * 0.5, y)" in text and "dynamic=True" in text
    assert ".item()  # expect: scalar_read" not in text
    assert _losses(tmp_path, script, "--fullgraph") == pytest.approx(before, rel=1e-6, abs=1e-7)


def _check_breaks(profile, script: Path) -> None:
    findings = {f.details["kind"]: f for f in graph_break.detect(profile)}
    assert set(findings) == {"scalar_read", "print", "tensor_branch"}
    for kind, finding in findings.items():
        line, _ = expected_lines(BREAKS, kind)
        assert (Path(finding.path), finding.line) == (script, line), kind
        facts = GraphBreakFacts.from_details(finding.details)
        assert facts is not None and facts.line == line and facts.reason
        assert facts.function == "TinyLM.forward" and facts.compiled_function == "forward"
        assert facts.compile_line == expected_lines(BREAKS, "recompile")[0]
        assert facts.graphs_per_step == 4  # the forward and the three frames resumed after its breaks
        assert finding.time_ms_per_step is not None and finding.time_ms_per_step > 0
        assert finding.fix == "safe"
        assert "graph break" in finding.message and "at the break" in finding.message
    assert "item" in findings["scalar_read"].details["reason"].lower()
    assert findings["tensor_branch"].end_line == findings["tensor_branch"].line + 1  # the whole if


def _check_recompile(profile, script: Path) -> None:
    (finding,) = recompile.detect(profile)
    facts = RecompileFacts.from_details(finding.details)
    assert facts is not None and facts.kind == "shape"
    assert (facts.input, facts.dim) == ("ids", 1)
    assert facts.values[:2] == ["12", "13"]
    assert facts.recompiles == 1 and facts.compile_s > 0
    assert (Path(finding.path), finding.line) == (script, expected_lines(BREAKS, "recompile")[0])
    assert finding.fix == "safe" and "dynamic" not in facts.compile_kwargs
    assert finding.time_ms_per_step is not None and finding.time_ms_per_step > 0
    assert "recompiled forward 1x" in finding.message and "size of `ids`" in finding.message


def test_a_clean_compiled_script_has_neither(rules_profile):
    profile = load_profile(rules_profile("compiled_clean") / "profile.json")
    assert profile.compiled_frames  # it was compiled, and recorded
    (call,) = [c for c in profile.constructions if c.kind == "compile"]
    assert call.line == expected_lines(SCRIPTS / "compiled_clean.py", "compile")[0]
    assert call.attrs == {"backend": "'aot_eager'", "target": "loss_of", "code_file": call.file,
                          "code_line": call.line}  # fmt: skip
    assert graph_break.detect(profile) == [] and recompile.detect(profile) == []
    assert regional_compile.detect(profile) == []  # a function compiled, not a model of blocks


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


def _synthetic(tmp_path: Path, frames: list[CompiledFrame]) -> Profile:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n\n\n\n@torch.compile\ndef step_fn(x, temperature):\n    return x / temperature\n"
    )
    return Profile(script=str(script), sources={str(script): "0" * 64}, compiled_frames=frames, steps_seen=10)


def test_a_changing_number_and_the_recompile_limit_are_named(tmp_path):
    """Guard failures as torch 2.13 words a float argument (source comment and stack appended), and a
    function that reached the recompile limit: kind, input, values, and the limit said."""
    file = str(tmp_path / "train.py")
    guard = (
        "0/0: temperature == 1.0                      # return x / temperature  # train.py:7 in step_fn\n"
        'User stack trace:\n  File "train.py", line 7, in step_fn'
    )
    frames = [
        CompiledFrame(compile_id="0/0", function="step_fn", file=file, line=6, compile_s=0.5),
        CompiledFrame(compile_id="0/1", function="step_fn", file=file, line=6, step=1, compile_s=0.25,
                      recompile_reasons=[guard]),
        CompiledFrame(compile_id="0/2", function="step_fn", file=file, line=6, step=2, compile_s=0.25,
                      recompile_reasons=[guard.replace("1.0", "2.0")],
                      failed="Unsupported: Dynamo recompile limit exceeded"),
    ]  # fmt: skip
    (finding,) = recompile.detect(_synthetic(tmp_path, frames))
    facts = RecompileFacts.from_details(finding.details)
    assert facts.kind == "scalar" and facts.input == "temperature" and facts.values == ["1.0", "2.0"]
    assert facts.reasons == ["temperature == 1.0", "temperature == 2.0"]
    assert facts.recompiles == 2 and facts.compile_s == 0.5 and facts.cache_limit_hit
    assert finding.fix == "none" and "0-d tensor" in finding.advice
    assert "reached the recompile limit" in finding.message and finding.line == 6
    assert finding.time_ms_per_step == pytest.approx(50.0)  # 0.5 s of recompiling over 10 steps
