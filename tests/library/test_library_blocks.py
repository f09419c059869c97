"""The memory-bound ops of a library model's repeated blocks (BertLayer x2 of a tiny BERT under bf16
autocast): one fuse_region finding at the block's forward, whose fix is `opadvisor.patch(model,
rules=["compile_blocks"])` after the model's construction; and none where the model has no repeated
library block or runs compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from library_testlib import SCRIPTS, assert_verify_parity, line_of, process_env, run_opadvisor

BERT = "transformers.models.bert.modeling_bert."


def _findings(project: Path) -> list[dict]:
    return json.loads(run_opadvisor(project, "suggest", "--format", "json").stdout)["findings"]


def _block_finding(findings: list[dict]) -> dict:
    return next(f for f in findings if f["rule"] == "fuse_region" and f["details"].get("block"))


def test_suggest_offers_compiled_blocks_for_the_library_blocks(library_run) -> None:
    project = library_run("hf_bert_amp")
    f = _block_finding(_findings(project))
    lib = f["library"]
    assert (
        lib["file"] == "transformers/models/bert/modeling_bert.py" and lib["function"] == "BertLayer.forward"
    )
    assert lib["module_class"] == BERT + "BertLayer"
    assert lib["fix"]["name"] == "compile_blocks" and lib["fix"]["select"] == "compile_blocks"
    assert f["fix"] == "safe" and f["apply"] == "opadvisor apply --rule fuse_region"
    assert "BertLayer" in f["message"] and "2x per step" in f["message"]
    assert "opadvisor.patch(model, rules=[...])" in f["advice"]


def test_apply_writes_it_once_with_the_other_patches(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_bert_amp", tmp_path / "p")
    script = project / "hf_bert_amp.py"
    run_opadvisor(project, "apply", "--rule", "all")  # with the output blocks' patch, on one line
    lines = script.read_text().splitlines()
    model_line = line_of(script, "model")
    assert (
        lines[model_line] == 'model = opadvisor.patch(model, rules=["compile_blocks", "fused_dropout_add"])'
    )
    text = script.read_text()
    assert text.count("opadvisor.patch(") == 1 and text.count("import opadvisor") == 1
    again = run_opadvisor(project, "apply", "--rule", "all")
    assert script.read_text() == text and "nothing to rewrite" in again.stdout + again.stderr


@pytest.mark.slow
def test_the_rewritten_script_compiles_its_blocks_and_verify_passes(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_bert_amp", tmp_path / "p")
    run_opadvisor(project, "apply", "--rule", "all")
    done = subprocess.run(
        [sys.executable, "hf_bert_amp.py", "2"], cwd=project, capture_output=True, text=True, timeout=600,
        env=process_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "patched 2 modules: BertLayer x2 (compile_blocks: bert.encoder.layer.*)" in done.stderr
    assert "runs uncompiled" not in done.stderr and "keeps its original forward" not in done.stderr
    assert_verify_parity(project)


def test_no_block_finding_without_a_repeated_library_block(tmp_path: Path) -> None:
    """One BertLayer (nothing repeated): no block finding. (A model compiled whole has no op the rules see:
    tests/profile/test_compiled.py.)"""
    project = tmp_path / "p"
    project.mkdir()
    text = (SCRIPTS / "hf_bert_amp.py").read_text()
    (project / "single.py").write_text(text.replace("num_hidden_layers=2", "num_hidden_layers=1"))
    run_opadvisor(project, "profile", "single.py", "--steps", "2", "--warmup", "1")
    found = _findings(project)
    assert not [f for f in found if f["details"].get("block")], found
