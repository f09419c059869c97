"""Issue 30 item 2: one finding has one identity (rule, file, lines as profiled) and one fix verdict in
every command and format: suggest's table, JSON and SARIF, the HTML report and apply's messages.

The examples are profiled on CPU (small sizes), as a user would, then every format is read back."""

from __future__ import annotations

import html
import json
import os
import re

import pytest
from typer.testing import CliRunner

from opadvisor.cli import app

EXAMPLES = ["bert_train.py", "lstm_train.py"]
# deberta_train.py passes too, but costs minutes of the suite's 10 on 2 cores
# apply's lines name a finding: "path:LINES: rule: ..."
APPLY_LINE = re.compile(r"^(?P<where>\S+:\d+(?:-\d+)?): (?P<rule>\w+): (?P<rest>.*)$")


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=EXAMPLES)
def outputs(request, example_project, tmp_path_factory) -> dict:
    """One example profiled on the CPU (the run tests/conftest.py makes once, copied); what suggest (3
    formats), report and apply say of it."""
    script = request.param
    cwd = example_project(script, tmp_path_factory.mktemp(script.removesuffix(".py")) / "project")
    old = os.getcwd()
    os.chdir(cwd)
    try:
        runner = CliRunner()
        out = {f: runner.invoke(app, ["suggest", "--format", f]) for f in ("table", "json", "sarif")}
        out["report"] = runner.invoke(app, ["report", "-o", "report.html"])
        out["apply"] = runner.invoke(app, ["apply", "--rule", "all", "--unsafe", "--diff"])
    finally:
        os.chdir(old)
    for name, result in out.items():
        assert result.exit_code == 0, (name, result.output)
    return {
        # the table's cells folded over lines: its box rules out, its whitespace as one space
        "table": " ".join(out["table"].stdout.replace("│", " ").split()),
        "json": json.loads(out["json"].stdout),
        "sarif": json.loads(out["sarif"].stdout),
        "report": (cwd / "report.html").read_text(),
        "apply": out["apply"].stderr.splitlines(),
    }


def identity(f: dict) -> str:
    lines = f"{f['line']}-{f['end_line']}" if f["end_line"] != f["line"] else str(f["line"])
    return f"{f['path']}:{lines}"


def verdict(f: dict) -> str:
    if f["fix_blocked"]:
        return f"no automatic fix here: {f['fix_blocked']}"
    return "no automatic fix" if f["fix"] == "none" else f["fix"]


def test_every_format_and_apply_name_each_finding_alike(outputs: dict) -> None:
    """One test per example (a module fixture split across xdist workers would profile it on each)."""
    _formats_agree(outputs)
    _apply_agrees(outputs)


def _formats_agree(outputs: dict) -> None:
    findings = outputs["json"]["findings"]
    results = outputs["sarif"]["runs"][0]["results"]
    assert [r["ruleId"] for r in results] == [f["rule"] for f in findings]
    for f, r in zip(findings, results, strict=True):
        region = r["locations"][0]["physicalLocation"]["region"]
        assert (region["startLine"], region["endLine"]) == (f["line"], f["end_line"])
        assert r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith(f["path"])
        assert (r["properties"]["fix"], r["properties"]["fix_blocked"]) == (f["fix"], f["fix_blocked"])
        row = outputs["table"].split(identity(f), 1)  # the table names the lines, then the rule below
        assert len(row) == 2 and f["rule"] in row[1][:400], (identity(f), outputs["table"])
        assert f"{f['rule']}</code> at {html.escape(identity(f))}</h3>" in outputs["report"]
        if f["fix_blocked"]:
            assert html.escape(verdict(f), quote=True) in outputs["report"]
            assert verdict(f) in outputs["table"]


def _apply_agrees(outputs: dict) -> None:
    """apply speaks of the same findings, by the same lines, with the same verdicts."""
    findings = {(identity(f), f["rule"]): f for f in outputs["json"]["findings"]}
    said: dict[tuple[str, str], list[str]] = {}
    for line in outputs["apply"]:
        m = APPLY_LINE.match(line)
        if m:
            said.setdefault((m["where"], m["rule"]), []).append(m["rest"])
    # every line apply writes about a site names a finding of suggest's, by its lines as profiled and a
    # rule `opadvisor rules` lists (never a codemod's own name such as library_patch)
    assert set(said) <= set(findings), (set(said) - set(findings), findings.keys())
    for key, f in findings.items():
        if f["fix"] == "none" and not f["fix_blocked"]:
            continue  # display-only advice: apply has nothing to do there
        assert key in said, (key, outputs["apply"])
        words = " ".join(said[key])
        if f["fix_blocked"]:
            assert f"not applied: {verdict(f)}" in words
        elif "not applied" in words:  # an applicable fix left for its alternative, which apply names
            assert "is the bigger win" in words or "already rewritten by" in words, words
