"""End to end on the examples: profile -> apply -> the example still trains, with the same losses.

Each example is profiled on the CPU (small sizes, once a test run: tests/conftest.py's `example_project`),
a private copy of its project rewritten by `opadvisor apply` from that run's findings, then the original
(the backup apply kept) and the rewritten script train for a few steps with dropout 0 and the same seed:
the losses must match step for step. apply runs in this process; the training runs are child processes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor_here

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--hidden", "32", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "4", "--device", "cpu"]
SMALL += ["--vocab", "1003"]  # the default 30522-wide head is most of a CPU step

pytestmark = pytest.mark.slow


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
def test_apply_keeps_the_losses(example_project, tmp_path, name):
    if not (EXAMPLES / f"{name}.py").is_file():
        pytest.skip(f"examples/{name}.py is not there")
    project = example_project(f"{name}.py", tmp_path / "project")
    script = project / f"{name}.py"
    original = script.read_bytes()
    run = project / ".opadvisor" / "runs" / (project / ".opadvisor" / "latest").read_text().strip()
    before = losses(project, script)
    # all the rules (one rule alone on an example: tests/report's runs, the Trainer test, verify's tests)
    for rule in ("all",):
        done = opadvisor_here(project, "apply", "--rule", rule)
        assert done.returncode == 0, done.stderr
        assert script.read_bytes() != original, f"apply --rule {rule} changed nothing:\n{done.stderr}"
        assert f"{name}.py" in done.stderr and (
            "masked_softmax" in done.stderr or "scaled_dot" in done.stderr
        )
        record = json.loads((run / "applied.json").read_text())
        assert (run / record["applied"][0]["backup"]).read_bytes() == original
        after = losses(project, script)
        assert after == pytest.approx(before, rel=1e-5, abs=1e-6), done.stderr
        # stable: nothing left to do for the same rule
        again = opadvisor_here(project, "apply", "--rule", rule, "--check")
        assert again.returncode == 0, again.stderr
        # undo gives the original back, byte for byte
        assert opadvisor_here(project, "apply", "--undo").returncode == 0
        assert script.read_bytes() == original
