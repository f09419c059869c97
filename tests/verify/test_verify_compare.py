"""Loss parity and step-time statistics on hand-made harness results (no processes)."""

from __future__ import annotations

import math

import pytest

from opadvisor.verify.compare import compare_parity, quantile, speedup, step_times


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
