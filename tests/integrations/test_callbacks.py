"""Trainer callbacks: a tiny HuggingFace Trainer run (and a Lightning one) records an opadvisor run that
suggest, apply, verify, report and diff work on. Nothing is downloaded (HF_HUB_OFFLINE=1); CPU only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor_here

from opadvisor.profile.runs import load_run

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPTS = HERE / "scripts"
OFFLINE = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def run(cwd: Path, *cmd: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=cwd, env=OFFLINE, capture_output=True, text=True, timeout=300
    )
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def runs_in(project: Path) -> list[Path]:
    return sorted((project / ".opadvisor" / "runs").iterdir())


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture
def project(tmp_path) -> Path:
    for name in ("trainer_custom.py", "lightning_custom.py"):
        shutil.copy(SCRIPTS / name, tmp_path / name)
    return tmp_path


def test_integrations_import_no_framework() -> None:
    code = (
        "import sys, opadvisor, opadvisor.integrations, opadvisor.cli, opadvisor.profile.recorder; "
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))"
    )
    assert run(REPO, "-c", code).stdout.strip() == "[]"


@pytest.mark.slow
def test_trainer_run_is_suggested_applied_verified_reported_and_diffed(project, monkeypatch) -> None:
    # suggest, apply, verify, diff and report run in this process (verify's runs of the script are child
    # processes, offline as the others)
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    script = project / "trainer_custom.py"
    first = run(project, "trainer_custom.py", "6", "1", "2", "--stop")
    assert "global steps 3" in first.stdout  # stop_after_window: 1 warm-up + 2 recorded, then stopped
    (before,) = runs_in(project)
    assert f"recorded 2 step(s) after 1 warm-up into .opadvisor/runs/{before.name}" in first.stderr
    assert (project / ".opadvisor" / "latest").read_text().strip() == before.name
    _, (profile,) = load_run(str(before))
    assert profile.step_detection == "callback" and profile.complete
    assert (len(profile.steps), profile.warmup_steps, profile.steps_requested) == (2, 1, 2)
    assert profile.script == str(script) and (before / "trace.json.gz").is_file()
    assert any(c.kind == "optimizer" for c in profile.constructions)  # built inside trainer.train()

    doc = json.loads(opadvisor_here(project, "suggest", "--format", "json").stdout)
    softmax = [f for f in doc["findings"] if f["rule"] == "fused_softmax"]
    assert [(f["path"], f["line"]) for f in softmax] == [
        ("trainer_custom.py", line_of(script, "scores.masked_fill"))
    ]

    assert opadvisor_here(project, "apply", "--rule", "fused_softmax").returncode == 0
    assert "opadvisor.kernels" in script.read_text()
    verify = opadvisor_here(
        project, "verify", "--steps", "2", "--warmup", "0", "--no-timing", "--no-reprofile"
    )
    assert verify.returncode == 0 and "parity passed" in verify.stdout, verify.stdout + verify.stderr
    assert runs_in(project) == [before]  # the callback records nothing under verify

    second = run(project, "trainer_custom.py", "5", "1", "2")
    assert "global steps 5" in second.stdout  # without stop_after_window training goes on
    after = next(r for r in runs_in(project) if r != before)
    diff = json.loads(opadvisor_here(project, "diff", before.name, after.name, "--format", "json").stdout)
    assert ("fused_softmax", "fixed") in {(f["rule"], f["status"]) for f in diff["findings"]}

    assert opadvisor_here(project, "report", before.name, "-o", "report.html").returncode == 0
    page = (project / "report.html").read_text()
    assert 'id="findings-table"' in page and "fused_softmax" in page


@pytest.mark.slow
def test_hf_example_with_a_config_built_bert_records_a_run(tmp_path) -> None:
    """examples/hf_trainer.py: transformers' BertForMaskedLM from a tiny BertConfig, nothing downloaded."""
    small = [
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--seq",
        "16",
        "--batch",
        "4",
        "--vocab",
        "120",
    ]
    proc = run(
        tmp_path,
        str(REPO / "examples" / "hf_trainer.py"),
        "--steps",
        "4",
        "--warmup",
        "1",
        "--record",
        "2",
        *small,
    )
    assert "recorded 2 step(s)" in proc.stderr
    (run_dir,) = runs_in(tmp_path)
    _, (profile,) = load_run(str(run_dir))
    assert profile.complete and len(profile.steps) == 2 and profile.step_detection == "callback"
    assert any(
        op.name == "aten::softmax" for op in profile.ops
    )  # the library's eager attention ran in the window
    doc = json.loads(opadvisor_here(tmp_path, "suggest", "--format", "json").stdout)
    assert doc["step_ms"] > 0


