"""The bundled examples train for real: a few CPU steps print finite losses, identical for the same seed."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = "--device cpu --hidden 32 --layers 1 --heads 2 --seq 16 --batch 4 --vocab 1003".split()
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")


def _losses(script: str, *extra: str) -> list[float]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "3", *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    matches = [STEP_LINE.match(line) for line in proc.stdout.splitlines()]
    steps = [(int(m.group(1)), float(m.group(2))) for m in matches if m]
    assert [s for s, _ in steps] == [1, 2, 3], proc.stdout
    return [loss for _, loss in steps]


@pytest.mark.parametrize(
    "script", ["bert_train.py", "gpt_train.py", "gpt2_gelu_train.py", "deberta_train.py"]
)
def test_example_trains_and_is_reproducible(script: str) -> None:
    first = _losses(script)
    assert all(math.isfinite(x) for x in first)
    assert _losses(script) == first
    if script == "bert_train.py":  # the examples read --seed alike (torch.manual_seed, the data's generator)
        assert _losses(script, "--seed", "1") != first


def test_lstm_example_trains_and_is_reproducible() -> None:
    """examples/lstm_train.py (a loop over nn.LSTMCell, what rnn_cell_loop finds) has its own sizes."""

    def losses(*extra: str) -> list[float]:
        proc = subprocess.run(
            [sys.executable, str(EXAMPLES / "lstm_train.py"), "--steps", "3", "--device", "cpu", *extra],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return [float(m.group(2)) for m in map(STEP_LINE.match, proc.stdout.splitlines()) if m]

    first = losses("--seq", "20")
    assert len(first) == 3 and all(math.isfinite(x) for x in first)
    assert losses("--seq", "20") == first
