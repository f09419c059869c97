"""Applying again on a tree an earlier apply already rewrote: one line per rule ("already applied"), never
one "already rewritten" or "found no code" line per finding; sparse_launch's findings point at functions,
and its one rewrite (the model wrapped before its optimizer) serves them all."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_apply import MODEL, attention_findings, cli

from opadvisor.profile.model import Profile, save_profile
from opadvisor.profile.runs import keep_sources, mark_latest
from opadvisor.rules.finding import Finding
from opadvisor.rules.launch.sparse_launch import SparseLaunchFacts

TRAIN = (
    MODEL
    + b"""

def main(device="cpu"):
    model = Attention(16).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(2, 4, 16, device=device)
        mask = torch.ones(2, 1, 4, 4, dtype=torch.bool, device=device)
        loss = model(x, x, x, x, mask).sum()
        loss.backward()
        optimizer.step()
"""
)
MAIN_LINES = (26, 34)
FORWARD_LINES = (16, 23)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.py"
    model.write_bytes(TRAIN)
    run_dir = tmp_path / ".opadvisor" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    sources = {str(model): hashlib.sha256(TRAIN).hexdigest()}
    save_profile(Profile(run_id="r1", script=str(model), sources=sources), run_dir / "profile.json")
    keep_sources(sources, run_dir)  # as `opadvisor profile` does: apply --force diffs against it
    mark_latest(run_dir)
    graphs = SparseLaunchFacts(blockers=[], lines={}).to_details()
    findings = [
        *attention_findings(model),
        Finding("sparse_launch", str(model), *FORWARD_LINES, "idle", "unsafe", details=graphs),
        Finding("sparse_launch", str(model), *MAIN_LINES, "idle", "unsafe", details=graphs),
    ]

    def analyse(profiles, select=None, ignore=None, **_):
        from opadvisor.rules.engine import Report

        return Report([f for f in findings if select is None or f.rule in select], [], list(select or []))

    monkeypatch.setattr("opadvisor.rules.engine.analyse", analyse)
    return model


def _said(result) -> list[str]:
    assert result.exit_code == 0, result.stderr
    return result.stderr.strip().splitlines()


def test_sparse_launch_findings_in_functions_are_served_by_one_wrap(project):
    said = _said(cli("--rule", "sparse_launch", "--unsafe"))
    assert "model = cuda_graphed(model)" in project.read_text()
    assert not [s for s in said if "found no code" in s or "not applied" in s], said
    said = _said(cli("--rule", "sparse_launch", "--unsafe"))
    assert said == ["model.py: sparse_launch: already applied by an earlier apply (2 findings); nothing more to do",
                    "nothing to rewrite"]  # fmt: skip


def test_applying_again_says_one_line_per_rule(project):
    first = _said(cli("--rule", "all"))
    assert "masked_softmax(" in project.read_text() and "cuda_graphed" not in project.read_text()
    assert any("sparse_launch: not applied: its fix is marked unsafe" in s for s in first)
    again = _said(cli("--rule", "all"))
    assert [s for s in again if "unsafe" not in s] == [
        "model.py: fused_softmax: already applied by an earlier apply (1 finding); nothing more to do",
        "model.py: fused_dropout_add: already applied by an earlier apply (1 finding); nothing more to do",
        "nothing to rewrite",
    ]
    unsafe = _said(cli("--rule", "all", "--unsafe"))
    assert "model = cuda_graphed(model)" in project.read_text()
    assert not [s for s in unsafe if "found no code" in s or "already rewritten" in s], unsafe
    assert sum("already applied" in s for s in unsafe) == 2
    last = _said(cli("--rule", "all", "--unsafe"))
    assert len(last) == 4 and all("already applied" in s for s in last[:3]), last


def test_a_file_already_graphed_by_hand_says_already_applied(project):
    text = TRAIN.replace(b"    optimizer = torch", b"    model = cuda_graphed(model)\n    optimizer = torch")
    text = text.replace(b"import torch\n", b"import torch\nfrom opadvisor.kernels import cuda_graphed\n", 1)
    project.write_bytes(text)
    said = _said(cli("--rule", "sparse_launch", "--unsafe", "--force"))
    # the finding whose lines hold the hand edit is not placed (issue 30: --force never guesses); the
    # other is, and finds the wrap already there
    assert sorted(s for s in said if "sparse_launch" in s) == [
        "model.py: sparse_launch: already applied: the model is already wrapped in cuda_graphed (line 29)",
        "model.py:26-34: sparse_launch: not applied: its lines were edited since the profile, so the finding "
        "cannot be placed on the file; profile again",
    ]
    assert project.read_bytes() == text
