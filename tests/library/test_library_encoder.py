"""nn.TransformerEncoderLayer in training (torch's slow path): its dropout + residual adds are found in
torch/nn/modules/transformer.py (the dropout in _sa_block / _ff_block, the add in forward: one pattern of
the layer), named as the library's, and fixed by `opadvisor.patch` inserted after the model's line."""

from __future__ import annotations

from pathlib import Path

import pytest
from library_testlib import assert_verify_parity, line_of, run_opadvisor

from opadvisor.profile.runs import load_run
from opadvisor.rules.engine import analyse

ENCODER = "torch.nn.modules.transformer.TransformerEncoderLayer"


def _findings(project: Path):
    _, profiles = load_run(str(next((project / ".opadvisor" / "runs").iterdir())))
    return analyse(profiles).findings


def test_the_encoder_layers_dropout_adds_are_found_in_torch_and_patched(library_run) -> None:
    project = library_run("encoder")
    script = project / "encoder.py"
    found = [f for f in _findings(project) if f.rule == "fused_dropout_add"]
    assert len(found) == 2  # after self-attention, and after the feed-forward (with linear2's bias)
    for f in found:
        assert f.path.endswith("torch/nn/modules/transformer.py") and f.path != str(script.resolve())
        assert f.function == "TransformerEncoderLayer.forward"
        lib = f.library
        assert lib["file"] == "torch/nn/modules/transformer.py" and lib["module_class"] == ENCODER
        assert lib["called_from"]["line"] == line_of(script, "call")
        assert lib["fix"]["name"] == "transformer_encoder_layer" and lib["fix"]["kind"] == "patch"
        assert (
            f.fix == "safe"
            and "TransformerEncoderLayer.forward (torch/nn/modules/transformer.py:" in f.message
        )
    source = Path(found[0].path).read_text().splitlines()
    lines = {source[f.end_line - 1].strip() for f in found}
    assert lines == {"return self.dropout1(x)", "return self.dropout2(x)"}


def test_apply_inserts_the_patch_once(project_copy, tmp_path: Path) -> None:
    project = project_copy("encoder", tmp_path / "p")
    script = project / "encoder.py"
    run_opadvisor(project, "apply", "--rule", "fused_dropout_add")
    lines = script.read_text().splitlines()
    assert lines[line_of(script, "model")] == 'model = opadvisor.patch(model, rules=["fused_dropout_add"])'
    text = script.read_text()
    again = run_opadvisor(project, "apply", "--rule", "fused_dropout_add")
    assert script.read_text() == text and "nothing to rewrite" in again.stdout + again.stderr


@pytest.mark.slow
def test_verify_proves_the_encoder_patch(project_copy, tmp_path: Path) -> None:
    project = project_copy("encoder", tmp_path / "p")
    run_opadvisor(project, "apply", "--rule", "fused_dropout_add")
    assert_verify_parity(project)


def test_an_encoder_without_dropout_has_nothing_to_fuse(library_run) -> None:
    project = library_run("encoder_no_dropout")
    assert not [f for f in _findings(project) if f.rule == "fused_dropout_add"]
