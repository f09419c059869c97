"""The whole chain on CPU: `opadvisor profile` an example, rewrite it, `opadvisor verify` it.

The apply tests use the real `opadvisor apply --rule all` and are skipped while that command does not exist.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner
from verify_helpers import EXAMPLES, TINY, fake_apply

from opadvisor.cli import app

PROFILE_ARGS = ["--steps", "2", "--warmup", "1"]


def opadvisor(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opadvisor", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def profiled(tmp_path: Path, example: str) -> tuple[Path, Path]:
    """A project with the example as train.py, profiled with tiny sizes; (project, run folder)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text((EXAMPLES / example).read_text())
    proc = opadvisor(project, "profile", "train.py", *PROFILE_ARGS, "--", *TINY)
    assert proc.returncode == 0, proc.stderr
    name = (project / ".opadvisor" / "latest").read_text().strip()
    return project, project / ".opadvisor" / "runs" / name


def apply_exists() -> bool:
    return CliRunner().invoke(app, ["apply", "--help"]).exit_code == 0


def test_reprofile_measures_each_applied_rule(tmp_path: Path) -> None:
    project, run_dir = profiled(tmp_path, "bert_train.py")
    text = (project / "train.py").read_text()
    start = text.index("        scores = q @ k")
    end = text.index("        return ctx.transpose")
    sdpa = (
        "        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, "
        "dropout_p=self.attn_dropout.p if self.training else 0.0)\n"
    )
    fake_apply(run_dir, project / "train.py", text[start:end], sdpa, rule="sdpa_attention")
    proc = opadvisor(project, "verify", "--steps", "2", "--no-timing", "--reprofile", "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rules = json.loads(proc.stdout)["rules"]
    assert [r["rule"] for r in rules] == ["sdpa_attention"]
    row = rules[0]
    assert row["basis"] == "cpu" and row["lines"] >= 1
    assert row["before_ms_per_step"] > 0 and row["after_ms_per_step"] > 0
    # latest still names the run verify read: the re-profile went to a temporary folder
    assert (project / ".opadvisor" / "latest").read_text().strip() == run_dir.name


@pytest.mark.skipif(not apply_exists(), reason="`opadvisor apply` is not built yet")
@pytest.mark.parametrize("example", ["bert_train.py", "gpt_train.py"])
def test_apply_all_then_verify_passes(tmp_path: Path, example: str) -> None:
    project, run_dir = profiled(tmp_path, example)
    before = (project / "train.py").read_text()
    proc = opadvisor(project, "apply", "--rule", "all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (project / "train.py").read_text() != before, "apply --rule all changed nothing"
    proc = opadvisor(project, "verify", "--steps", "3", "--no-timing", "--no-reprofile", "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["applied_rules"]


@pytest.mark.skipif(not apply_exists(), reason="`opadvisor apply` is not built yet")
def test_apply_then_a_wrong_edit_fails(tmp_path: Path) -> None:
    project, run_dir = profiled(tmp_path, "bert_train.py")
    proc = opadvisor(project, "apply", "--rule", "all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path = project / "train.py"
    path.write_text(path.read_text().replace("positions[None, :] < lengths", "positions[None, :] >= lengths"))
    proc = opadvisor(project, "verify", "--steps", "2", "--no-timing", "--no-reprofile")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 1" in proc.stdout
