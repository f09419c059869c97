"""What a new user meets first: `--version`, the help texts, and `opadvisor rules` telling each fix's safety."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import subprocess
import sys

from typer.testing import CliRunner

import opadvisor
from opadvisor.cli import app
from opadvisor.rules import registry

runner = CliRunner()


def test_version_without_importing_torch() -> None:
    code = (
        "import sys; from opadvisor.cli import main; sys.argv = ['opadvisor', '--version']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"opadvisor {opadvisor.__version__}\n"
    # one version: the package's metadata reads it from opadvisor.__version__
    assert importlib.metadata.version("opadvisor") == opadvisor.__version__


def test_apply_help_shows_each_example_on_its_own_line() -> None:
    result = runner.invoke(app, ["apply", "--help"], terminal_width=200)
    assert result.exit_code == 0
    lines = [ln.strip() for ln in result.output.splitlines()]
    for example in (
        "opadvisor apply --rule fused_softmax --diff",
        "opadvisor apply --rule all",
        "opadvisor apply --rule gemm_align model.py",
        "opadvisor apply --undo",
    ):
        assert example in lines, result.output


def test_top_level_help_lists_one_command_per_line() -> None:
    result = runner.invoke(app, ["--help"], terminal_width=200)
    lines = [ln.strip() for ln in result.output.splitlines()]
    assert "opadvisor suggest               findings ranked by measured time" in lines, result.output
    assert "--version  Print opadvisor's version and exit." in lines


def test_rules_lists_where_sdpa_attention_is_unsafe() -> None:
    result = runner.invoke(app, ["rules"])
    line = next(ln for ln in result.output.splitlines() if ln.startswith("sdpa_attention "))
    assert "[fix: safe; unsafe where masked rows are zeroed after softmax]" in line


def _fix_literals(source: str) -> set[str]:
    """Every string a rule module can give a finding as its `fix`: `fix=` arguments, `"fix":` entries of
    dicts and assignments to a name `fix` (conditional expressions included)."""
    values: list[ast.AST] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg == "fix":
            values.append(node.value)
        elif isinstance(node, ast.Dict):
            values += [
                v
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "fix"
            ]
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "fix" for t in node.targets
        ):
            values.append(node.value)
    return {
        c.value
        for v in values
        for c in ast.walk(v)
        if isinstance(c, ast.Constant) and c.value in ("safe", "unsafe", "none")
    }


def test_rules_name_every_fix_safety_their_findings_can_have() -> None:
    # `opadvisor rules` shows FIX and FIX_CAVEAT: a rule whose findings can carry another safety says where
    for mod in registry.all_rules():
        others = _fix_literals(inspect.getsource(mod)) - {mod.FIX}
        caveat = getattr(mod, "FIX_CAVEAT", "")
        for other in others:
            assert other in caveat, f"{mod.ID}: findings can be fix={other!r}, FIX_CAVEAT says {caveat!r}"
