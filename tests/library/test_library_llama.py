"""The Llama family's kernel patches found from a profile: a tiny transformers Llama profiled on the CPU shows
its decoder layers' memory-bound ops (fuse_region, in LlamaDecoderLayer.forward); `suggest` offers the
RMSNorm / SwiGLU patch (opadvisor.patch, safe), `apply` inserts it after the line that builds the model, and
`verify` keeps the losses."""

from __future__ import annotations

from pathlib import Path

from library_testlib import assert_verify_parity, line_of, run_opadvisor

from opadvisor.profile.runs import load_run
from opadvisor.rules.engine import analyse


def test_suggest_offers_the_llama_kernels_for_the_decoder_layers_memory_bound_ops(library_run) -> None:
    project = library_run("hf_llama")
    _, profiles = load_run(str(next((project / ".opadvisor" / "runs").iterdir())))
    (found,) = [f for f in analyse(profiles).findings if f.rule == "fuse_region"]
    assert found.library["module_class"] == "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    fix = found.library["fix"]
    assert fix["name"] == "hf_rms_norm" and fix["kind"] == "patch" and fix["safety"] == "safe"
    assert "opadvisor.patch" in found.advice


def test_apply_inserts_the_patch_and_verify_keeps_the_losses(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_llama", tmp_path / "p")
    script = project / "hf_llama.py"
    run_opadvisor(project, "apply", "--rule", "fuse_region")
    lines = script.read_text().splitlines()
    assert lines[line_of(script, "model")] == 'model = opadvisor.patch(model, rules=["fuse_region"])'
    assert_verify_parity(project)
