"""Issue 30 item 5: verify's timing phase on a busy or small machine, with a synthetic noisy timer.

The timing children are replaced by a fake that reports step ends drawn from a seeded random timer: no
real time is measured or asserted. What is checked: rounds stop early once the interval is tight, once
the noise makes it hopeless, or past the time budget; a noisy machine gets "timing inconclusive on this
machine: N% noise" and no ratio; the noise counts the plain step `profile` measured against verify's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from opadvisor.cli.verify import verdict_words
from opadvisor.verify import core
from opadvisor.verify.compare import FASTER, INCONCLUSIVE, SAME
from opadvisor.verify.core import VerifyOptions
from opadvisor.verify.runner import ChildResult

ORIGINAL = {"train.py": "original source"}  # the original program's sources; the rewrite runs with {}


@dataclass
class OneRule:
    """What `timing_programs` reads of an apply: one rule, so the programs are original and rewrite."""

    rules: list[str] = field(default_factory=lambda: ["fused_softmax"])

    def sources(self) -> dict[str, str]:
        return dict(ORIGINAL)


class NoisyTimer:
    """Fake timing children: each step lasts `ms` of its program times a random factor exp(N(0, sigma))."""

    def __init__(self, original_ms: float, rewrite_ms: float, sigma: float, steps: int = 10) -> None:
        self.ms = {"original": original_ms, "rewrite": rewrite_ms}
        self.sigma, self.steps, self.runs = sigma, steps, 0
        self.rng = random.Random(0)

    def __call__(self, sources: dict[str, str], timeout: float | None = None) -> ChildResult:
        self.runs += 1
        ms = self.ms["original" if sources else "rewrite"]
        end, steps = 0.0, []
        for _ in range(self.steps + 1):  # the first step is the warm-up (dropped)
            end += ms * self.rng.lognormvariate(0.0, self.sigma) / 1000.0
            steps.append({"end_s": end})
        return ChildResult(0, {"steps": steps}, "")


def timed(monkeypatch, timer: NoisyTimer, repeats: int, **kwargs):
    monkeypatch.setattr(core, "run_child", timer)
    opts = VerifyOptions(steps=timer.steps, warmup=1, repeats=repeats)
    timing, _ = core._timing(lambda mode, sources: sources, OneRule(), opts, lambda m: None, "cpu", **kwargs)
    return timing


def test_a_noisy_machine_is_called_inconclusive_and_timing_stops_early(monkeypatch) -> None:
    timer = NoisyTimer(10.0, 9.0, sigma=0.8)  # steps vary several-fold from one to the next
    timing = timed(monkeypatch, timer, repeats=6)
    d = timing.difference
    assert d.verdict == INCONCLUSIVE and d.noise is not None and d.noise >= 0.25
    words = verdict_words(d)
    assert words.startswith(f"timing inconclusive on this machine: {d.noise:.0%} noise")
    assert "interval" not in words and "x (" not in words  # no ratio with an interval spanning the noise
    assert timing.repeats < 6 and timer.runs == 2 * timing.repeats
    assert "more runs would not settle it" in timing.stopped
    assert core._timing_dict(timing)["verdict"] == INCONCLUSIVE


def test_a_quiet_machine_stops_once_the_interval_is_tight(monkeypatch) -> None:
    timer = NoisyTimer(10.0, 8.0, sigma=0.005)
    timing = timed(monkeypatch, timer, repeats=6)
    assert timing.difference.verdict == FASTER and timing.difference.noise < 0.05
    assert timing.repeats == 2 and "the interval is tight" in timing.stopped
    assert "faster" in verdict_words(timing.difference)


def test_the_plain_step_profile_measured_counts_as_noise(monkeypatch) -> None:
    # steady steps here, but 5.6x the plain step `profile` measured (15 ms there, 84 ms here): the machine
    # changed under the measurement, so a "no measurable difference" says nothing
    timer = NoisyTimer(84.0, 84.0, sigma=0.01)
    timing = timed(monkeypatch, timer, repeats=3, plain_ms=15.0)
    assert timing.difference.noise == pytest.approx(84.0 / 15.0 - 1.0, rel=0.05)
    assert timing.difference.verdict == INCONCLUSIVE
    # the same runs without that plain step: steady, and no difference to find
    timer = NoisyTimer(84.0, 84.0, sigma=0.01)
    assert timed(monkeypatch, timer, repeats=3).difference.verdict == SAME


def test_the_time_budget_keeps_timing_in_proportion(monkeypatch) -> None:
    timer = NoisyTimer(10.0, 9.5, sigma=0.1)
    timing = timed(monkeypatch, timer, repeats=5, budget_s=0.0)
    assert timing.repeats == 1 and timer.runs == 2
    assert "to keep verify in proportion" in timing.stopped


def test_quick_is_parity_only() -> None:
    from typer.testing import CliRunner

    from opadvisor.cli import app

    result = CliRunner().invoke(app, ["verify", "--help"])
    assert "--quick" in result.output and "Parity only" in result.output
