"""The bundled examples after the fused_optimizer, dataloader_stall, manual_layernorm, fp32_gemm,
sparse_launch and fused_cross_entropy codemods (static mode, on copies): the expected sites change, and the scripts still train for 2
steps on CPU. On CPU, `fused=True` AdamW runs (torch >= 2.4 has fused CPU kernels), `pin_memory=True` only
warns, the TF32 flags do nothing, the loaders use worker processes, and `cuda_graphed` runs the original
forward (CPU tensors; the GPU side is tests/kernels/test_kernels_graphs.py and test_sparse_launch_gpu.py).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from remaining_helpers import RULES, run

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SMALL = "--device cpu --hidden 32 --layers 1 --heads 2 --seq 16 --batch 4 --vocab 1003".split()
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)$")

# script -> (its arguments, the number of changes each codemod makes)
CASES = {
    "bert_train.py": (
        SMALL,
        {
            "fused_optimizer": 1,
            "dataloader_stall": 4,
            "manual_layernorm": 0,
            "fp32_gemm": 1,
            "sparse_launch": 1,
            "fused_cross_entropy": 1,
        },
    ),
    "gpt_train.py": (
        SMALL,
        {
            "fused_optimizer": 1,
            "dataloader_stall": 0,
            "manual_layernorm": 0,
            "fp32_gemm": 1,
            "sparse_launch": 1,
            "fused_cross_entropy": 1,
        },
    ),
    "ddp_train.py": (
        ["--device", "cpu", "--hidden", "32"],
        {
            "fused_optimizer": 1,
            "dataloader_stall": 3,
            "manual_layernorm": 0,
            "fp32_gemm": 1,
            "sparse_launch": 0,
            "fused_cross_entropy": 1,
        },
    ),
}


def _rewrite(source: str) -> tuple[str, dict[str, int]]:
    counts = {}
    for rule in RULES:
        source, codemod = run(rule, source)
        counts[rule] = len(codemod.changes)
    return source, counts


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_example_trains_after_the_codemods(tmp_path: Path, script: str) -> None:
    args, expected = CASES[script]
    rewritten, counts = _rewrite((EXAMPLES / script).read_text())
    assert counts == expected
    assert "fused=True" in rewritten
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in rewritten
    if expected["dataloader_stall"]:
        assert "pin_memory=True" in rewritten and "persistent_workers=True" in rewritten
        assert rewritten.count("non_blocking=True") == expected["dataloader_stall"] - 1
    assert _rewrite(rewritten) == (rewritten, dict.fromkeys(RULES, 0))  # a fixed point

    losses = _train(tmp_path / script, rewritten, 2, args)
    assert all(math.isfinite(x) for x in losses)


def _train(path: Path, source: str, steps: int, args: list[str]) -> list[float]:
    """Run the script written to `path` for `steps` steps; its losses, one per step."""
    path.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(path), "--steps", str(steps), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=path.parent,
    )
    assert proc.returncode == 0, proc.stderr
    steps_seen = [m.groups() for m in map(STEP_LINE.match, proc.stdout.splitlines()) if m]
    assert [int(s) for s, _ in steps_seen] == list(range(1, steps + 1)), proc.stdout
    return [float(loss) for _, loss in steps_seen]


@pytest.mark.gpu
@pytest.mark.slow
def test_bert_example_on_cuda_after_the_codemods(tmp_path: Path) -> None:
    """On a GPU the rewrites are live: fused CUDA AdamW, pinned memory, asynchronous copies, TF32."""
    rewritten, _ = _rewrite((EXAMPLES / "bert_train.py").read_text())
    small = [a if a != "cpu" else "cuda" for a in SMALL]
    losses = _train(tmp_path / "bert_train.py", rewritten, 3, small)
    assert all(math.isfinite(x) for x in losses)
