"""Findings in library code name the library's file, line, function and module class, the user's call
into it, and the fix that applies there; never the user's `model(...)` line as the place of the pattern."""

from __future__ import annotations

import json
from pathlib import Path

from library_testlib import line_of, run_opadvisor

from opadvisor.profile.runs import load_run
from opadvisor.rules.engine import analyse

BERT_FILE = "transformers/models/bert/modeling_bert.py"
BERT = "transformers.models.bert.modeling_bert."


def _profile(project: Path):
    _, profiles = load_run(str(next((project / ".opadvisor" / "runs").iterdir())))
    return profiles[0]


def test_ops_name_the_library_frame_and_the_module_class(library_run) -> None:
    project = library_run("hf_bert")
    script = str((project / "hf_bert.py").resolve())
    prof = _profile(project)
    softmax = [o for o in prof.ops if o.name == "aten::softmax" and not o.is_backward]
    assert softmax
    op = softmax[0]
    # the user's frame is the call into the model; the library's frame is where softmax is written
    assert (op.file, op.line) == (script, line_of(project / "hf_bert.py", "call"))
    assert op.lib_file == BERT_FILE and op.lib_function == "eager_attention_forward"
    assert op.module_type == BERT + "BertSelfAttention"
    source = Path(prof.libraries["transformers"]["root"], BERT_FILE).read_text().splitlines()
    assert "softmax(" in source[op.lib_line - 1]
    assert prof.libraries["transformers"]["version"] and BERT_FILE in prof.library_sources
    assert prof.modules["bert.encoder.layer.0.attention.self"] == BERT + "BertSelfAttention"
    # the model: where the script built it, how, and the switch it was built with
    (model,) = [c for c in prof.constructions if c.kind == "model"]
    assert (model.file, model.line) == (script, line_of(project / "hf_bert.py", "model"))
    assert model.cls == BERT + "BertForMaskedLM"
    assert model.attrs == {
        "how": "constructor",
        "package": "transformers",
        "attn_implementation": "eager",
        "supports_sdpa": True,
    }
    # a Linear the library built: the user's line, and the library's line inside it
    decoder = next(
        c for c in prof.constructions if c.kind == "module" and c.module == "cls.predictions.decoder"
    )
    assert (decoder.file, decoder.line) == (model.file, model.line)
    assert decoder.lib_file == BERT_FILE and decoder.lib_function == "BertLMPredictionHead.__init__"
    assert "nn.Linear(" in source[decoder.lib_line - 1]


def test_findings_name_the_library_place_never_the_users_line(library_run) -> None:
    project = library_run("hf_bert")
    script = str((project / "hf_bert.py").resolve())
    call = line_of(project / "hf_bert.py", "call")
    report = analyse([_profile(project)])
    by_rule = {f.rule: f for f in report.findings}
    assert {"sdpa_attention", "fused_softmax", "fused_dropout_add"} <= set(by_rule)
    for f in report.findings:
        assert f.path != script, f"{f.rule} names the user's script as the place of its pattern"
    sdpa = by_rule["sdpa_attention"]
    source = Path(sdpa.path).read_text().splitlines()
    assert sdpa.path.endswith(BERT_FILE) and "torch.matmul(query" in source[sdpa.line - 1]
    assert "torch.matmul(attn_weights, value)" in source[sdpa.end_line - 1]
    words = f"in eager_attention_forward of BertSelfAttention ({BERT_FILE}:{sdpa.line}-{sdpa.end_line}), called from hf_bert.py:{call}"
    assert words in sdpa.message
    lib = sdpa.library
    assert lib["module_class"] == BERT + "BertSelfAttention" and lib["called_from"] == {
        "path": script,
        "line": call,
    }
    assert lib["fix"]["kind"] == "switch" and lib["fix"]["name"] == "hf_attn_implementation"
    assert sdpa.fix == "safe" and 'attn_implementation="sdpa"' in sdpa.advice
    add = by_rule["fused_dropout_add"]
    assert add.function in ("BertSelfOutput.forward", "BertOutput.forward")
    assert add.library["fix"]["name"] == "hf_bert_output" and add.library["fix"]["kind"] == "patch"
    assert add.library["model"]["line"] == line_of(project / "hf_bert.py", "model")


def test_json_and_sarif_carry_the_library_place(library_run) -> None:
    import jsonschema

    from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA

    project = library_run("hf_bert")
    doc = json.loads(run_opadvisor(project, "suggest", "--format", "json").stdout)
    jsonschema.validate(doc, SUGGEST_SCHEMA)
    sdpa = next(f for f in doc["findings"] if f["rule"] == "sdpa_attention")
    assert sdpa["library"]["file"] == BERT_FILE and sdpa["library"]["called_from"]["path"] == "hf_bert.py"
    assert sdpa["apply"] == "opadvisor apply --rule sdpa_attention"
    sarif = json.loads(run_opadvisor(project, "suggest", "--format", "sarif").stdout)
    result = next(r for r in sarif["runs"][0]["results"] if r["ruleId"] == "sdpa_attention")
    primary = result["locations"][0]["physicalLocation"]
    assert primary["artifactLocation"]["uri"].endswith(BERT_FILE)  # where the pattern is written
    assert primary["region"]["startLine"] == sdpa["line"]
    related = {
        (r["physicalLocation"]["artifactLocation"]["uri"], r["physicalLocation"]["region"]["startLine"])
        for r in result["relatedLocations"]
    }
    hf = project / "hf_bert.py"
    assert related == {("hf_bert.py", line_of(hf, "call")), ("hf_bert.py", line_of(hf, "model"))}
    table = run_opadvisor(project, "suggest").stdout  # the table names the file within site-packages
    folded = "".join(ch for ch in table if ch not in " \n│")
    assert f"{BERT_FILE}:{sdpa['line']}-{sdpa['end_line']}" in folded


def test_multihead_attention_asked_for_weights_it_drops(library_run) -> None:
    project = library_run("mha_block")
    report = analyse([_profile(project)])
    sdpa = next(f for f in report.findings if f.rule == "sdpa_attention")
    assert sdpa.library["file"] == "torch/nn/functional.py"
    assert sdpa.library["function"] == "multi_head_attention_forward"
    assert sdpa.library["module_class"] == "torch.nn.modules.activation.MultiheadAttention"
    call = line_of(project / "mha_block.py", "call")
    assert sdpa.library["called_from"]["line"] == call
    assert sdpa.library["fix"]["name"] == "mha_need_weights" and sdpa.fix == "safe"
