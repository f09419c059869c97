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


LM_LOSS = """import torch
import torch.nn.functional as F

torch.manual_seed(0)
vocab = 1001
head = torch.nn.Linear(32, vocab)
x = torch.randn(4, 8, 32)
y = torch.randint(0, vocab, (4, 8))
y[0, :3] = -100
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = head(x)
    loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
loss.backward()
print("loss", repr(loss.item()), loss.dtype)
print("grad", repr(head.weight.grad.double().norm().item()), repr(head.bias.grad.double().sum().item()))
"""


@pytest.mark.slow
def test_the_float32_copy_dropped_under_autocast_keeps_values_and_gradients(tmp_path: Path) -> None:
    """`F.cross_entropy(logits.float().view(...))` under bf16 autocast: the rewrite calls the kernel on the
    16-bit logits (no float32 copy), and the loss, its dtype and the gradients are the original's (the kernel
    itself runs, through the interpreter)."""
    original, script = tmp_path / "original.py", tmp_path / "lm.py"
    original.write_text(LM_LOSS)
    script.write_text(LM_LOSS)
    done = opadvisor_here(tmp_path, "apply", "--rule", "fused_cross_entropy", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cross_entropy(logits.view(-1, vocab), y.view(-1))" in script.read_text()
    assert "float32 copy of the logits dropped" in done.stdout + done.stderr
    outputs = []
    for path in (original, script):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        ran = subprocess.run(
            [sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
        )
        assert ran.returncode == 0, ran.stderr[-3000:]
        outputs.append(ran.stdout.split())
    before, after = outputs
    assert before[2] == after[2] == "torch.float32"
    values = [float(v) for i, v in enumerate(before) if i in (1, 4, 5)]
    assert [float(v) for i, v in enumerate(after) if i in (1, 4, 5)] == pytest.approx(
        values, rel=1e-6, abs=1e-9
    )
