"""regional_compile on a real profiled script (issue 33; CPU, aot_eager): a model of six identical blocks
compiled whole is found at its `torch.compile` line, rewritten to compile each block on its own, and then
trains to the same losses and is not found again (the "must not" on a profile of the rewritten script).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor
from rules_testlib import SCRIPTS, expected_lines

from opadvisor.profile.model import CompiledFrame, Construction, Profile, load_profile
from opadvisor.rules.compile import regional_compile
from opadvisor.rules.compile_facts import RegionalCompileFacts

BLOCKS = SCRIPTS / "compiled_blocks.py"


def _losses(cwd: Path) -> list[float]:
    proc = subprocess.run([sys.executable, "train.py", "--steps", "6"], cwd=cwd, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", proc.stdout)]


def _opadvisor(cwd: Path, *args: str):
    done = opadvisor(cwd, *args)  # profile in a child process, the rest in this one
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _profile(cwd: Path):
    _opadvisor(cwd, "profile", "train.py", "--steps", "2", "--warmup", "2", "--", "--steps", "6")
    run = cwd / ".opadvisor" / "runs" / (cwd / ".opadvisor" / "latest").read_text().strip()
    return load_profile(run / "profile.json")


def test_a_model_compiled_whole_is_compiled_block_by_block(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(BLOCKS, script)
    before = _losses(tmp_path)
    assert len(before) == 6

    profile = _profile(tmp_path)
    (call,) = [c for c in profile.constructions if c.kind == "compile"]
    assert call.attrs["blocks"] == {"cls": "Block", "qualified": "__main__.Block", "count": 6,
                                    "containers": ["blocks"], "singles": [], "param_share": 0.9231,  # 36 of 39 tensors
                                    "outside": ["emb", "head"], "variants": 1, "differs": []}  # fmt: skip
    (finding,) = regional_compile.detect(profile)
    facts = RegionalCompileFacts.from_details(finding.details)
    assert (Path(finding.path), finding.line) == (script, expected_lines(BLOCKS, "regional_compile")[0])
    assert facts.block == "Block" and facts.count == 6 and facts.model == "TinyGPT"
    assert facts.compile_s > 0 and facts.compile_kwargs == {"backend": "'aot_eager'"}
    assert finding.fix == "safe" and 0 < finding.est_saving_ms_per_step < finding.time_ms_per_step
    assert "compiles TinyGPT whole" in finding.message and "6 Block blocks" in finding.message

    listed = json.loads(_opadvisor(tmp_path, "suggest", "--format", "json").stdout)
    assert [f["fix"] for f in listed["findings"] if f["rule"] == "regional_compile"] == ["safe"]
    _opadvisor(tmp_path, "apply", "--rule", "regional_compile")
    text = script.read_text()
    loop = '    for block in model.blocks:  # expect: regional_compile\n        block.compile(backend="aot_eager")\n'
    assert loop + "    compiled = model\n" in text
    assert _losses(tmp_path) == pytest.approx(before, rel=1e-6, abs=1e-7)

    after = _profile(tmp_path)
    assert [c.attrs.get("blocks") for c in after.constructions if c.kind == "compile"] == [None] * 6
    assert regional_compile.detect(after) == []


def _compiled_whole(tmp_path: Path, blocks: dict) -> Profile:
    """A profile of `model = torch.compile(model)` whose model has `blocks`, 30 s of compiling."""
    script = tmp_path / "train.py"
    script.write_text("import torch\n\nmodel = torch.nn.Linear(2, 2)\nmodel = torch.compile(model)\n")
    call = Construction("compile", "torch.compile", str(script), 4,
                        attrs={"target": "Model.forward", "code_file": None, "code_line": None, "blocks": blocks})  # fmt: skip
    frame = CompiledFrame(compile_id="0/0", function="forward", file="/lib/model.py", line=10, compile_s=30.0)
    return Profile(script=str(script), sources={str(script): "0" * 64}, compiled_frames=[frame],
                   constructions=[call], steps_seen=10)  # fmt: skip


@pytest.mark.parametrize(
    ("variants", "differs", "found"),
    [(1, [], True), (3, ["shift_size"], True), (12, ["self_attn.layer_idx"], False)],
)
def test_blocks_that_differ_in_a_number_compile_once_each(tmp_path, variants, differs, found):
    """Blocks numbered by a `layer_idx` (every transformers model) recompile once per block under regional
    compilation (dynamo specialises on module numbers), so no finding; a few variants still pay."""
    blocks = {"cls": "Layer", "count": 12, "containers": ["layers"], "singles": [], "param_share": 0.95,
              "outside": ["embed"], "variants": variants, "differs": differs}  # fmt: skip
    findings = regional_compile.detect(_compiled_whole(tmp_path, blocks))
    assert len(findings) == int(found)
    if found:
        (finding,) = findings
        assert finding.est_saving_ms_per_step == pytest.approx(3000.0 * 0.95 * (1 - variants / 12))
        assert finding.line == 4 and "30.00 s of compiling for 12 Layer blocks" in finding.message
