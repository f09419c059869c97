"""`opadvisor apply` on findings in library code: the library's switch or `opadvisor.patch`, written once
into the user's script where it builds the model (or at its call into the library), then verified."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from library_testlib import assert_verify_parity, line_of, run_opadvisor

from opadvisor.rewrite.base import Target
from opadvisor.rewrite.engine import rewrite_source
from opadvisor.rewrite.library import LibraryFixFacts
from opadvisor.rules.launch.sparse_launch import SparseLaunchFacts
from opadvisor.rules.loss.fused_cross_entropy import CrossEntropyFacts

# the facts of a loss finding built by hand (a GPU profile's would carry its own)
LOSS_FACTS = CrossEntropyFacts(rows=128, classes=30522, dtype="float32").to_details()


def test_apply_all_writes_the_switch_and_the_patch_once(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_bert", tmp_path / "p")
    script = project / "hf_bert.py"
    run_opadvisor(project, "apply", "--rule", "all")
    lines = script.read_text().splitlines()
    model_line = line_of(script, "model")  # one line lower: `import opadvisor` came in
    assert lines[model_line] == 'model.set_attn_implementation("sdpa")'
    assert lines[model_line + 1] == 'model = opadvisor.patch(model, rules=["fused_dropout_add"])'
    assert lines.count("import opadvisor") == 1
    text = script.read_text()
    again = run_opadvisor(project, "apply", "--rule", "all")
    assert script.read_text() == text and "nothing to rewrite" in again.stdout + again.stderr


def test_apply_one_rule_then_another_merges_into_one_patch_line(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_bert", tmp_path / "p")
    script = project / "hf_bert.py"
    run_opadvisor(project, "apply", "--rule", "fused_dropout_add")
    assert script.read_text().count("opadvisor.patch(") == 1
    run_opadvisor(project, "apply", "--rule", "sdpa_attention")  # the switch, next to the patch line
    text = script.read_text()
    assert text.count("opadvisor.patch(") == 1 and text.count("set_attn_implementation") == 1


@pytest.mark.slow
def test_verify_proves_the_library_fixes(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_bert", tmp_path / "p")
    run_opadvisor(project, "apply", "--rule", "all")
    assert_verify_parity(project)


def test_apply_writes_need_weights_false_at_the_call(project_copy, tmp_path: Path) -> None:
    project = project_copy("mha_block", tmp_path / "p")
    script = project / "mha_block.py"
    run_opadvisor(project, "apply", "--rule", "sdpa_attention")
    line = script.read_text().splitlines()[line_of(script, "call") - 1]
    assert line.strip() == "out, _ = self.attn(x, x, x, need_weights=False)  # expect: call"


# ---- the codemods on the forms people write (targets as the engine passes them) ---------------------------
def _rewrite(source: str, codemod: str, line: int, **details) -> tuple[str, list[str]]:
    details.setdefault("rules", ["fused_dropout_add"])
    new, result = rewrite_source(
        source.encode(), codemod, [Target(line, line, LibraryFixFacts(**details))], "train.py"
    )
    cst.parse_module(new)
    again, second = rewrite_source(new, codemod, [Target(line, line, LibraryFixFacts(**details))], "train.py")
    assert again == new, "not idempotent"
    return new.decode(), [n.message for n in result.skipped]


def test_patch_after_a_loader_with_rules_merged_into_an_existing_line() -> None:
    src = (
        "import torch\n"
        "from transformers import AutoModelForMaskedLM\n\n"
        "def main():\n"
        "    model = AutoModelForMaskedLM.from_pretrained('bert-base-uncased')  # the checkpoint\n"
        '    model = opadvisor.patch(model, rules=["gemm_align"])\n'
        "    model.train()\n"
    )
    out, _ = _rewrite(src, "library_patch", 5)
    assert '    model = opadvisor.patch(model, rules=["fused_dropout_add", "gemm_align"])\n' in out
    assert out.count("opadvisor.patch(") == 1 and "# the checkpoint" in out


def test_patch_wraps_a_returned_construction_and_an_attribute_target() -> None:
    src = "def build(config):\n    return BertForMaskedLM(config)\n"
    out, _ = _rewrite(src, "library_patch", 2, unsafe=True)
    assert 'return opadvisor.patch(BertForMaskedLM(config), rules=["fused_dropout_add"], unsafe=True)' in out
    assert out.startswith("import opadvisor\n")
    src = "class Trainer:\n    def __init__(self, config):\n        self.model = GPT2LMHeadModel(config)\n"
    out, _ = _rewrite(src, "library_patch", 3)
    assert '        self.model = opadvisor.patch(self.model, rules=["fused_dropout_add"])\n' in out


def test_attn_implementation_is_set_where_the_model_is_built() -> None:
    src = "model = AutoModel.from_config(config)\n"
    assert (
        _rewrite(src, "hf_attn_implementation", 1)[0]
        == 'model = AutoModel.from_config(config, attn_implementation="sdpa")\n'
    )
    src = "model = AutoModel.from_pretrained(name, attn_implementation='eager')\n"
    assert (
        _rewrite(src, "hf_attn_implementation", 1)[0]
        == 'model = AutoModel.from_pretrained(name, attn_implementation="sdpa")\n'
    )
    src = "model = AutoModel.from_pretrained(name, attn_implementation=args.attn)\n"
    out, skipped = _rewrite(src, "hf_attn_implementation", 1)
    assert out == src and "computed here" in skipped[0]
    src = "model = AutoModel.from_pretrained(name, **kwargs)\n"
    out, skipped = _rewrite(src, "hf_attn_implementation", 1)
    assert out == src and "**kwargs" in skipped[0]


def test_need_weights_only_where_the_weights_are_dropped() -> None:
    src = "def f(self, x):\n    y = self.attn(x, x, x)[0]\n    out, weights = self.attn(x, x, x)\n    return y, weights\n"
    out, _ = _rewrite(src, "mha_need_weights", 2)
    assert "y = self.attn(x, x, x, need_weights=False)[0]" in out
    out, skipped = _rewrite(src, "mha_need_weights", 3)
    assert out == src and "kept" in skipped[0]
    src = "out, _w = attn(q, k, v, need_weights=True)\n"
    assert _rewrite(src, "mha_need_weights", 1)[0] == "out, _w = attn(q, k, v, need_weights=False)\n"


def _library_view(project: Path, monkeypatch):
    """(run folder, profiles, pattern view) of a profiled project's CPU run."""
    from opadvisor.profile.runs import load_run
    from opadvisor.rules._library import pattern_view

    monkeypatch.chdir(project)
    run_dir, profiles = load_run(None)
    return run_dir, profiles, pattern_view(profiles[0])


