"""Calibration: `opadvisor profile` times warm-up steps without the profiler and keeps them in profile.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.model import Calibration, Profile, ProfileFormatError, load_profile, save_profile
from opadvisor.profile.session import Session, SessionConfig
from opadvisor.rules._findings import fmt_ms

SCRIPTS = Path(__file__).parent / "scripts"


def profile_cli(tmp_path: Path, *args: str):
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        return CliRunner().invoke(app, ["profile", *args])
    finally:
        os.chdir(old)


def run_profile(tmp_path: Path) -> Profile:
    (run,) = (tmp_path / ".opadvisor" / "runs").iterdir()
    return load_profile(run / "profile.json")


@pytest.mark.parametrize(
    ("warmup", "calibrate", "timed"),
    [(3, 3, 2), (5, 3, 3), (4, 1, 1), (1, 3, 0), (2, 3, 1), (5, 0, 0)],
)
def test_the_last_warmup_steps_are_timed_never_the_first(warmup: int, calibrate: int, timed: int) -> None:
    assert Session(SessionConfig(warmup=warmup, calibrate=calibrate)).calibration_steps() == timed


def test_profile_times_plain_steps_before_the_window(tmp_path: Path, monkeypatch) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "explicit_steps.py"), "--steps", "2", "--warmup", "4")
    assert result.exit_code == 0, result.output
    prof = run_profile(tmp_path)
    assert prof.calibration is not None and prof.calibration.method == "wall"  # no CUDA here
    assert len(prof.calibration.step_ms) == 3 and all(t > 0 for t in prof.calibration.step_ms)
    assert prof.plain_step_ms() == sorted(prof.calibration.step_ms)[1]
    shown = " ".join(result.output.split())  # the summary shows it beside the profiled step
    assert f"({prof.plain_step_ms():.1f} ms without the profiler)" in shown
    # no extra steps: warm-up 4 + 2 recorded, and the script stops inside its 6th opadvisor.step()
    assert "step 4 loss" in result.output and "step 5 loss" not in result.output

    # suggest on this real CPU profile: both step times, and no GPU idle to scale
    monkeypatch.chdir(tmp_path)
    table = CliRunner().invoke(app, ["suggest"])
    doc = json.loads(CliRunner().invoke(app, ["suggest", "--format", "json"]).stdout)
    assert table.exit_code == 0, table.output
    # the profile's own median (the JSON rounds to 3 places, which can change a 2-digit rendering)
    plain, profiled = fmt_ms(prof.plain_step_ms()), fmt_ms(prof.median_step_ms())
    assert f"step {plain} plain, {profiled} under the profiler" in " ".join(table.output.split())
    cal = doc["calibration"]
    assert cal["plain_step_ms"] == round(prof.plain_step_ms(), 4) and cal["method"] == "wall"
    assert cal["calibrated"] is False and cal["idle_scale"] == 1.0  # a CPU profile has no GPU idle


def test_calibrate_0_and_a_single_warmup_step_time_nothing(tmp_path: Path) -> None:
    for i, args in enumerate((["--warmup", "3", "--calibrate", "0"], ["--warmup", "1"])):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        result = profile_cli(cwd, str(SCRIPTS / "explicit_steps.py"), "--steps", "2", *args)
        assert result.exit_code == 0, result.output
        prof = run_profile(cwd)
        assert prof.calibration is None and prof.plain_step_ms() is None


def test_calibration_round_trips_and_old_profiles_load(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    save_profile(
        Profile(script="train.py", calibration=Calibration(step_ms=[5.0, 7.0, 6.0], method="cuda_sync")), path
    )
    back = load_profile(path)
    assert back.calibration == Calibration(step_ms=[5.0, 7.0, 6.0], method="cuda_sync")
    assert back.plain_step_ms() == 6.0
    data = json.loads(path.read_text())
    del data["calibration"]  # a profile.json written before calibration existed
    path.write_text(json.dumps(data))
    assert load_profile(path).calibration is None


@pytest.mark.parametrize("bad", [{"step_ms": "fast"}, {"step_ms": [1.0, "x"]}, "yes"])
def test_a_malformed_calibration_is_a_format_error(tmp_path: Path, bad) -> None:
    path = tmp_path / "profile.json"
    save_profile(Profile(script="train.py"), path)
    data = json.loads(path.read_text())
    data["calibration"] = bad
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError, match="malformed|expected an object"):
        load_profile(path)
