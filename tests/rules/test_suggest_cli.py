"""`opadvisor suggest / rules / explain` driven through the real app: formats, schemas, exit codes, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from rules_testlib import RULES_TESTS, SCRIPTS, expected_lines
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA

CONTRACT_KEYS = [
    "rule",
    "path",
    "line",
    "end_line",
    "message",
    "time_ms_per_step",
    "est_saving_ms_per_step",
    "fix",
]


def cli(*args, cwd=None, monkeypatch=None):
    if cwd is not None:
        monkeypatch.chdir(cwd)
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def bert_run(rules_profile):
    return rules_profile("bert_attention")


def test_json_follows_the_contract(bert_run):
    res = CliRunner().invoke(app, ["suggest", str(bert_run), "--format", "json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    jsonschema.validate(doc, SUGGEST_SCHEMA)
    assert list(doc)[:5] == ["schema", "run", "device", "step_ms", "findings"] and doc["schema"] == 1
    assert doc["device"] == "cpu" and doc["step_ms"] > 0
    for f in doc["findings"]:
        assert list(f)[:8] == CONTRACT_KEYS
    soft = next(f for f in doc["findings"] if f["rule"] == "fused_softmax")
    assert (soft["line"], soft["end_line"]) == expected_lines(SCRIPTS / "bert_attention.py", "fused_softmax")
    assert soft["path"] == "tests/rules/scripts/bert_attention.py" or soft["path"].endswith(
        "bert_attention.py"
    )
    assert soft["apply"] == "opadvisor apply --rule fused_softmax"
    assert soft["time_basis"] == "cpu" and soft["est_saving_ms_per_step"] is None
    assert any(n["rule"] == "sparse_launch" for n in doc["notes"])
    times = [f["time_ms_per_step"] for f in doc["findings"]]
    assert times == sorted(times, reverse=True)


def test_sarif_validates(bert_run):
    res = CliRunner().invoke(app, ["suggest", str(bert_run), "--format", "sarif"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    schema = json.loads((RULES_TESTS / "sarif_2_1_0_subset.schema.json").read_text())
    jsonschema.validate(doc, schema)
    run = doc["runs"][0]
    assert doc["version"] == "2.1.0" and run["tool"]["driver"]["name"] == "opadvisor"
    ids = [r["id"] for r in run["tool"]["driver"]["rules"]]
    results = run["results"]
    assert {r["ruleId"] for r in results} == {"fused_softmax", "sdpa_attention", "fused_dropout_add"}
    for r in results:
        assert ids[r["ruleIndex"]] == r["ruleId"]
        region = r["locations"][0]["physicalLocation"]["region"]
        assert 1 <= region["startLine"] <= region["endLine"]
    soft = next(r for r in results if r["ruleId"] == "fused_softmax")
    region = soft["locations"][0]["physicalLocation"]["region"]
    assert (region["startLine"], region["endLine"]) == expected_lines(
        SCRIPTS / "bert_attention.py", "fused_softmax"
    )


def test_table_select_ignore_and_exit_code(bert_run):
    res = CliRunner().invoke(app, ["suggest", str(bert_run)])
    assert res.exit_code == 0
    assert "fused_softmax" in res.stdout and "opadvisor apply --rule fused_softmax" in res.stdout
    assert "rules need a CUDA profile to judge this run: " in res.stdout
    only = CliRunner().invoke(
        app, ["suggest", str(bert_run), "--select", "fused_dropout_add", "--format", "json"]
    )
    assert {f["rule"] for f in json.loads(only.stdout)["findings"]} == {"fused_dropout_add"}
    rest = CliRunner().invoke(
        app, ["suggest", str(bert_run), "--ignore", "fused_softmax,sdpa_attention", "--format", "json"]
    )
    assert {f["rule"] for f in json.loads(rest.stdout)["findings"]} == {"fused_dropout_add"}
    assert CliRunner().invoke(app, ["suggest", str(bert_run), "--exit-code"]).exit_code == 1
    clean = CliRunner().invoke(app, ["suggest", str(bert_run), "--exit-code", "--select", "gemm_align"])
    assert clean.exit_code == 0 and "No findings" in clean.stdout
    by_saving = CliRunner().invoke(app, ["suggest", str(bert_run), "--sort", "saving", "--format", "json"])
    assert by_saving.exit_code == 0


def one_line_error(res, text):
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("opadvisor: error:") and text in err, err
    assert "Traceback" not in res.output


def test_bad_input(bert_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_line_error(CliRunner().invoke(app, ["suggest"]), "no run yet")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(CliRunner().invoke(app, ["suggest", str(empty)]), "has no profile.json")
    broken = tmp_path / "broken"
    shutil.copytree(bert_run, broken)
    text = (broken / "profile.json").read_text()
    (broken / "profile.json").write_text(text[: len(text) // 2])
    one_line_error(CliRunner().invoke(app, ["suggest", str(broken)]), "corrupt or truncated")
    data = json.loads(text)
    data["schema"] = 99
    (broken / "profile.json").write_text(json.dumps(data))
    one_line_error(CliRunner().invoke(app, ["suggest", str(broken)]), "schema version 99")
    one_line_error(
        CliRunner().invoke(app, ["suggest", str(bert_run), "--select", "nope"]), "unknown rule 'nope'"
    )
    one_line_error(CliRunner().invoke(app, ["suggest", str(bert_run), "--format", "xml"]), "unknown format")
    one_line_error(CliRunner().invoke(app, ["explain", "nope"]), "unknown rule 'nope'")


def test_changed_source_is_said_per_finding(bert_run, tmp_path):
    changed = tmp_path / "changed"
    shutil.copytree(bert_run, changed)
    data = json.loads((changed / "profile.json").read_text())
    data["sources"] = {k: "0" * 64 for k in data["sources"]}
    (changed / "profile.json").write_text(json.dumps(data))
    res = CliRunner().invoke(app, ["suggest", str(changed), "--format", "json"])
    assert res.exit_code == 0
    assert "changed since it was profiled" in res.stderr and res.stderr.count("\n") == 1
    doc = json.loads(res.stdout)
    assert doc["findings"] and {f["source_status"] for f in doc["findings"]} == {"changed"}
    table = CliRunner().invoke(app, ["suggest", str(changed)])
    assert "(file changed)" in table.stdout


def test_rules_and_explain():
    res = CliRunner().invoke(app, ["rules"])
    assert res.exit_code == 0
    for rid in ["fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"]:
        assert rid in res.stdout
    for rid in ["fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"]:
        doc = CliRunner().invoke(app, ["explain", rid]).stdout
        for part in ("What it finds", "Why it is slow", "Example", "Fix and its safety"):
            assert part in doc, (rid, part)


def test_cwd_relative_paths(bert_run, monkeypatch):
    monkeypatch.chdir(Path(SCRIPTS))
    doc = json.loads(CliRunner().invoke(app, ["suggest", str(bert_run), "--format", "json"]).stdout)
    assert {f["path"] for f in doc["findings"]} == {"bert_attention.py"}


def test_cpu_profile_notes_fold_into_one_line(bert_run):
    res = CliRunner().invoke(app, ["suggest", str(bert_run)])
    assert res.exit_code == 0, res.output
    gpu = [ln for ln in res.stdout.splitlines() if "CUDA profile" in ln]
    assert len(gpu) == 1 and gpu[0].startswith("note: "), res.stdout
    doc = json.loads(CliRunner().invoke(app, ["suggest", str(bert_run), "--format", "json"]).stdout)
    folded = [n["rule"] for n in doc["notes"] if n["message"].startswith("needs a CUDA profile")]
    assert len(folded) > 1 and all(rule in gpu[0] for rule in folded)  # JSON keeps one note per rule
