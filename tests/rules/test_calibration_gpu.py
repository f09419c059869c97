"""Calibration on a real GPU run: the plain steps are CUDA-synchronised, and no idle-based finding of a
launch-bound script claims more than the plain step's idle time (plain step - GPU busy). No timing is
asserted: only that the numbers suggest reports are consistent with each other."""

from __future__ import annotations

import json

import pytest
from rules_testlib import SCRIPTS, profile_script
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.model import load_profile

pytestmark = pytest.mark.gpu


def test_a_launch_bound_gpu_run_is_calibrated_and_capped(tmp_path) -> None:
    run = profile_script(SCRIPTS / "tiny_kernels.py", tmp_path / "run", steps=2, warmup=4)
    prof = load_profile(run / "profile.json")
    assert prof.calibration is not None and prof.calibration.method == "cuda_sync"
    assert len(prof.calibration.step_ms) == 3
    res = CliRunner().invoke(app, ["suggest", str(run), "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    cal = doc["calibration"]
    assert cal["calibrated"] is True and cal["plain_step_ms"] == pytest.approx(prof.plain_step_ms(), abs=1e-3)
    idle = [f for f in doc["findings"] if f["rule"] in ("sparse_launch", "host_sync", "dataloader_stall")]
    assert sum(f["est_saving_ms_per_step"] for f in idle) <= cal["plain_idle_ms"] + 1e-3
    for f in idle:
        assert f["profiled_time_ms_per_step"] is not None
        assert f["time_ms_per_step"] <= f["profiled_time_ms_per_step"] + 1e-6
    parts = doc["breakdown"]["parts"]
    plain_total = cal["gpu_busy_ms"] + cal["plain_idle_ms"]
    assert sum(p["ms"] for p in parts) == pytest.approx(plain_total, rel=0.02)
