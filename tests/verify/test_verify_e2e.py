"""The whole chain on CPU: an example profiled by `opadvisor profile`, rewritten, `opadvisor verify`-ed.

The example's run is made once for the test run (tests/conftest.py's `example_project`); apply and verify
run in this process (verify's two runs of the script are child processes all the same).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_testlib import opadvisor_here
from verify_helpers import fake_apply


def profiled(example_project, tmp_path: Path, example: str) -> tuple[Path, Path]:
    """A private copy of the example's profiled project; (project, run folder)."""
    project = example_project(example, tmp_path / "project")
    name = (project / ".opadvisor" / "latest").read_text().strip()
    return project, project / ".opadvisor" / "runs" / name


def test_reprofile_measures_each_applied_rule(example_project, tmp_path: Path) -> None:
    project, run_dir = profiled(example_project, tmp_path, "bert_train.py")
    text = (project / "bert_train.py").read_text()
    start = text.index("        scores = q @ k")
    end = text.index("        return ctx.transpose")
    sdpa = (
        "        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, "
        "dropout_p=self.attn_dropout.p if self.training else 0.0)\n"
    )
    fake_apply(run_dir, project / "bert_train.py", text[start:end], sdpa, rule="sdpa_attention")
    proc = opadvisor_here(project, "verify", "--steps", "2", "--no-timing", "--reprofile", "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rules = json.loads(proc.stdout)["rules"]
    assert [r["rule"] for r in rules] == ["sdpa_attention"]
    row = rules[0]
    assert row["basis"] == "cpu" and row["lines"] >= 1
    assert row["before_ms_per_step"] > 0 and row["after_ms_per_step"] > 0
    # latest still names the run verify read: the re-profile went to a temporary folder
    assert (project / ".opadvisor" / "latest").read_text().strip() == run_dir.name


@pytest.mark.parametrize("example", ["bert_train.py", "gpt_train.py"])
def test_apply_all_then_verify_passes(example_project, tmp_path: Path, example: str) -> None:
    project, run_dir = profiled(example_project, tmp_path, example)
    before = (project / example).read_text()
    proc = opadvisor_here(project, "apply", "--rule", "all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (project / example).read_text() != before, "apply --rule all changed nothing"
    proc = opadvisor_here(
        project, "verify", "--steps", "3", "--no-timing", "--no-reprofile", "--format", "json"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["applied_rules"]


def test_apply_then_a_wrong_edit_fails(example_project, tmp_path: Path) -> None:
    project, run_dir = profiled(example_project, tmp_path, "bert_train.py")
    proc = opadvisor_here(project, "apply", "--rule", "all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = project / "bert_train.py"
    path.write_text(path.read_text().replace("positions[None, :] < lengths", "positions[None, :] >= lengths"))
    proc = opadvisor_here(project, "verify", "--steps", "2", "--no-timing", "--no-reprofile")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 1" in proc.stdout
