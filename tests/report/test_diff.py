"""`opadvisor diff`: the bundled example before and after apply, the CI gate, the JSON document, matching."""

from __future__ import annotations

import json

import pytest
from fixture_profiles import load_fixture_profile
from report_testlib import opadvisor, write_run
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.report.diff import DIFF_SCHEMA, _match_findings
from opadvisor.rules.finding import Finding


@pytest.mark.slow
def test_example_before_and_after_apply(example_runs) -> None:
    """fused_softmax applied: its finding is fixed and the ops of the attention's softmax chain change."""
    proc = opadvisor(example_runs.project, "diff", "before", "after", "--format", "json")
    doc = json.loads(proc.stdout)
    assert doc["schema"] == DIFF_SCHEMA and doc["basis"] == "cpu"
    assert doc["a"]["run"] == "before" and doc["b"]["run"] == "after"
    fixed = [f for f in doc["findings"] if f["status"] == "fixed"]
    assert "fused_softmax" in {f["rule"] for f in fixed}
    assert all(f["b_ms"] is None and f["delta_ms"] == -f["a_ms"] for f in fixed)
    # on the CPU the fused call runs its PyTorch reference: other ops, called another number of times
    assert any(o["a_calls"] != o["b_calls"] for o in doc["ops"])
    for o in doc["ops"]:
        assert o["delta_ms"] == pytest.approx((o["b_ms"] or 0) - (o["a_ms"] or 0), abs=2e-3)
    # every list is ranked by the size of its change
    for key in ("breakdown", "ops"):
        sizes = [abs(c["delta_ms"] or 0) for c in doc[key]]
        assert sizes == sorted(sizes, reverse=True)
    step = doc["step"]
    assert step["delta_ms"] == pytest.approx(step["b_ms"] - step["a_ms"], abs=2e-3)
    table = opadvisor(example_runs.project, "diff", "before", "after").stdout
    assert "Step (CPU times):" in table and "fixed" in table and "fused_softmax" in table


def _slower(tmp_path, factor: float):
    a = load_fixture_profile("bert_train")
    b = load_fixture_profile("bert_train")
    for s in b.steps:
        s.wall_ms *= factor
        s.gpu_span_ms = (s.gpu_span_ms or 0) * factor
    return write_run(tmp_path / "a", [a]), write_run(tmp_path / "b", [b])


def test_fail_above_gates_on_step_time(tmp_path) -> None:
    a, b = _slower(tmp_path, 1.2)  # B's step is 20% slower
    runner = CliRunner()
    slow = runner.invoke(app, ["diff", str(a), str(b), "--fail-above", "10"])
    assert slow.exit_code == 1, slow.output
    assert "--fail-above 10%: FAIL (step +20.0%)" in slow.output
    ok = runner.invoke(app, ["diff", str(a), str(b), "--fail-above", "30"])
    assert ok.exit_code == 0 and "--fail-above 30%: ok" in ok.output
    faster = runner.invoke(app, ["diff", str(b), str(a), "--fail-above", "0", "--format", "json"])
    assert faster.exit_code == 0
    doc = json.loads(faster.stdout)
    assert doc["regressed"] is False and doc["fail_above"] == 0 and doc["step"]["pct"] < 0


def test_same_run_and_bad_format_are_user_errors(tmp_path) -> None:
    a, _ = _slower(tmp_path, 1.0)
    runner = CliRunner()
    same = runner.invoke(app, ["diff", str(a), str(a)])
    assert same.exit_code == 2 and "same run" in same.output
    bad = runner.invoke(app, ["diff", str(a), str(a), "--format", "xml"])
    assert bad.exit_code == 2 and "unknown format" in bad.output


def test_cpu_and_gpu_runs_are_compared_with_a_note(tmp_path, example_runs) -> None:
    gpu = write_run(tmp_path / "gpu", [load_fixture_profile("bert_train")])
    result = CliRunner().invoke(app, ["diff", str(example_runs.before), str(gpu), "--format", "json"])
    doc = json.loads(result.stdout)
    assert doc["basis"] == "mixed"
    assert any("do not measure the same thing" in n for n in doc["notes"])


def _finding(rule: str, line: int, ms: float, function: str = "forward") -> Finding:
    return Finding(
        rule, "/p/m.py", line, line + 1, f"{rule} at {line}", "safe", function, time_ms_per_step=ms
    )


def test_findings_are_matched_across_moved_lines() -> None:
    a = [_finding("fused_softmax", 10, 2.0), _finding("gemm_align", 30, 1.0), _finding("host_sync", 50, 0.5)]
    # B: two lines inserted above; gemm_align fixed; a new finding
    b = [_finding("fused_softmax", 12, 1.5), _finding("host_sync", 52, 0.5), _finding("fp32_gemm", 70, 3.0)]
    changes = _match_findings(a, b)
    got = [(c.rule, c.status, c.a_line, c.b_line, c.delta_ms) for c in changes]
    assert got == [
        ("fp32_gemm", "new", None, 70, 3.0),
        ("gemm_align", "fixed", 30, None, -1.0),
        ("fused_softmax", "changed", 10, 12, -0.5),
        ("host_sync", "changed", 50, 52, 0.0),
    ]
