"""Two fixes on one line compose: the optimizer line that fused_optimizer rewrites (`opadvisor.kernels.AdamW`
for float32 CUDA parameters, `fused=True` for float64 ones) is the line sparse_launch inserts
`model = cuda_graphed(model)` before; both must be applied, in either order."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from opadvisor.rewrite.engine import apply_findings
from opadvisor.rules.finding import Finding
from opadvisor.rules.launch.sparse_launch import SparseLaunchFacts
from opadvisor.rules.optimizer.fused_optimizer import FusedOptimizerFacts

SCRIPT = """\
import torch

model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
"""


def _findings(path: Path, dtype: str) -> list[Finding]:
    optimizer = Finding(
        rule="fused_optimizer", path=str(path), line=4, end_line=4, message="m", fix="safe",
        details=FusedOptimizerFacts(param_devices=["cuda"], param_dtypes=[dtype]).to_details(),
    )  # fmt: skip
    # sparse_launch names the function whose launches idle the GPU: here the whole module, optimizer included
    launches = Finding(
        rule="sparse_launch", path=str(path), line=1, end_line=7, message="m", fix="unsafe",
        details=SparseLaunchFacts(blockers=[], lines={}).to_details(),
    )  # fmt: skip
    return [optimizer, launches]


@pytest.mark.parametrize(
    ("dtype", "line"),
    [
        ("float32", "opt = AdamW(model.parameters(), lr=1e-3)"),
        ("float64", "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)"),
    ],
)
@pytest.mark.parametrize(
    "rules", [["fused_optimizer", "sparse_launch"], ["sparse_launch", "fused_optimizer"]]
)
def test_fused_optimizer_and_cuda_graphs_compose(tmp_path: Path, monkeypatch, rules, dtype, line) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / ".opadvisor" / "runs" / "r"
    run.mkdir(parents=True)
    sources = {str(script.resolve()): hashlib.sha256(SCRIPT.encode()).hexdigest()}
    result = apply_findings(_findings(script.resolve(), dtype), rules, run, sources, allow_unsafe=True)
    text = script.read_text()
    assert f"model = cuda_graphed(model)\n{line}\n" in text
    assert not [m for m in result.messages if "already rewritten" in m], result.messages
