"""The sparse_launch rewrite on the BERT-like example: `opadvisor apply --rule sparse_launch --unsafe` (static
mode, on a copy) wraps the model in `cuda_graphed`, and the rewritten script trains with the original's
losses (dropout 0, same seed): exactly on the CPU (the original forward runs), within bf16 autocast's
tolerance on a GPU, where the forward and backward replay from CUDA graphs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_testlib import opadvisor_here

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bert_train.py"
# --vocab 1003: the default 30522-wide head is most of a CPU step, and the graphs do not care
ARGS = "--hidden 64 --layers 2 --heads 4 --seq 32 --batch 8 --steps 6 --dropout 0 --vocab 1003".split()


def _losses(script: Path, device: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), *ARGS, "--device", device],
        cwd=script.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", done.stdout)]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_graphed_example_trains_like_the_original(tmp_path: Path, device: str) -> None:
    original = tmp_path / "original.py"
    script = tmp_path / "bert_train.py"
    shutil.copy(EXAMPLE, original)
    shutil.copy(EXAMPLE, script)
    done = opadvisor_here(tmp_path, "apply", "--rule", "sparse_launch", "--unsafe", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model = cuda_graphed(model)" in script.read_text()
    before, after = _losses(original, device), _losses(script, device)
    assert len(before) == len(after) == 6
    if device == "cpu":
        assert after == before
    else:
        assert torch.cuda.is_available()
        assert after == pytest.approx(before, rel=2e-2, abs=1e-3)
