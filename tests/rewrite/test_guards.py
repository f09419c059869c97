"""Guards that need the profile's facts (the source alone cannot tell), and `suggest` / `apply` offering and
applying only fixes the rewrite can make: real CPU profiles of small modules, through the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from profiled_run import profile_module
from typer.testing import CliRunner

from opadvisor.cli import app

ATTENTION = textwrap.dedent(
    """\
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v, mask, temperature):
            scores = q @ k.transpose(-1, -2)
            scores = scores * temperature
            scores = scores + mask
            probs = F.softmax(scores, dim=-1)
            probs = self.drop(probs)
            return probs @ v


    def make_inputs():
        q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
        return Attention(), (q, k, v, MASK, TEMPERATURE)
    """
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def suggest(rule: str) -> list[dict]:
    result = cli("suggest", "--format", "json", "--select", rule)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)["findings"]


def attention(mask: str, temperature: str) -> str:
    return ATTENTION.replace("MASK", mask).replace("TEMPERATURE", temperature)


def test_a_tensor_temperature_is_not_passed_as_a_number(project: Path):
    """A learnable temperature given as an argument: only the profile shows it is a tensor (with a gradient)."""
    source = attention("torch.zeros(2, 1, 1, 6)", "torch.tensor(0.5, requires_grad=True)")
    profile_module(project, "model.py", source)
    [sdpa] = suggest("sdpa_attention")
    assert sdpa["fix"] == "none" and sdpa["apply"] is None
    assert "the scale `temperature` is a [] float32 tensor" in sdpa["fix_blocked"]
    [fused] = suggest("fused_softmax")
    assert fused["details"]["scale"]["kind"] == "tensor"
    result = cli("apply", "--rule", "fused_softmax", "--diff")
    assert result.exit_code == 0, result.stderr
    assert "scale=" not in result.stdout  # the temperature stays in the graph, outside the fused call
    assert "+        probs = masked_softmax(scores, mask, dropout_p=self.drop.p" in result.stdout


def test_a_python_number_temperature_is_folded(project: Path):
    profile_module(project, "model.py", attention("torch.zeros(2, 1, 1, 6)", "0.5"))
    [sdpa] = suggest("sdpa_attention")
    assert sdpa["fix"] == "safe" and sdpa["details"]["scale"]["kind"] == "number"
    result = cli("apply", "--rule", "sdpa_attention", "--diff")
    assert "scale=temperature" in result.stdout


def test_a_bool_mask_added_is_not_taken_for_a_masked_fill(project: Path):
    """`scores + mask` with a bool mask adds 1.0 where it is True; a fused call would mask those scores out."""
    profile_module(project, "model.py", attention("torch.rand(2, 1, 1, 6) > 0.5", "0.5"))
    [fused] = suggest("fused_softmax")
    assert fused["details"]["mask"]["dtype"] == "bool" and fused["details"]["mask_kind"] == "additive"
    result = cli("apply", "--rule", "fused_softmax", "--diff")
    assert "masked_softmax(scores, dropout_p" in result.stdout  # the add stays; softmax and dropout fuse
    [sdpa] = suggest("sdpa_attention")
    assert sdpa["fix"] == "none" and "is bool and added to the scores" in sdpa["fix_blocked"]


FINITE_FILL = textwrap.dedent(
    """\
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v, mask):
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            scores = scores.masked_fill(mask == 0, -1e9)
            probs = F.softmax(scores, dim=-1)
            probs = self.drop(probs)
            return torch.matmul(probs, v)


    def make_inputs():
        q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
        return Attention(), (q, k, v, (torch.rand(2, 1, 1, 6) > 0.3).long())
    """
)


def test_when_the_bigger_win_cannot_be_applied_the_alternative_is(project: Path):
    """The annotated transformer's -1e9 fill: SDPA would give zeros where the original averages a fully masked
    row, so sdpa_attention refuses; suggest ranks fused_softmax first and `apply --rule all` applies it."""
    profile_module(project, "model.py", FINITE_FILL)
    result = cli("suggest", "--format", "json", "--select", "fused_softmax,sdpa_attention")
    findings = json.loads(result.stdout)["findings"]
    assert [f["rule"] for f in findings] == ["fused_softmax", "sdpa_attention"]
    fused, sdpa = findings
    assert fused["fix"] == "safe" and fused["apply"] == "opadvisor apply --rule fused_softmax"
    assert sdpa["fix"] == "none" and "with the finite fill `-1e9`" in sdpa["fix_blocked"]
    table = cli("suggest", "--select", "fused_softmax,sdpa_attention")
    assert "no automatic fix here: with the finite fill" in table.stdout
    applied = cli("apply", "--rule", "all")
    assert applied.exit_code == 0, applied.stderr
    assert (
        "fused_softmax: scale -> masked_fill -> softmax -> dropout -> opadvisor.kernels.masked_softmax"
        in applied.stderr
    )
    assert "sdpa_attention: not applied: no automatic fix here: with the finite fill" in applied.stderr
    assert "masked_softmax(" in (project / "model.py").read_text()


def test_a_rule_that_crashes_is_reported_by_apply(project: Path, monkeypatch: pytest.MonkeyPatch):
    profile_module(project, "model.py", FINITE_FILL)
    from opadvisor.rules.attention import fused_softmax

    def broken(profile):
        raise KeyError("softmax")

    monkeypatch.setattr(fused_softmax, "detect", broken)
    result = cli("apply", "--rule", "fused_softmax")
    assert result.exit_code == 2
    assert "the fused_softmax rule crashed on this profile" in result.stderr and "KeyError" in result.stderr
    result = cli("apply", "--rule", "all", "--diff")
    assert result.exit_code == 0, result.stderr
    assert "fused_softmax: error: the rule crashed on this profile" in result.stderr
