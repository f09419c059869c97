"""zero_grad_set_to_none on real CPU profiles: found at the call with its measured time, not found at
the default, unsafe where a zeroed gradient got no new one; and the applied fix computes the same
losses, gradients and parameters. The codemod's before/after cases are golden fixtures in
tests/rewrite/fixtures/zero_grad_set_to_none/ (tests/rewrite/test_fixtures.py runs them)."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import torch
from cli_testlib import opadvisor
from rules_testlib import expected_lines

from opadvisor.profile.model import load_profile
from opadvisor.rules.optimizer import zero_grad_set_to_none as rule
from opadvisor.rules.optimizer.zero_grad_set_to_none import ZeroGradFacts

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _found(rules_profile, name: str, *args: str) -> list:
    run = rules_profile(name, SCRIPTS / f"{name}.py", *args)
    return rule.detect(load_profile(run / "profile.json"))


def test_found_at_the_call_with_its_measured_time(rules_profile) -> None:
    (finding,) = _found(rules_profile, "zero_grad_false")
    script = SCRIPTS / "zero_grad_false.py"
    assert (Path(finding.path), finding.line, finding.end_line) == (script, *expected_lines(script, rule.ID))
    assert finding.rule == rule.ID and finding.fix == "safe"
    assert finding.time_ms_per_step and finding.time_ms_per_step > 0
    assert finding.est_saving_ms_per_step == finding.time_ms_per_step
    assert set(finding.evidence.ops) == {"aten::zero_"} and finding.evidence.time_basis == "cpu"
    facts = ZeroGradFacts.from_details(finding.details)
    assert facts == ZeroGradFacts(call_line=finding.line, zeroed_per_step=8, without_gradient=0)


def test_found_where_foreach_zeroes_them_in_one_op(rules_profile) -> None:
    """foreach=True: one `_foreach_zero_` a step; on the CPU it records a `zero_` per tensor beneath it, so
    the gradients are counted and checked as without foreach."""
    (finding,) = _found(rules_profile, "zero_grad_false", "--foreach")
    assert finding.evidence.ops == ["aten::_foreach_zero_"] and finding.fix == "safe"
    facts = ZeroGradFacts.from_details(finding.details)
    assert facts == ZeroGradFacts(call_line=finding.line, zeroed_per_step=8, without_gradient=0)


def test_not_found_at_the_default(rules_profile) -> None:
    assert _found(rules_profile, "zero_grad_default") == []


def test_unsafe_where_a_zeroed_gradient_gets_no_new_one(rules_profile) -> None:
    (finding,) = _found(rules_profile, "zero_grad_stale_head")
    script = SCRIPTS / "zero_grad_stale_head.py"
    assert finding.line == expected_lines(script, rule.ID)[0]
    assert finding.fix == "unsafe"
    facts = ZeroGradFacts.from_details(finding.details)
    assert facts is not None and facts.zeroed_per_step == 4 and facts.without_gradient == 2  # the head's


def test_unsafe_where_the_loop_uses_grad_before_backward(rules_profile) -> None:
    (finding,) = _found(rules_profile, "zero_grad_reads_grad")
    script = SCRIPTS / "zero_grad_reads_grad.py"
    assert finding.fix == "unsafe"
    facts = ZeroGradFacts.from_details(finding.details)
    assert facts is not None and facts.without_gradient == 0
    assert facts.grad_used_line == expected_lines(script, "grad_use")[0]


def test_the_fix_computes_the_same_training(tmp_path: Path) -> None:
    """Profile, suggest, apply in a copy; the rewritten loop gives the same losses, gradients and
    parameters, bit for bit (a gradient accumulated into zeros is the gradient)."""
    script = tmp_path / "train.py"
    shutil.copy(SCRIPTS / "zero_grad_false.py", script)
    done = opadvisor(tmp_path, "profile", "train.py", "--steps", "2", "--warmup", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    applied = opadvisor(tmp_path, "apply", "--rule", rule.ID)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    line = expected_lines(SCRIPTS / "zero_grad_false.py", rule.ID)[0]
    assert script.read_text().splitlines()[line - 1].strip() == f"opt.zero_grad()  # expect: {rule.ID}"
    before = runpy.run_path(str(SCRIPTS / "zero_grad_false.py"))["train"](5)
    after = runpy.run_path(str(script))["train"](5)
    for old, new in zip(before, after, strict=True):
        assert len(old) == len(new) and all(torch.equal(a, b) for a, b in zip(old, new, strict=True))


def test_explain_prints_the_rules_docs(tmp_path: Path) -> None:
    done = opadvisor(tmp_path, "explain", rule.ID)
    assert done.returncode == 0 and "set_to_none=False" in done.stdout and "Fix and its safety" in done.stdout
