"""Issue 30 item 3: `apply --force` on a file edited since the profile places each finding's lines through
a diff against the source as profiled (kept in the run), or refuses the finding; never stale lines."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_testlib import opadvisor_here

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bert_train.py"
ABOVE = "        B, S, _ = x.shape\n"  # SelfAttention.forward's first line, above every finding
INSERTED = "        # two lines added after profiling\n        _unused = None\n"
FFN = "        x = self.norm2(x + self.ffn_dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(example_project, tmp_path_factory) -> Path:
    """bert_train.py profiled on CPU (a copy of the run tests/conftest.py makes once); then rewritten as
    profiled (`expected`: apply on the unedited file)."""
    cwd = example_project("bert_train.py", tmp_path_factory.mktemp("shifted") / "project")
    script = cwd / "bert_train.py"
    run = cwd / ".opadvisor" / "runs" / (cwd / ".opadvisor" / "latest").read_text().strip()
    assert any((run / "sources").iterdir())  # the profiled source is kept in the run
    done = opadvisor_here(cwd, "apply", "--rule", "all")
    assert done.returncode == 0, done.stderr
    (cwd / "expected.py").write_bytes(script.read_bytes())
    assert opadvisor_here(cwd, "apply", "--undo").returncode == 0
    assert script.read_bytes() == EXAMPLE.read_bytes()
    return cwd


def test_lines_inserted_above_the_findings_rewrite_the_same_sites(project: Path) -> None:
    script = project / "bert_train.py"
    script.write_text(EXAMPLE.read_text().replace(ABOVE, ABOVE + INSERTED, 1))
    refused = opadvisor_here(project, "apply", "--rule", "all")
    assert refused.returncode == 2  # changed: refused without --force
    done = opadvisor_here(project, "apply", "--rule", "all", "--force")
    assert done.returncode == 0, done.stderr
    # exactly the rewrite of the file as profiled, with the two lines inserted
    expected = (project / "expected.py").read_text().replace(ABOVE, ABOVE + INSERTED, 1)
    assert script.read_text() == expected
    # apply names the findings by their lines as profiled (the same as suggest's)
    assert "bert_train.py:36-39: fused_softmax:" in done.stderr and "bert_train.py:59: fused_dropout_add" in (
        done.stderr
    )
    assert opadvisor_here(project, "apply", "--undo").returncode == 0


def test_an_edit_inside_a_finding_refuses_it_and_places_the_others(project: Path) -> None:
    script = project / "bert_train.py"
    edited = FFN.replace("F.gelu(self.ffn_in(x))", "F.gelu(self.ffn_in(x) * 1.0)")
    script.write_text(EXAMPLE.read_text().replace(ABOVE, ABOVE + INSERTED, 1).replace(FFN, edited, 1))
    done = opadvisor_here(project, "apply", "--rule", "all", "--force")
    assert done.returncode == 0, done.stderr
    assert (
        "bert_train.py:59: fused_dropout_add: not applied: its lines were edited since the profile, so the "
        "finding cannot be placed on the file" in done.stderr
    )
    text = script.read_text()
    assert edited in text  # the edited finding left as it is
    # the other findings rewritten where they are now, as on the unedited file
    expected = (project / "expected.py").read_text().replace(ABOVE, ABOVE + INSERTED, 1)
    expected_lines = [ln for ln in expected.splitlines() if "masked_softmax(" in ln or "out_dropout" in ln]
    assert expected_lines and all(ln in text.splitlines() for ln in expected_lines)
    assert opadvisor_here(project, "apply", "--undo").returncode == 0


def test_a_run_without_the_profiled_source_refuses_to_guess(project: Path) -> None:
    script = project / "bert_train.py"
    script.write_text(EXAMPLE.read_text().replace(ABOVE, ABOVE + INSERTED, 1))
    run = project / ".opadvisor" / "runs" / (project / ".opadvisor" / "latest").read_text().strip()
    kept = run / "sources"
    shutil.move(kept, project / "kept")  # as a run written before the source was kept
    try:
        done = opadvisor_here(project, "apply", "--rule", "all", "--force")
    finally:
        shutil.move(project / "kept", kept)
    assert "keeps no copy of it as profiled, so the findings' lines cannot be placed on it" in done.stderr
    assert script.read_text() == EXAMPLE.read_text().replace(ABOVE, ABOVE + INSERTED, 1)