def _describe_and_apply(finding, view, run_dir: Path, script: Path, unsafe: bool) -> tuple[str, int]:
    """A finding built by hand (its rule needs a GPU profile) described as library code and applied as
    a real one is: returns (the codemod the engine targets, the script line it targets)."""
    import hashlib

    from opadvisor.rewrite.engine import apply_findings, library_target
    from opadvisor.rules._library import describe_library

    describe_library(finding, view)
    key, path, target = library_target(finding)
    assert path == str(script.resolve())
    sources = {path: hashlib.sha256(script.read_bytes()).hexdigest()}
    apply_findings([finding], [finding.rule], run_dir, sources, allow_unsafe=unsafe)
    return key, target.line


def test_cuda_graphs_for_launches_in_library_code_go_into_the_users_script(
    project_copy, tmp_path, monkeypatch
):
    """sparse_launch needs a GPU profile; its finding in library code is built here on the CPU profile's
    view, at the attention's lines, and goes through the same description and apply as a real one."""
    from opadvisor.rules.engine import analyse
    from opadvisor.rules.finding import Finding

    project = project_copy("hf_bert", tmp_path / "p")
    run_dir, profiles, view = _library_view(project, monkeypatch)
    sdpa = next(f for f in analyse(profiles).findings if f.rule == "sdpa_attention")
    f = Finding(
        "sparse_launch", sdpa.path, sdpa.line, sdpa.end_line, "GPU idle while ...", "unsafe", sdpa.function,
        details=SparseLaunchFacts().to_details(),
    )  # fmt: skip
    script = project / "hf_bert.py"
    call = line_of(script, "call")
    assert _describe_and_apply(f, view, run_dir, script, unsafe=True) == ("sparse_launch", call)
    assert f.library["fix"]["kind"] == "rule" and f.fix == "unsafe"
    assert "model = cuda_graphed(model)\nopt = torch.optim.AdamW(" in script.read_text()


def test_the_lm_loss_in_library_code_gets_the_loss_patch(project_copy, tmp_path, monkeypatch) -> None:
    """fused_cross_entropy needs a GPU profile; its finding at BertForMaskedLM's loss line is built here on
    the CPU profile's view and goes through the same description and apply as a real one: the fix is the
    hf_mlm_loss patch (safe), written as `opadvisor.patch(model, rules=["fused_cross_entropy"])`."""
    from opadvisor.rules.finding import Finding

    project = project_copy("hf_bert", tmp_path / "p")
    run_dir, _, view = _library_view(project, monkeypatch)
    loss = next(o for o in view.ops if o.name == "aten::cross_entropy_loss" and not o.is_backward)
    assert loss.file.endswith("transformers/models/bert/modeling_bert.py")
    f = Finding(
        "fused_cross_entropy", loss.file, loss.line, loss.line, "cross_entropy ...", "safe", loss.function,
        details=LOSS_FACTS,
    )  # fmt: skip
    script = project / "hf_bert.py"
    model = line_of(script, "model")
    assert _describe_and_apply(f, view, run_dir, script, unsafe=False) == ("library_patch", model)
    assert f.library["module_class"] == "transformers.models.bert.modeling_bert.BertForMaskedLM"
    assert f.library["fix"]["name"] == "hf_mlm_loss" and f.fix == "safe"
    assert 'model = opadvisor.patch(model, rules=["fused_cross_entropy"])' in script.read_text()


def test_apply_speaks_of_a_library_fix_under_the_findings_rule(project_copy, tmp_path, monkeypatch, capsys):
    """Issue 30: apply's lines about a library fix name the finding's rule (one `opadvisor rules` lists and
    `explain` knows), never the codemod's own name (library_patch)."""
    import hashlib

    from opadvisor.cli.apply import _report
    from opadvisor.rewrite import engine
    from opadvisor.rules._library import describe_library
    from opadvisor.rules.finding import Finding

    project = project_copy("hf_bert", tmp_path / "p")
    run_dir, _, view = _library_view(project, monkeypatch)
    loss = next(o for o in view.ops if o.name == "aten::cross_entropy_loss" and not o.is_backward)
    f = Finding(
        "fused_cross_entropy", loss.file, loss.line, loss.line, "cross_entropy ...", "safe", loss.function,
        details=LOSS_FACTS,
    )  # fmt: skip
    describe_library(f, view)
    script = project / "hf_bert.py"
    sources = {str(script.resolve()): hashlib.sha256(script.read_bytes()).hexdigest()}
    result = engine.apply_findings([f], [f.rule], run_dir, sources, write=False)
    _report(result, engine, show_diff=False)
    said = capsys.readouterr().err
    assert f"hf_bert.py:{line_of(script, 'model')}: fused_cross_entropy: " in said
    assert "library_patch" not in said
