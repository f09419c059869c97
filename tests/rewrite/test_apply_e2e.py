"""End to end on the examples: profile -> apply -> the example still trains, with the same losses.

Each example is copied into a fresh project folder, profiled on the CPU (small sizes), rewritten by
`opadvisor apply` from that run's findings, then the original (the backup apply kept) and the rewritten
script train for a few steps with dropout 0 and the same seed: the losses must match step for step.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--hidden", "32", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "4", "--device", "cpu"]

pytestmark = pytest.mark.slow


def opadvisor(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opadvisor", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def losses(cwd: Path, script: Path) -> list[float]:
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--dropout", "0", *SMALL],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    values = [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", done.stdout)]
    assert len(values) == 3, done.stdout
    return values


# bert_train only: gpt_train's `apply --rule all` and its losses are held by tests/verify/test_verify_e2e.py
@pytest.mark.parametrize("name", ["bert_train"])
def test_apply_keeps_the_losses(tmp_path, name):
    if not (EXAMPLES / f"{name}.py").is_file():
        pytest.skip(f"examples/{name}.py is not there")
    script = tmp_path / f"{name}.py"
    shutil.copy(EXAMPLES / f"{name}.py", script)
    original = script.read_bytes()
    done = opadvisor(
        tmp_path, "profile", script.name, "--steps", "2", "--warmup", "1", "--", "--steps", "4", *SMALL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / ".opadvisor" / "runs" / (tmp_path / ".opadvisor" / "latest").read_text().strip()
    before = losses(tmp_path, script)
    # all the rules (one rule alone on an example: tests/report's runs, the Trainer test, verify's tests)
    for rule in ("all",):
        done = opadvisor(tmp_path, "apply", "--rule", rule)
        assert done.returncode == 0, done.stderr
        assert script.read_bytes() != original, f"apply --rule {rule} changed nothing:\n{done.stderr}"
        assert f"{name}.py" in done.stderr and (
            "masked_softmax" in done.stderr or "scaled_dot" in done.stderr
        )
        record = json.loads((run / "applied.json").read_text())
        assert (run / record["applied"][0]["backup"]).read_bytes() == original
        after = losses(tmp_path, script)
        assert after == pytest.approx(before, rel=1e-5, abs=1e-6), done.stderr
        # stable: nothing left to do for the same rule
        again = opadvisor(tmp_path, "apply", "--rule", rule, "--check")
        assert again.returncode == 0, again.stderr
        # undo gives the original back, byte for byte
        assert opadvisor(tmp_path, "apply", "--undo").returncode == 0
        assert script.read_bytes() == original
