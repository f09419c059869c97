"""Loss parity and step-time statistics on hand-made harness results (no processes)."""

from __future__ import annotations

import math

import pytest

from opadvisor.verify.compare import (
    FASTER,
    SAME,
    SLOWER,
    compare_parity,
    compare_times,
    quantile,
    speedup,
    step_times,
)


def result(*losses: float | list[float], precision: str = "fp32", grad_norm: float | None = 1.0) -> dict:
    steps = [
        {"index": i + 1, "losses": x if isinstance(x, list) else [x], "end_s": float(i)}
        for i, x in enumerate(losses)
    ]
    return {"steps": steps, "precision": precision, "grad_norm": grad_norm}


def test_equal_losses_pass() -> None:
    p = compare_parity(result(2.0, 1.5, 1.2), result(2.0, 1.5, 1.2), steps=3)
    assert p.ok and p.first_bad_step is None and len(p.steps) == 3
    assert "3 steps" in p.message


def test_fp32_tolerance_is_tight_and_names_the_first_bad_step() -> None:
    assert compare_parity(result(10.0, 9.0), result(10.0005, 9.0), steps=2).ok  # 5e-5 relative
    p = compare_parity(result(10.0, 9.0, 8.0), result(10.0, 9.01, 8.5), steps=3)
    assert not p.ok and p.first_bad_step == 2
    assert "step 2" in p.message and "9.000000" in p.message and "9.010000" in p.message


def test_bf16_tolerance_is_looser() -> None:
    before, after = result(10.0, precision="bf16"), result(10.1, precision="fp32")
    p = compare_parity(before, after, steps=1)
    assert p.precision == "bf16" and p.ok
    assert not compare_parity(result(10.0), result(10.1), steps=1).ok


def test_explicit_tolerance_overrides() -> None:
    assert compare_parity(result(10.0), result(10.1), steps=1, rtol=0.05).ok
    assert not compare_parity(result(10.0, precision="bf16"), result(10.1), steps=1, rtol=1e-6, atol=0).ok


def test_nan_matches_only_nan() -> None:
    assert compare_parity(result(math.nan), result(math.nan), steps=1).ok
    p = compare_parity(result(1.0), result(math.nan), steps=1)
    assert not p.ok and p.first_bad_step == 1


def test_missing_steps_and_backward_counts_fail() -> None:
    p = compare_parity(result(1.0, 1.0, 1.0), result(1.0), steps=3)
    assert not p.ok and p.first_bad_step == 2 and "rewrite stopped" in p.message
    p = compare_parity(result([1.0, 2.0]), result([1.0]), steps=1)
    assert not p.ok and "backward" in p.message
    p = compare_parity(result([1.0, 2.0]), result([1.0, 2.5]), steps=1)  # every backward is compared
    assert not p.ok


def test_gradient_norm_is_compared() -> None:
    p = compare_parity(result(1.0, grad_norm=3.0), result(1.0, grad_norm=3.1), steps=1)
    assert not p.ok and p.grad_norm_ok is False and "gradient norm" in p.message
    assert compare_parity(result(1.0, grad_norm=3.0), result(1.0, grad_norm=3.001), steps=1).ok


def test_no_steps_is_a_failure() -> None:
    p = compare_parity(result(), result(), steps=3)
    assert not p.ok and "optimizer.step()" in p.message


def test_step_times_drop_warmup() -> None:
    ends = [0.0, 1.0, 1.1, 1.2, 1.4, 1.5]  # step 1 ends at 0.0: it has no duration
    res = {"steps": [{"index": i + 1, "losses": [], "end_s": e} for i, e in enumerate(ends)]}
    st = step_times(res, warmup=2)
    assert st is not None and st.n == 4  # steps 3..6
    assert st.times_ms == pytest.approx([100.0, 100.0, 200.0, 100.0])
    assert st.median_ms == pytest.approx(100.0)
    assert step_times(res, warmup=6) is None
    assert step_times(res, warmup=0).n == 5


def test_quantile_and_speedup() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([5.0], 0.25) == 5.0
    res_b = {"steps": [{"end_s": i * 0.2} for i in range(6)]}
    res_a = {"steps": [{"end_s": i * 0.1} for i in range(6)]}
    s = speedup(step_times(res_b, 1), step_times(res_a, 1))
    assert s.factor == pytest.approx(2.0) and s.low == pytest.approx(2.0) and s.high == pytest.approx(2.0)


