"""A model under torch.compile: suggest says how much of the step ran inside compiled graphs (not analysed),
and `opadvisor profile --eager` records the same code op by op, so its patterns are found and fixed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor

from opadvisor.profile.model import load_profile

SCRIPT = Path(__file__).parent / "scripts" / "compiled_attention.py"

pytestmark = pytest.mark.slow


def test_compiled_time_is_reported_and_eager_finds_the_patterns(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    shutil.copy(SCRIPT, script)
    done = opadvisor(tmp_path, "profile", str(script), "--steps", "1", "--warmup", "2", "--out", "compiled")
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(opadvisor(tmp_path, "suggest", "compiled", "--format", "json").stdout)
    assert doc["compiled"]["share_of_step"] > 0.3 and doc["compiled"]["graphs"] >= 1 and not doc["eager"]
    assert not [f for f in doc["findings"] if f["rule"] in ("fused_softmax", "sdpa_attention")]
    table = opadvisor(tmp_path, "suggest", "compiled").stdout
    assert "ran inside" in table and "opadvisor profile --eager" in table

    done = opadvisor(
        tmp_path, "profile", str(script), "--eager", "--steps", "1", "--warmup", "2", "--out", "eager"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(opadvisor(tmp_path, "suggest", "eager", "--format", "json").stdout)
    assert doc["eager"] is True and doc["compiled"] is None
    # nothing compiled, so nothing of torch.compile's own is judged (issue 33's rules say why)
    assert load_profile(tmp_path / "eager" / "profile.json").compiled_frames == []
    assert "nothing was compiled with torch.compile in this run (profiled with --eager)" in json.dumps(doc)
    rules = {f["rule"]: f for f in doc["findings"]}
    assert rules["fused_softmax"]["apply"] and rules["sdpa_attention"]["apply"]
    assert rules["fused_dropout_add"]["apply"]
    applied = opadvisor(tmp_path, "apply", "--rule", "all", "eager")
    assert applied.returncode == 0, applied.stderr
    text = script.read_text()
    assert "scaled_dot_product_attention(" in text and "bias_dropout_add(" in text
    assert subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True).returncode == 0