@pytest.mark.slow
def test_lightning_callback_counts_optimizer_steps(project) -> None:
    pytest.importorskip("lightning", reason="lightning is not installed (it is in the test extra)")
    proc = run(project, "lightning_custom.py", "5", "1", "2", "2")  # 2 batches per optimizer step
    assert "global steps 5" in proc.stdout and "recorded 2 step(s)" in proc.stderr
    (run_dir,) = runs_in(project)
    _, (profile,) = load_run(str(run_dir))
    assert profile.step_detection == "callback" and len(profile.steps) == 2
    for step in range(2):  # each recorded step holds both micro-batches' forwards
        embeddings = [
            o for o in profile.ops if o.step == step and o.name == "aten::embedding" and o.parent is None
        ]
        assert len(embeddings) == 2
    doc = json.loads(opadvisor_here(project, "suggest", "--format", "json").stdout)
    assert "fused_softmax" in {f["rule"] for f in doc["findings"]}


# ---- the framework-neutral recorder, in this process ----------------------------------------------------


def _train(recorder, steps: int, marks: bool = False) -> None:
    import torch

    import opadvisor

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if marks:
            opadvisor.step()  # a script's own marks must not count twice under a callback
        recorder.step()


def test_recorder_writes_the_window_and_training_goes_on(tmp_path) -> None:
    from opadvisor.profile import session
    from opadvisor.profile.recorder import WindowRecorder

    recorder = WindowRecorder(warmup=2, steps=3, out=tmp_path / "run")
    recorder.start()
    _train(recorder, 8, marks=True)
    assert session.active() is None  # hooks removed once the run was written, training went on
    assert recorder.stop() is recorder.outcome and recorder.outcome.status == "complete"
    _, (profile,) = load_run(str(tmp_path / "run"))
    assert (len(profile.steps), profile.warmup_steps, profile.step_detection) == (3, 2, "callback")
    assert all(s.wall_ms > 0 for s in profile.steps)
    assert profile.script == "<interactive>"  # pytest's own __main__ is not a user script


def test_recorder_keeps_a_partial_window_as_incomplete(tmp_path, capsys) -> None:
    from opadvisor.profile.recorder import WindowRecorder

    recorder = WindowRecorder(warmup=1, steps=5, out=tmp_path / "run")
    recorder.start()
    _train(recorder, 3)
    outcome = recorder.stop()
    assert outcome.status == "ended_early" and outcome.run_dir == tmp_path / "run"
    _, (profile,) = load_run(str(outcome.run_dir))
    assert not profile.complete and len(profile.steps) == 2


def test_recorder_writes_nothing_when_training_ends_before_the_window(tmp_path, capsys) -> None:
    from opadvisor.profile.recorder import WindowRecorder

    recorder = WindowRecorder(warmup=3, steps=2, out=tmp_path / "run")
    recorder.start()
    _train(recorder, 2)
    assert recorder.stop().run_dir is None and not (tmp_path / "run").exists()
    assert "training ended after 2 step(s), before the window was recorded" in capsys.readouterr().err


def test_recorder_is_idle_under_opadvisor_profile(tmp_path, capsys, monkeypatch) -> None:
    from opadvisor.profile.recorder import WindowRecorder
    from opadvisor.profile.session import Session, SessionConfig
    from opadvisor.verify.harness import CONFIG_ENV

    outer = Session(SessionConfig(warmup=100))
    outer.install()
    try:
        recorder = WindowRecorder(out=tmp_path / "run")
        recorder.start()
        assert recorder.idle_reason == "`opadvisor profile` is recording this process already"
        _train(recorder, 2)
        assert recorder.stop() is None
    finally:
        outer.uninstall()
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "verify.json"))
    recorder = WindowRecorder(out=tmp_path / "run")
    recorder.start()
    assert recorder.idle_reason == "the script runs under `opadvisor verify`"
    assert "the callback records nothing" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_record_one_run(tmp_path) -> None:
    shutil.copy(SCRIPTS / "ddp_recorder.py", tmp_path)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = run(tmp_path, *torchrun, "ddp_recorder.py")
    (run_dir,) = runs_in(tmp_path)
    assert proc.stdout.count(f"run {run_dir}") == 2  # both ranks wrote into the same folder
    assert (tmp_path / ".opadvisor" / "latest").read_text().strip() == run_dir.name
    _, profiles = load_run(str(run_dir))
    assert [(p.rank, p.world_size, len(p.steps)) for p in profiles] == [(0, 2, 2), (1, 2, 2)]
    assert proc.stderr.count("recorded 2 step(s)") == 1  # said once, by rank 0
