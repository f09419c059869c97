"""A hand-written dropout replaced by apply: verify's parity phase runs the original with the same
replacement (disabled like the rest), so parity holds; without it the original's dropout stays random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_testlib import opadvisor_here
from test_verify_e2e import profiled

from opadvisor.verify.applied import load_applied

pytestmark = pytest.mark.slow


def test_parity_original_carries_the_dropout_replacement(example_project, tmp_path: Path) -> None:
    project, run_dir = profiled(example_project, tmp_path, "deberta_train.py")
    proc = opadvisor_here(project, "apply", "--rule", "fuse_region")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "XDropout.apply (dropout written by hand) -> opadvisor.kernels.dropout" in proc.stdout + proc.stderr
    )

    applied = load_applied(run_dir)
    (entry,) = applied.files
    assert entry.parity_original is not None and entry.parity_original.is_relative_to(run_dir / "parity")
    parity_source = entry.parity_original.read_text()
    original = entry.original.read_text()
    # the parity original is the backup with the dropout replacement only (the gathers are as written)
    assert "opadvisor.kernels.dropout(x, self.drop_prob)" in parity_source
    assert "XDropout.apply(x, self.drop_prob)" in original
    assert "torch.gather(" in parity_source and "disentangled_bias" not in parity_source
    assert json.loads((run_dir / "applied.json").read_text())["applied"][0]["parity_original"].startswith(
        "parity/"
    )

    proc = opadvisor_here(
        project, "verify", "--steps", "3", "--no-timing", "--no-reprofile", "--format", "json"
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["parity"]["ok"], proc.stdout + proc.stderr
    assert any("dropout written by hand ran as opadvisor.kernels.dropout" in n for n in report["notes"])
