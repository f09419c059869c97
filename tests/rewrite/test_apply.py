"""`opadvisor apply` through the real CLI: profile mode on hand-built findings (the rules are stubbed with
`analyse` returning them), static mode, backups and applied.json, undo, and every refusal (exit 2, one
line on stderr, the file untouched byte for byte)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.model import Profile, save_profile
from opadvisor.profile.runs import mark_latest
from opadvisor.rewrite import engine
from opadvisor.rules.attention import AttentionFacts
from opadvisor.rules.dropout_add.fused_dropout_add import DropoutAddFacts
from opadvisor.rules.finding import Finding
from opadvisor.rules.gemm.gemm_align import GemmAlignFacts

MODEL = b"""import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.proj = nn.Linear(hidden, hidden)
        self.out_dropout = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, 30522)

    def forward(self, q, k, v, x, mask):
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        probs = self.drop(probs)
        ctx = probs @ v
        x = x + self.out_dropout(self.proj(ctx))
        return self.head(x)
"""
SOFTMAX_LINES = (17, 20)
DROPOUT_ADD_LINE = 22
LINEAR_LINE = 14


def attention_findings(model: Path) -> list[Finding]:
    """MODEL's fused_softmax and fused_dropout_add findings, with the facts of a profile that saw their
    steps and told nothing more (the other fields at their defaults: the codemods read the source)."""
    softmax = AttentionFacts(ops=["scale", "mask", "softmax", "dropout"]).to_details()
    add = DropoutAddFacts(ops=["dropout", "residual"]).to_details()
    return [
        Finding(
            "fused_softmax", str(model), *SOFTMAX_LINES, "masked_fill -> softmax", "safe", details=softmax
        ),
        Finding(
            "fused_dropout_add", str(model), *[DROPOUT_ADD_LINE] * 2, "dropout + add", "safe", details=add
        ),
    ]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A project folder (the cwd) with model.py, a run whose profile hashed it, and stubbed findings."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.py"
    model.write_bytes(MODEL)
    run_dir = tmp_path / ".opadvisor" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    save_profile(
        Profile(run_id="r1", script=str(model), sources={str(model): sha(MODEL)}), run_dir / "profile.json"
    )
    mark_latest(run_dir)
    findings: list[Finding] = [
        *attention_findings(model),
        Finding(
            "gemm_align",
            str(model),
            LINEAR_LINE,
            LINEAR_LINE,
            "30522 not a multiple of 8",
            "safe",
            details=GemmAlignFacts(kind="linear", in_features=64, out_features=30522, pad_to=8).to_details(),
        ),
    ]

    def analyse(profiles, select=None, ignore=None, **_):
        from opadvisor.rules.engine import Report

        return Report([f for f in findings if select is None or f.rule in select], [], list(select or []))

    monkeypatch.setattr("opadvisor.rules.engine.analyse", analyse)
    return {"root": tmp_path, "model": model, "run": run_dir, "findings": findings}


def cli(*args: str):
    result = CliRunner().invoke(app, ["apply", *args])
    return result


def assert_refused(result, *, contains: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("opadvisor: error: ")
    assert contains in lines[0]
    assert result.stdout == ""


def applied(run_dir: Path) -> dict:
    return json.loads((run_dir / "applied.json").read_text())


# ---- profile mode ------------------------------------------------------------------------------------------
def test_apply_rewrites_backs_up_and_records(project):
    model: Path = project["model"]
    model.chmod(0o640)
    result = cli("--rule", "fused_softmax")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("--- a/model.py\n+++ b/model.py\n")
    assert "masked_softmax(" in model.read_text()
    assert stat.S_IMODE(model.stat().st_mode) == 0o640
    record = applied(project["run"])
    assert record["schema"] == 1
    (entry,) = record["applied"]
    assert entry["rule"] == "fused_softmax"
    assert entry["path"] == str(model)
    assert entry["backup"] == "backup/model.py"
    assert (project["run"] / entry["backup"]).read_bytes() == MODEL
    assert entry["sha256_before"] == sha(MODEL)
    assert entry["sha256_after"] == sha(model.read_bytes())
    assert entry["changes"] and entry["changes"][0]["line"] == SOFTMAX_LINES[0]
    assert "rewrote 1 file" in result.stderr
    # only the chain changed: every other line is byte-identical
    assert model.read_text().count("\n") < MODEL.decode().count("\n") + 10
    assert "x = x + self.out_dropout(self.proj(ctx))" in model.read_text()


def test_diff_and_check_write_nothing(project):
    model: Path = project["model"]
    result = cli("--rule", "fused_softmax", "--diff")
    assert result.exit_code == 0
    assert "+        probs = masked_softmax(" in result.stdout
    assert model.read_bytes() == MODEL
    assert not (project["run"] / "applied.json").exists()
    result = cli("--rule", "fused_softmax", "--check")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "would rewrite 1 file" in result.stderr
    assert model.read_bytes() == MODEL


def test_second_apply_keeps_first_backup_and_maps_lines(project):
    model: Path = project["model"]
    assert cli("--rule", "fused_softmax").exit_code == 0
    after_first = model.read_bytes()
    # the file now differs from the profiled one, but it is what apply wrote: accepted, lines mapped
    result = cli("--rule", "fused_dropout_add")
    assert result.exit_code == 0, result.stderr
    assert "bias_dropout_add(" in model.read_text()
    first, second = applied(project["run"])["applied"]
    assert first["backup"] == second["backup"] == "backup/model.py"
    assert (project["run"] / "backup" / "model.py").read_bytes() == MODEL
    assert second["sha256_before"] == first["sha256_after"] == sha(after_first)
    assert second["sha256_after"] == sha(model.read_bytes())
    # nothing left to do: --check passes
    assert cli("--rule", "fused_softmax", "--check").exit_code == 0


def test_rule_all_applies_each_rule_once(project):
    model: Path = project["model"]
    result = cli("--rule", "all")
    assert result.exit_code == 0, result.stderr
    text = model.read_text()
    assert "masked_softmax(" in text and "bias_dropout_add(" in text and "PaddedLinear(hidden, 30522)" in text
    assert text.count("from opadvisor.kernels import") == 1
    rules = [e["rule"] for e in applied(project["run"])["applied"]]
    assert rules == ["fused_softmax", "fused_dropout_add", "gemm_align"]
    assert "30528" in result.stderr  # the display-only note about the literal size
    # each entry keeps the file as its rule left it (verify rebuilds the program one rule at a time)
    entries = applied(project["run"])["applied"]
    for i, entry in enumerate(entries):
        assert entry["after"] == f"snapshots/{i}/model.py"
        assert sha((project["run"] / entry["after"]).read_bytes()) == entry["sha256_after"]
    assert (project["run"] / entries[-1]["after"]).read_bytes() == model.read_bytes()


def test_rule_all_names_held_back_unsafe_rules_only_when_they_found_something(project):
    # the stubbed run has safe findings only: no line about the unsafe fixes it holds back
    result = cli("--rule", "all", "--diff")
    assert result.exit_code == 0, result.stderr
    assert "unsafe" not in result.stderr, result.stderr
    # an fp32_gemm finding (an unsafe fix) is named once, and its file is left alone
    project["findings"].append(
        Finding("fp32_gemm", str(project["model"]), LINEAR_LINE, LINEAR_LINE, "fp32 matmul", "unsafe")
    )
    result = cli("--rule", "all", "--diff")
    assert result.exit_code == 0, result.stderr
    unsafe = [ln for ln in result.stderr.splitlines() if "unsafe" in ln]
    assert unsafe == ["fp32_gemm: not applied: its fix is marked unsafe; pass --unsafe to apply it too"]


def test_rule_all_static_mode_names_only_unsafe_rules_that_would_rewrite(project):
    def held_back(file: str) -> list[str]:
        result = cli("--rule", "all", "--diff", file)
        assert result.exit_code == 0, result.stderr
        return [ln.split(":")[0] for ln in result.stderr.splitlines() if "marked unsafe" in ln]

    # fp32_gemm's static fix (process-wide TF32 flags) rewrites any file; the other two need a match
    (project["root"] / "plain.py").write_text("x = 1\n")
    assert held_back("plain.py") == ["fp32_gemm"]
    (project["root"] / "loader.py").write_text(
        "import torch\n\ndata = torch.arange(8)\nloader = torch.utils.data.DataLoader(data, batch_size=2)\n"
    )
    assert sorted(held_back("loader.py")) == ["dataloader_stall", "fp32_gemm"]


def test_undo_restores_byte_exact(project):
    model: Path = project["model"]
    assert cli("--rule", "all").exit_code == 0
    result = cli("--undo")
    assert result.exit_code == 0, result.stderr
    assert model.read_bytes() == MODEL
    assert "restored model.py (undid fused_softmax, fused_dropout_add, gemm_align)" in result.stderr
    assert applied(project["run"])["applied"] == []
    assert not (project["run"] / "backup" / "model.py").exists()
    assert not [p for p in (project["run"] / "snapshots").rglob("*") if p.is_file()]
    assert_refused(cli("--undo"), contains="nothing to undo")


def test_undo_refuses_a_file_edited_since(project):
    model: Path = project["model"]
    assert cli("--rule", "fused_softmax").exit_code == 0
    edited = model.read_bytes() + b"# my edit\n"
    model.write_bytes(edited)
    assert_refused(cli("--undo"), contains="edited after apply")
    assert model.read_bytes() == edited
    assert cli("--undo", "--force").exit_code == 0
    assert model.read_bytes() == MODEL


def test_unmatched_finding_is_reported(project):
    softmax = attention_findings(project["model"])[0]
    project["findings"].append(replace(softmax, line=3, end_line=4, message="elsewhere"))
    result = cli("--rule", "fused_softmax")
    assert result.exit_code == 0
    # named by its lines as profiled, with the verdict suggest shows (the dry run's, issue 30)
    assert (
        "model.py:3-4: fused_softmax: not applied: no automatic fix here: the fused_softmax rewrite found no "
        "code it can rewrite here" in result.stderr
    )


def test_skipped_site_says_why(project):
    model: Path = project["model"]
    model.write_bytes(
        MODEL.replace(b"        return self.head(x)\n", b"        return self.head(x), scores\n")
    )
    project["run"].joinpath("profile.json").unlink()
    save_profile(
        Profile(run_id="r1", script=str(model), sources={str(model): sha(model.read_bytes())}),
        project["run"] / "profile.json",
    )
    result = cli("--rule", "fused_softmax")
    assert result.exit_code == 0
    # the longest part that is safe is fused, and the message says why the rest is not
    assert (
        "model.py:17-20: fused_softmax: softmax -> dropout -> opadvisor.kernels.masked_softmax "
        "(the rest stays separate: `scores` is read again at line 23" in result.stderr
    )
    # with nothing safe left, the site is skipped with the reason
    source = MODEL.replace(b"self.head(x)\n", b"self.head(x), scores\n").replace(
        b"        probs = self.drop(probs)\n", b""
    )
    project["model"].write_bytes(source)
    result = cli("--rule", "fused_softmax", "model.py")
    assert (
        "model.py:17: fused_softmax: not applied: not fused: `scores` is read again at line 22"
        in result.stderr
    )
    assert "nothing to rewrite" in result.stderr
    assert project["model"].read_bytes() == source


def test_rule_without_findings_says_so(project):
    result = cli("--rule", "sparse_launch", "--unsafe")
    assert result.exit_code == 0
    assert "sparse_launch: no findings in this run, so nothing to fix" in result.stderr
    assert "nothing to rewrite" in result.stderr
    assert project["model"].read_bytes() == MODEL


# ---- refusals -------------------------------------------------------------------------------------------------
def test_refuses_stale_hash_unless_forced(project):
    model: Path = project["model"]
    edited = MODEL + b"# edited after the profile\n"
    model.write_bytes(edited)
    assert_refused(cli("--rule", "fused_softmax"), contains="changed since it was profiled")
    assert model.read_bytes() == edited
    # --force places the findings through the source as profiled, which this run does not keep: refused
    result = cli("--rule", "fused_softmax", "--force")
    assert "keeps no copy of it as profiled" in result.stderr and model.read_bytes() == edited
    # a run that keeps it (sources/<sha256>, as `opadvisor profile` writes): the site is found and rewritten
    (project["run"] / "sources").mkdir()
    (project["run"] / "sources" / sha(MODEL)).write_bytes(MODEL)
    result = cli("--rule", "fused_softmax", "--force")
    assert result.exit_code == 0
    assert "masked_softmax(" in model.read_text() and model.read_text().endswith(
        "# edited after the profile\n"
    )


def test_refuses_file_outside_project(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "other.py"
    outside.write_bytes(MODEL)
    project["findings"][:] = [attention_findings(outside)[0]]
    assert_refused(cli("--rule", "fused_softmax"), contains="outside the project")
    assert outside.read_bytes() == MODEL
    # static mode too
    assert_refused(cli("--rule", "fused_softmax", str(outside)), contains="outside the project")
    assert outside.read_bytes() == MODEL


def test_refuses_site_packages(project):
    installed = project["root"] / "venv" / "lib" / "python3.12" / "site-packages" / "lib.py"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(MODEL)
    assert_refused(cli("--rule", "fused_softmax", str(installed)), contains="site-packages")
    assert installed.read_bytes() == MODEL


def test_a_project_in_a_folder_named_site_packages_is_the_users(tmp_path):
    # only the folders below the project count: a checkout cloned into `site-packages` is rewritten, a venv
    # inside it is not
    from opadvisor.rewrite.engine import location_problem

    root = tmp_path / "site-packages" / "my dist-packages checkout"
    assert location_problem(root / "src" / "train.py", root) is None
    assert "inside site-packages" in location_problem(root / ".venv" / "site-packages" / "lib.py", root)
    assert "outside the project" in location_problem(tmp_path / "train.py", root)


def test_refuses_unparsable_file(project):
    broken = project["root"] / "broken.py"
    data = b"def f(:\n    return F.softmax(x.masked_fill(m, 0), -1)\n"
    broken.write_bytes(data)
    assert_refused(cli("--rule", "fused_softmax", "broken.py"), contains="cannot parse")
    assert broken.read_bytes() == data
    assert not (project["root"] / ".opadvisor" / "static").exists()


def test_refuses_unsafe_without_flag(project, monkeypatch):
    model: Path = project["model"]
    for f in project["findings"]:
        f.fix = "unsafe"
    assert_refused(cli("--rule", "fused_softmax"), contains="pass --unsafe")
    assert model.read_bytes() == MODEL
    assert cli("--rule", "fused_softmax", "--unsafe").exit_code == 0
    # a codemod whose fix is unsafe as a whole, in static mode
    from opadvisor.rules.dropout_add.fused_dropout_add_fix import FusedDropoutAddCodemod

    monkeypatch.setattr(FusedDropoutAddCodemod, "SAFETY", "unsafe")
    before = model.read_bytes()
    assert_refused(cli("--rule", "fused_dropout_add", "model.py"), contains="pass --unsafe")
    assert model.read_bytes() == before


def test_refuses_unknown_rule(project):
    assert_refused(cli("--rule", "no_such_rule"), contains="unknown rule 'no_such_rule'")
    assert_refused(cli("--rule", "no_such_rule", "model.py"), contains="unknown rule")
    assert_refused(cli("--rule", "host_sync"), contains="has no automatic fix")
    for module in ("engine", "check", "base"):  # modules of opadvisor.rewrite that are no rules
        assert_refused(cli("--rule", module, "model.py"), contains=f"unknown rule '{module}'")
    assert project["model"].read_bytes() == MODEL


def test_refuses_read_only_file(project):
    model: Path = project["model"]
    model.chmod(0o444)
    try:
        assert_refused(cli("--rule", "fused_softmax"), contains="read-only")
        assert_refused(cli("--rule", "fused_softmax", "model.py"), contains="read-only")
        assert model.read_bytes() == MODEL
    finally:
        model.chmod(0o644)


def test_refuses_missing_rule_and_mixed_arguments(project):
    assert_refused(cli(), contains="missing --rule")
    assert_refused(cli("--rule", "fused_softmax", "r1", "model.py"), contains="not both")


def test_refusal_writes_no_other_file_either(project):
    """All or nothing: one refused file stops the apply before anything is written."""
    good = project["root"] / "good.py"
    good.write_bytes(MODEL)
    bad = project["root"] / "bad.py"
    bad.write_bytes(b"x = (\n")
    assert_refused(cli("--rule", "fused_softmax", "good.py", "bad.py"), contains="cannot parse")
    assert good.read_bytes() == MODEL


# ---- static mode ----------------------------------------------------------------------------------------------
def test_static_mode_backups_and_undo(project):
    model: Path = project["model"]
    result = cli("--rule", "fused_softmax", "model.py")
    assert result.exit_code == 0, result.stderr
    static = project["root"] / ".opadvisor" / "static"
    (entry,) = applied(static)["applied"]
    assert (static / entry["backup"]).read_bytes() == MODEL
    assert "backups in .opadvisor/static/backup" in result.stderr
    result = cli("--undo", "model.py")
    assert result.exit_code == 0
    assert model.read_bytes() == MODEL


def test_static_mode_keeps_windows_line_endings(project):
    crlf = project["root"] / "win.py"
    data = MODEL.replace(b"\n", b"\r\n")
    crlf.write_bytes(data)
    assert cli("--rule", "all", "win.py").exit_code == 0
    out = crlf.read_bytes()
    assert out != data
    assert b"\n" not in out.replace(b"\r\n", b"")


def test_undo_picks_the_most_recent_state(project):
    model: Path = project["model"]
    other = project["root"] / "other.py"
    other.write_bytes(MODEL)
    assert cli("--rule", "fused_softmax").exit_code == 0  # run r1
    os.utime(project["run"] / "applied.json", (1, 1))
    assert cli("--rule", "fused_softmax", "other.py").exit_code == 0  # static, newer
    result = cli("--undo")
    assert "restored other.py" in result.stderr
    assert other.read_bytes() == MODEL and model.read_bytes() != MODEL
    result = cli("--undo")
    assert "restored model.py" in result.stderr
    assert model.read_bytes() == MODEL


# ---- engine pieces --------------------------------------------------------------------------------------------
def test_line_map():
    old = b"a\nb\nc\nd\ne\n"
    new = b"x\na\nb\nC1\nC2\nd\ne\n"
    lm = engine.LineMap(old, new)
    assert lm.map(1, 2) == (2, 3, False)
    assert lm.map(3, 3) == (4, 5, True)
    assert lm.map(4, 5) == (6, 7, False)


def test_unstable_codemod_writes_nothing(project, monkeypatch):
    import libcst as cst

    from opadvisor.rewrite.base import RuleCodemod

    class Grows(RuleCodemod):
        RULE = "grows"

        def leave_Integer(self, original, updated):
            self.record_change(original, "grow")
            return cst.Integer(str(int(updated.value) + 1))

    monkeypatch.setattr(engine.registry, "get_codemod", lambda rule: Grows)
    with pytest.raises(engine.UserError, match="not stable"):
        engine.rewrite_source(b"x = 1\n", "grows")
