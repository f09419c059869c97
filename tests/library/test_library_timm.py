"""timm's attention written op by op (its `fused_attn` switch off): the finding names timm's frame, and
`opadvisor apply` writes timm's own switch, `timm.layers.set_fused_attn(True)`, once, before the model is
built; the rewritten script trains with the same losses and runs timm's fused attention."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from library_testlib import line_of, process_env, run_opadvisor

from opadvisor.profile.runs import load_run
from opadvisor.rules._library import timm_switch
from opadvisor.rules.engine import analyse

pytestmark = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="needs timm")

TIMM_FILE = "timm/layers/attention.py"


def _findings(project: Path):
    _, profiles = load_run(str(next((project / ".opadvisor" / "runs").iterdir())))
    return analyse(profiles).findings


def _losses(script: Path) -> tuple[list[float], str]:
    """The script's losses, and which attention timm's blocks ran (the script prints `fused_attn <bool>`)."""
    done = subprocess.run(
        [sys.executable, str(script)], cwd=script.parent, capture_output=True, text=True, env=process_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    fused = re.findall(r"fused_attn (\w+)", done.stdout)
    return [float(x) for x in re.findall(r"loss ([-\d.]+)", done.stdout)], " ".join(fused)


def test_the_finding_names_timms_attention_and_offers_its_switch(library_run) -> None:
    project = library_run("timm_vit")
    script = project / "timm_vit.py"
    sdpa = next(f for f in _findings(project) if f.rule == "sdpa_attention")
    assert sdpa.path.endswith(TIMM_FILE) and sdpa.function == "Attention.forward"
    lib = sdpa.library
    assert lib["package"] == "timm" and lib["module_class"] == "timm.layers.attention.Attention"
    assert lib["called_from"]["line"] == line_of(script, "call")
    assert lib["model"]["line"] == line_of(script, "model")
    assert lib["fix"]["name"] == "timm_fused_attn" and lib["fix"]["kind"] == "switch" and sdpa.fix == "safe"
    assert "set_fused_attn(True)" in sdpa.advice and f"({TIMM_FILE}:{sdpa.line}-" in sdpa.message


@pytest.mark.slow
def test_apply_writes_the_switch_once_and_the_losses_match(project_copy, tmp_path: Path) -> None:
    project = project_copy("timm_vit", tmp_path / "p")
    script = project / "timm_vit.py"
    original = tmp_path / "original" / "timm_vit.py"
    original.parent.mkdir()
    original.write_text(script.read_text())
    # the attention's fix only: `--rule all` would also compile the ViT's repeated blocks (compile_blocks,
    # tests/library/test_library_blocks.py), whose compiled graph hides the SDPA op looked for below
    run_opadvisor(project, "apply", "--rule", "sdpa_attention")
    lines = script.read_text().splitlines()
    model = line_of(script, "model")
    assert lines[model - 2] == "timm.layers.set_fused_attn(True)"
    assert script.read_text().count("set_fused_attn") == 1 and script.read_text().count("import timm") == 1
    text = script.read_text()
    again = run_opadvisor(project, "apply", "--rule", "sdpa_attention")
    assert script.read_text() == text and "nothing to rewrite" in again.stdout + again.stderr
    (before, eager), (after, fused) = _losses(original), _losses(script)
    assert len(before) == len(after) == 6
    assert after == pytest.approx(before, rel=1e-4, abs=1e-6)
    # timm's blocks now run its fused attention (scaled_dot_product_attention); the original ran the ops by
    # hand. (Not profiled again: 10 s of the suite for what these flags say.)
    assert (eager, fused) == ("False", "True")


def test_which_switch_a_timm_class_reads(tmp_path: Path) -> None:
    source = tmp_path / "swin.py"
    source.write_text(
        "class WindowAttention(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.fused_attn = use_fused_attn(experimental=True)\n"
        "class Attention(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.fused_attn = use_fused_attn()\n"
        "class Mlp(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.fc1 = nn.Linear(2, 2)\n"
    )
    assert timm_switch(str(source), "timm.models.swin.WindowAttention") == "experimental"
    assert timm_switch(str(source), "timm.models.swin.Attention") == "tested"
    assert timm_switch(str(source), "timm.models.swin.Mlp") is None
    assert timm_switch(str(source), "mypkg.Attention") is None
