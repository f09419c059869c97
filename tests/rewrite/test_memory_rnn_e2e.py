"""profile -> suggest -> apply -> verify for activation_checkpointing and rnn_cell_loop on the CPU, and on the
GPU (marked) with verify's peak memory before and after, and cudnn_rnn's flatten_parameters.

Each script is copied into a fresh project folder and driven through the CLI as a user would.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_testlib import opadvisor

REPO = Path(__file__).resolve().parents[2]
BLOCKS = REPO / "tests" / "profile" / "scripts" / "blocks_train.py"
CELLS = REPO / "tests" / "rules" / "scripts" / "lstm_cell_loop.py"
LAYERS = REPO / "tests" / "rules" / "scripts" / "lstm_layers.py"

pytestmark = pytest.mark.slow


def _project(tmp_path: Path, script: Path, *profile_args: str) -> Path:
    copy = tmp_path / script.name
    shutil.copy(script, copy)
    done = opadvisor(tmp_path, "profile", copy.name, "--steps", "2", "--warmup", "1", *profile_args)
    assert done.returncode == 0, done.stderr[-3000:]
    return copy


def _verify(tmp_path: Path, *args: str) -> dict:
    done = opadvisor(tmp_path, "verify", "--steps", "3", "--warmup", "1", "--format", "json", *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


def test_checkpointing_the_blocks_keeps_the_losses(tmp_path: Path):
    script = _project(tmp_path, BLOCKS, "--memory")
    suggested = json.loads(opadvisor(tmp_path, "suggest", "--format", "json").stdout)
    (finding,) = [f for f in suggested["findings"] if f["rule"] == "activation_checkpointing"]
    assert finding["apply"] == "opadvisor apply --rule activation_checkpointing"
    done = opadvisor(tmp_path, "apply", "--rule", "activation_checkpointing")
    assert done.returncode == 0, done.stderr
    assert "x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)" in script.read_text()
    report = _verify(tmp_path, "--no-timing", "--no-reprofile")
    assert report["ok"] and report["applied_rules"] == ["activation_checkpointing"]


def test_apply_naming_the_memory_rule_is_an_ask(tmp_path: Path):
    """Profiled without --memory on a CPU: `apply --rule activation_checkpointing` still finds the blocks."""
    script = _project(tmp_path, BLOCKS)
    done = opadvisor(tmp_path, "apply", "--rule", "activation_checkpointing", "--diff")
    assert done.returncode == 0, done.stderr
    assert "checkpoint(block, x, use_reentrant=False)" in done.stdout
    assert "checkpoint" not in script.read_text()  # --diff writes nothing


def test_cell_loop_becomes_one_call_with_the_same_losses(tmp_path: Path):
    script = _project(tmp_path, CELLS)
    done = opadvisor(tmp_path, "apply", "--rule", "rnn_cell_loop")
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "step_outputs, (h, c) = cell_sequence(self.cell, x, (h, c))" in text
    assert "h = self.cell(y, h)" in text  # the decoder's feedback loop stays, with the reason said
    assert "the loop does more per step" in done.stderr
    report = _verify(tmp_path, "--no-timing", "--no-reprofile")
    assert report["ok"], report["parity"]["message"]


@pytest.mark.gpu
def test_checkpointing_lowers_the_peak_that_verify_measures(tmp_path: Path):
    script = _project(tmp_path, BLOCKS, "--memory", "--", "--batch", "256", "--seq", "256")
    done = opadvisor(tmp_path, "apply", "--rule", "activation_checkpointing")
    assert done.returncode == 0 and "checkpoint" in script.read_text(), done.stderr
    report = _verify(tmp_path, "--no-reprofile")
    peaks = report["timing"]["peak_memory"]
    assert peaks is not None and peaks["after"]["allocated_bytes"] < peaks["before"]["allocated_bytes"]


@pytest.mark.gpu
def test_flatten_parameters_where_the_weights_were_replaced(tmp_path: Path):
    script = _project(tmp_path, LAYERS)
    done = opadvisor(tmp_path, "apply", "--rule", "cudnn_rnn")
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    assert "self.lstm.flatten_parameters()\n        out, _ = self.lstm(x)" in text
    assert "self.gru.flatten_parameters()" not in text  # the GRU is packed: float32 advice only
    report = _verify(tmp_path, "--no-reprofile")
    assert report["ok"], report["parity"]["message"]
