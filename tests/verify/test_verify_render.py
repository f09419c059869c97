"""What `opadvisor verify` prints about step times: the verdict, the per-rule table, --fail-slower."""

from __future__ import annotations

import random

from opadvisor.cli.verify import render
from opadvisor.verify.compare import Parity, compare_times, summarise_runs
from opadvisor.verify.core import RuleStepTime, Timing, VerifyReport


def runs(median: float, jitter: float, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    return [[median + rng.uniform(-jitter, jitter) for _ in range(8)] for _ in range(3)]


def report(before: list[list[float]], after: list[list[float]], *, fail_slower: bool = False, rules=None):
    difference = compare_times(before, after)
    timing = Timing(
        device="cuda",
        warmup=3,
        repeats=3,
        before=summarise_runs(before),
        after=summarise_runs(after),
        speedup=difference.speedup,
        difference=difference,
        rules=rules,
    )
    parity = Parity(ok=True, precision="bf16", rtol=2e-2, atol=1e-3, message="losses match")
    return VerifyReport(
        run="r", script="train.py", applied_rules=["a"], parity=parity, timing=timing, fail_slower=fail_slower
    )


def shown(capsys, rep) -> str:
    render(rep)
    return " ".join(capsys.readouterr().out.split())


def test_a_slowdown_is_said_plainly_and_fails_only_when_asked(capsys) -> None:
    rep = report(runs(4.65, 0.05, 1), runs(5.33, 0.05, 2))
    out = shown(capsys, rep)
    assert "the rewrite is SLOWER: 0.87x" in out and "4.65 -> 5.33 ms/step" in out
    assert rep.ok and rep.slower and "FAILED" not in out
    rep = report(runs(4.65, 0.05, 1), runs(5.33, 0.05, 2), fail_slower=True)
    assert not rep.ok
    assert "FAILED: the rewrite is slower than the original (--fail-slower)" in shown(capsys, rep)


def test_a_difference_within_the_spread_is_not_claimed(capsys) -> None:
    out = shown(capsys, report(runs(10.0, 2.0, 1), runs(9.95, 2.0, 2)))
    assert "no measurable difference" in out and "includes 1x" in out and "faster" not in out


def test_per_rule_rows_add_up_to_the_whole_step(capsys) -> None:
    p0, p1, p2 = runs(12.0, 0.1, 1), runs(10.0, 0.1, 2), runs(9.3, 0.1, 3)
    rows = [
        RuleStepTime(rule, summarise_runs(a), summarise_runs(b), compare_times(a, b))
        for rule, a, b in (("fused_softmax", p0, p1), ("fused_dropout_add", p1, p2))
    ]
    out = shown(capsys, report(p0, p2, rules=rows))
    assert "step time as each rule is added" in out and "the rewrite is faster" in out
    assert "fused_softmax" in out and "fused_dropout_add" in out and " all " in out
