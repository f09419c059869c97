"""Real GPU profiles kept under tests/data (recorded by tests/data/record_gpu_fixtures.py on an H200)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def load_fixture_profile(name: str):
    """A real GPU profile kept under tests/data (see record_gpu_fixtures.py), rebased on this checkout.

    `name` is the profiled script's stem, e.g. "sync_item" or "bert_train".
    """
    from opadvisor.profile.model import profile_from_dict

    path = DATA / f"{name}.profile.json"
    if not path.is_file():
        pytest.fail(f"GPU fixture {path} is missing: record it with tests/data/record_gpu_fixtures.py")
    data = json.loads(path.read_text())

    def here(rel: str | None) -> str | None:
        return rel if not rel or Path(rel).is_absolute() else str(ROOT / rel)

    data["script"] = here(data["script"])
    if data.get("argv") and Path(data["argv"][0]).name == Path(data["script"]).name:
        data["argv"][0] = data["script"]  # recorded as the absolute path on the recording machine
    data["cwd"] = str(ROOT)
    data["sources"] = {here(k): v for k, v in data["sources"].items()}
    for key in ("ops", "annotations", "constructions"):
        for item in data.get(key, []):
            if item.get("file"):
                item["file"] = here(item["file"])
    return profile_from_dict(data)


def with_plain_step(profile, plain_ms: float | list[float], method: str = "cuda_sync"):
    """`profile` as if `opadvisor profile` had timed its warm-up steps at `plain_ms` without the profiler
    (one time, or one per timed step): sets `Profile.calibration` and drops the cached rule index."""
    from opadvisor.profile.model import Calibration

    times = [plain_ms] * 3 if isinstance(plain_ms, (int, float)) else list(plain_ms)
    profile.calibration = Calibration(step_ms=times, method=method)
    profile.__dict__.pop("_opadvisor_index", None)
    return profile


def gpu_busy_ms(profile) -> float:
    """Mean GPU busy time per step of a GPU profile."""
    return sum(s.gpu_busy_ms or 0.0 for s in profile.steps) / len(profile.steps)
