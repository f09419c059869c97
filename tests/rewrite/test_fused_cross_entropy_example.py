"""The fused_cross_entropy rewrite on both examples: `opadvisor apply --rule fused_cross_entropy` (static
mode, on a copy) swaps `F.cross_entropy` for `opadvisor.kernels.cross_entropy`, and the rewritten script
trains with the original's losses (dropout 0, same seed). On the CPU the fused kernel itself runs, through
Triton's interpreter (TRITON_INTERPRET=1 in the scripts' environment); on a GPU, compiled, under bf16
autocast."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_testlib import opadvisor_here

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARGS = "--hidden 32 --layers 1 --heads 2 --seq 16 --batch 4 --steps 3 --dropout 0".split()
# The interpreter runs the kernel at any class count; an odd 1001 keeps the CPU run short and still ends rows
# mid-block. On CUDA the examples' own vocabularies (30522, 50257): under 8192 classes F.cross_entropy runs.
CPU_ARGS = ["--vocab", "1001"]


def _losses(script: Path, device: str) -> list[float]:
    env = dict(os.environ)
    extra = []
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        extra = CPU_ARGS
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), *ARGS, *extra, "--device", device],
        cwd=script.parent, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", done.stdout)]


@pytest.mark.slow
@pytest.mark.parametrize("example", ["bert_train", "gpt_train"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_rewritten_example_trains_like_the_original(tmp_path: Path, example: str, device: str) -> None:
    original = tmp_path / "original.py"
    script = tmp_path / f"{example}.py"
    shutil.copy(EXAMPLES / f"{example}.py", original)
    shutil.copy(EXAMPLES / f"{example}.py", script)
    done = opadvisor_here(tmp_path, "apply", "--rule", "fused_cross_entropy", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    rewritten = script.read_text()
    assert "from opadvisor.kernels import cross_entropy" in rewritten
    assert "F.cross_entropy(" not in rewritten
    before, after = _losses(original, device), _losses(script, device)
    assert len(before) == len(after) == 3
    if device == "cpu":
        assert after == pytest.approx(before, rel=1e-5)
    else:
        assert torch.cuda.is_available()
        assert after == pytest.approx(before, rel=2e-2, abs=1e-3)
