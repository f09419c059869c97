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
    data["cwd"] = str(ROOT)
    data["sources"] = {here(k): v for k, v in data["sources"].items()}
    for key in ("ops", "annotations", "constructions"):
        for item in data.get(key, []):
            if item.get("file"):
                item["file"] = here(item["file"])
    return profile_from_dict(data)