def _runs(medians: list[float], jitter: float, steps: int = 10, seed: int = 1) -> list[list[float]]:
    """Step times of timing runs around the given medians, with uniform noise of +-jitter."""
    import random

    rng = random.Random(seed)
    return [[m + rng.uniform(-jitter, jitter) for _ in range(steps)] for m in medians]


def test_a_clear_speedup_is_faster_with_an_interval_around_it() -> None:
    d = compare_times(_runs([10.0, 10.2, 9.9], 0.3), _runs([7.0, 7.1, 6.9], 0.3, seed=2))
    assert d.verdict == FASTER and d.measurable
    assert d.saved_low_ms > 0 and d.saved_low_ms <= d.saved_ms <= d.saved_high_ms
    assert d.speedup.low <= d.speedup.factor <= d.speedup.high and d.speedup.low > 1
    assert d.saved_ms == pytest.approx(d.before_ms - d.after_ms)


def test_a_slowdown_is_slower() -> None:
    d = compare_times(_runs([4.65, 4.6, 4.7], 0.1), _runs([5.33, 5.3, 5.4], 0.1, seed=2))
    assert d.verdict == SLOWER and d.saved_high_ms < 0 and d.speedup.high < 1


def test_a_difference_within_the_spread_is_no_measurable_difference() -> None:
    # the medians differ by 1% while steps vary by +-20% and runs by 5%
    d = compare_times(_runs([10.0, 10.5, 9.5], 2.0), _runs([9.9, 10.4, 9.6], 2.0, seed=2))
    assert d.verdict == SAME and not d.measurable
    assert d.saved_low_ms < 0 < d.saved_high_ms and d.speedup.low < 1 < d.speedup.high


def test_run_to_run_variation_widens_the_interval() -> None:
    steady = compare_times(_runs([10.0, 10.0, 10.0], 0.1), _runs([9.5, 9.5, 9.5], 0.1, seed=2))
    drifting = compare_times(_runs([10.0, 11.0, 9.0], 0.1), _runs([9.5, 10.5, 8.5], 0.1, seed=2))
    assert steady.verdict == FASTER  # 5% apart, every run alike
    assert drifting.verdict == SAME  # the same 5%, but whole runs differ by 10%
    assert drifting.saved_high_ms - drifting.saved_low_ms > steady.saved_high_ms - steady.saved_low_ms


def test_comparisons_are_deterministic_and_add_up() -> None:
    a, b, c = _runs([10.0], 0.5), _runs([8.0], 0.5, seed=2), _runs([7.0], 0.5, seed=3)
    assert compare_times(a, b) == compare_times(a, b)
    whole = compare_times(a, c)
    assert compare_times(a, b).saved_ms + compare_times(b, c).saved_ms == pytest.approx(whole.saved_ms)


def test_a_multi_rank_verify_fails_on_the_first_rank_that_diverges() -> None:
    """Issue 34: rank 0 agrees, rank 1's losses leave the tolerance at step 2: the parity fails, naming it."""
    from opadvisor.profile.model import Environment, Profile
    from opadvisor.verify.core import VerifyOptions, _other_ranks, verify_ranks
    from opadvisor.verify.runner import ChildResult

    opts = VerifyOptions(steps=3)
    parity = compare_parity(result(2.0, 1.5, 1.2), result(2.0, 1.5, 1.2), steps=3)
    before = ChildResult(0, result(2.0, 1.5, 1.2), "", rank_results={1: result(2.1, 1.6, 1.3)})
    after = ChildResult(0, result(2.0, 1.5, 1.2), "", rank_results={1: result(2.1, 1.9, 1.3)})
    _other_ranks(parity, before, after, opts)
    assert not parity.ok and parity.first_bad_step == 2 and parity.message.startswith("rank 1: ")
    agree = compare_parity(result(2.0, 1.5), result(2.0, 1.5), steps=2)
    _other_ranks(agree, before, before, VerifyOptions(steps=2))
    assert agree.ok
    cpu_run = Profile(world_size=2, environment=Environment(device="cpu"))
    assert verify_ranks(cpu_run)[0] == 2 and verify_ranks(Profile())[0] == 1
