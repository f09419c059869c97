"""Two fixes on one line compose: the optimizer line that fused_optimizer rewrites (`fused=True`) is the
line sparse_launch inserts `model = cuda_graphed(model)` before; both must be applied, in either order."""

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


def _findings(path: Path) -> list[Finding]:
    optimizer = Finding(
        rule="fused_optimizer", path=str(path), line=4, end_line=4, message="m", fix="safe",
        details=FusedOptimizerFacts(param_devices=["cuda"], param_dtypes=["float32"]).to_details(),
    )  # fmt: skip
    # sparse_launch names the function whose launches idle the GPU: here the whole module, optimizer included
    launches = Finding(
        rule="sparse_launch", path=str(path), line=1, end_line=7, message="m", fix="unsafe",
        details=SparseLaunchFacts(blockers=[], lines={}).to_details(),
    )  # fmt: skip
    return [optimizer, launches]


@pytest.mark.parametrize(
    "rules", [["fused_optimizer", "sparse_launch"], ["sparse_launch", "fused_optimizer"]]
)
def test_fused_optimizer_and_cuda_graphs_compose(tmp_path: Path, monkeypatch, rules) -> None:
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / ".opadvisor" / "runs" / "r"
    run.mkdir(parents=True)
    sources = {str(script.resolve()): hashlib.sha256(SCRIPT.encode()).hexdigest()}
    result = apply_findings(_findings(script.resolve()), rules, run, sources, allow_unsafe=True)
    text = script.read_text()
    assert "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)" in text
    assert "model = cuda_graphed(model)\nopt = torch.optim.AdamW(" in text
    assert not [m for m in result.messages if "already rewritten" in m], result.messages
