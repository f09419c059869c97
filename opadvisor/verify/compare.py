"""Comparing two harness results: per-step loss parity within a dtype-aware tolerance, and step-time statistics.

Tolerance. Step k passes when every loss of that step satisfies |after - before| <= atol + rtol * |before|;
the gradient norm at step 1 is compared with its own rtol. Both come from `tolerance.derive`: the
precision either run computed in, the longest reduction and the depth of the step (the harness reports
them), never tighter than the per-precision defaults (fp32 rtol 1e-4, tf32 1e-3, bf16/fp16 2e-2 for the
loss). NaN equals NaN: a rewrite must reproduce, not fix, a loss that the original already made NaN.
Each gradient tensor is compared in `grads.py` against the same Tolerances.

Timing. Step k's duration is end(k) - end(k-1); the first `warmup` steps are dropped. The steps of a program
(pooled over its repeated runs) are summarised by their median and quartiles (p25, p75). Two programs are
compared by the difference and the ratio (the speedup) of their medians, each with a 95% interval from a
bootstrap that resamples the timing runs and, within each, the steps (2000 resamples, a fixed seed, so the
same numbers always give the same answer). The verdict: "faster" when the whole interval of the saving is
above zero, "slower" when it is below, else "no measurable difference". With one run per program the
interval reflects step-to-step variation only; repeated runs add the run-to-run variation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opadvisor.verify.tolerance import Tolerances, derive

_RANK = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3}


def lower_precision(a: str, b: str) -> str:
    return a if _RANK.get(a, 0) >= _RANK.get(b, 0) else b


def _close(before: float, after: float, rtol: float, atol: float) -> tuple[bool, float, float]:
    """(within tolerance, |diff|, allowed)."""
    if math.isnan(before) or math.isnan(after):
        same = math.isnan(before) and math.isnan(after)
        return same, 0.0 if same else math.inf, 0.0
    if math.isinf(before) or math.isinf(after):
        same = before == after
        return same, 0.0 if same else math.inf, 0.0
    allowed = atol + rtol * abs(before)
    diff = abs(after - before)
    return diff <= allowed, diff, allowed


@dataclass
class StepParity:
    step: int
    loss_before: float | None
    loss_after: float | None
    diff: float | None
    allowed: float | None
    ok: bool
    note: str = ""


@dataclass
class Parity:
    ok: bool
    precision: str
    rtol: float
    atol: float
    steps: list[StepParity] = field(default_factory=list)
    first_bad_step: int | None = None
    grad_norm_before: float | None = None
    grad_norm_after: float | None = None
    grad_norm_rtol: float | None = None
    grad_norm_ok: bool | None = None
    message: str = ""
    tolerances: Tolerances | None = None
    gradients: Any = None  # grads.GradientCheck: every parameter's gradient at step 1 (None: not compared)


def compare_parity(
    before: dict[str, Any],
    after: dict[str, Any],
    *,
    steps: int,
    rtol: float | None = None,
    atol: float | None = None,
) -> Parity:
    """Compare the parity-phase results of the original (before) and the rewrite (after)."""
    precision = lower_precision(before.get("precision", "fp32"), after.get("precision", "fp32"))
    work = [r.get("work") or {} for r in (before, after)]
    tol = derive(
        precision,
        reduction=max(w.get("reduction", 1) for w in work),
        depth=max(w.get("depth", 1) for w in work),
        rtol=rtol,
        atol=atol,
    )
    rtol_, atol_ = tol.loss_rtol, tol.loss_atol
    result = Parity(ok=True, precision=precision, rtol=rtol_, atol=atol_, tolerances=tol)

    b_steps, a_steps = before.get("steps", []), after.get("steps", [])
    for k in range(min(steps, max(len(b_steps), len(a_steps)))):
        row = _step_parity(k, b_steps, a_steps, rtol_, atol_)
        result.steps.append(row)
        if not row.ok and result.first_bad_step is None:
            result.first_bad_step = row.step

    gb, ga = before.get("grad_norm"), after.get("grad_norm")
    result.grad_norm_before, result.grad_norm_after = gb, ga
    if gb is not None and ga is not None:
        result.grad_norm_rtol = tol.grad_norm_rtol
        result.grad_norm_ok = _close(gb, ga, result.grad_norm_rtol, atol_)[0]

    _say_verdict(result, precision, gb, ga)
    return result


def _step_parity(k: int, b_steps: list, a_steps: list, rtol_: float, atol_: float) -> StepParity:
    """Step k+1's losses before and after, compared (every backward call's loss of the step)."""
    b = b_steps[k]["losses"] if k < len(b_steps) else None
    a = a_steps[k]["losses"] if k < len(a_steps) else None
    row = StepParity(
        step=k + 1,
        loss_before=(b or [None])[0],
        loss_after=(a or [None])[0],
        diff=None,
        allowed=None,
        ok=True,
    )
    if b is None or a is None:
        row.ok = False
        row.note = (
            "the original stopped before this step" if b is None else "the rewrite stopped before this step"
        )
    elif len(b) != len(a):
        row.ok = False
        row.note = f"{len(b)} backward call(s) before, {len(a)} after"
    else:
        worst = 0.0
        for lb, la in zip(b, a, strict=True):
            ok, diff, allowed = _close(lb, la, rtol_, atol_)
            row.ok = row.ok and ok
            if diff >= worst:
                worst, row.allowed = diff, allowed
        row.diff = worst
        if not b:
            row.note = "no loss recorded (no backward on a scalar in this step)"
    return row


def _say_verdict(result: Parity, precision: str, gb: Any, ga: Any) -> None:
    """Set `ok` and `message`: the first diverging step, else the gradient norms, else a match."""
    rtol_, atol_ = result.rtol, result.atol
    if result.first_bad_step is not None:
        row = result.steps[result.first_bad_step - 1]
        result.ok = False
        if row.note:
            result.message = f"losses diverge at step {row.step}: {row.note}"
        else:
            result.message = (
                f"losses diverge at step {row.step}: {_fmt(row.loss_before)} before, "
                f"{_fmt(row.loss_after)} after (|diff| {row.diff:.3g} > {row.allowed:.3g})"
            )
    elif result.grad_norm_ok is False:
        result.ok = False
        result.message = (
            f"gradient norms differ at step 1: {gb:.6g} before, {ga:.6g} after "
            f"(rtol {result.grad_norm_rtol:.3g})"
        )
    elif not result.steps:
        result.ok = False
        result.message = "no step was recorded: does the script call optimizer.step() (or opadvisor.step())?"
    else:
        result.message = (
            f"losses match for {len(result.steps)} steps ({precision}, rtol {rtol_:g}, atol {atol_:g})"
        )


def add_gradients(parity: Parity, check: Any) -> None:
    """Fold the per-tensor gradient check (`grads.GradientCheck`) into the parity verdict: losses that
    match but a gradient that does not fail at step 1, naming the worst tensor (in place of the gradient
    norm's message, which names none)."""
    parity.gradients = check
    if check.ok or parity.first_bad_step is not None:
        return  # all match, or the losses already diverged (that message says more)
    worst = check.failing[0]
    more = f" (and {len(check.failing) - 1} more)" if len(check.failing) > 1 else ""
    why = worst.note or f"relative error {worst.rel_error:.3g} > {check.tolerance:.3g}"
    parity.ok = False
    parity.first_bad_step = 1
    parity.message = f"gradients differ at step 1: {worst.name} {list(worst.shape)}: {why}{more}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6f}"


# ---- timing --------------------------------------------------------------------------------------------


@dataclass
class StepTimes:
    median_ms: float
    p25_ms: float
    p75_ms: float
    n: int
    times_ms: list[float] = field(default_factory=list)
    run_medians_ms: list[float] = field(default_factory=list)  # one per timing run


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return quantile(sorted(values), 0.5)


def step_durations_ms(result: dict[str, Any], warmup: int) -> list[float]:
    """Durations (ms) of the steps after the warm-up: step k lasts from the end of step k-1 to its end."""
    ends = [s["end_s"] for s in result.get("steps", [])]
    return [(ends[k] - ends[k - 1]) * 1000.0 for k in range(max(1, warmup), len(ends))]


@dataclass
class PeakMemory:
    """The largest per-step CUDA peaks over the timed steps (after the warm-up) of a program's runs."""

    allocated_bytes: int
    reserved_bytes: int
    steps: int


def peak_memory(results: list[dict[str, Any]], warmup: int) -> PeakMemory | None:
    """Peaks of the steps after the warm-up, over every run of one program; None without CUDA peaks."""
    steps = [s for r in results for s in r.get("steps", [])[max(1, warmup) :]]
    allocated = [s["peak_allocated_bytes"] for s in steps if s.get("peak_allocated_bytes") is not None]
    reserved = [s["peak_reserved_bytes"] for s in steps if s.get("peak_reserved_bytes") is not None]
    if not allocated or not reserved:
        return None
    return PeakMemory(max(allocated), max(reserved), len(allocated))


def summarise(durations: list[float], runs: Sequence[Sequence[float]] = ()) -> StepTimes | None:
    """Median and quartiles of step durations (and the median of each run, when given); None when none."""
    if not durations:
        return None
    ordered = sorted(durations)
    return StepTimes(
        median_ms=quantile(ordered, 0.5),
        p25_ms=quantile(ordered, 0.25),
        p75_ms=quantile(ordered, 0.75),
        n=len(durations),
        times_ms=list(durations),
        run_medians_ms=[median(r) for r in runs if r],
    )


def summarise_runs(runs: Sequence[Sequence[float]]) -> StepTimes | None:
    """The steps of every timing run of one program, pooled."""
    return summarise([t for r in runs for t in r], runs)


def step_times(result: dict[str, Any], warmup: int) -> StepTimes | None:
    """The steps after the warm-up of one run, summarised; None when fewer than one step was timed."""
    return summarise(step_durations_ms(result, warmup))


@dataclass
class Speedup:
    factor: float  # median(before) / median(after)
    low: float  # its 95% interval (see the module doc)
    high: float


CONFIDENCE = 0.95
RESAMPLES = 2000
FASTER, SLOWER, SAME = "faster", "slower", "no measurable difference"
INCONCLUSIVE = "timing inconclusive"  # issue 30: the machine's noise hides any difference there may be
NOISE_LIMIT = 0.25  # noise (a fraction of the step) from which an unclear interval is called inconclusive
TIGHT = 0.05  # a speedup interval narrower than this fraction of the speedup is tight: timing can stop


@dataclass
class Difference:
    """Program `after` against program `before`: medians, the saving and the speedup with 95% intervals."""

    before_ms: float
    after_ms: float
    saved_ms: float  # median(before) - median(after); negative when after is slower
    saved_low_ms: float
    saved_high_ms: float
    speedup: Speedup
    verdict: str  # FASTER | SLOWER | SAME | INCONCLUSIVE
    noise: float | None = None  # the machine's noise as a fraction of the step (see `machine_noise`)

    @property
    def measurable(self) -> bool:
        return self.verdict not in (SAME, INCONCLUSIVE)

    @property
    def tight(self) -> bool:
        """The speedup's interval is narrow enough that more timing runs would not change the verdict."""
        s = self.speedup
        return math.isfinite(s.high) and s.factor > 0 and (s.high - s.low) / s.factor < TIGHT

    @property
    def unclear(self) -> bool:
        """The interval includes 1x: under large noise that says nothing either way. (An interval wholly on
        one side of 1x is a verdict however wide: 30 ms slept in a 1 ms step is slower on any machine.)"""
        return self.verdict == SAME


def machine_noise(runs: Sequence[Sequence[float]], plain_ms: float | None = None) -> float:
    """How noisy step times are on this machine, as a fraction of the step: the larger of the spread of
    one program's steps (interquartile range over median, across its runs) and how far its median is from
    the plain step `profile` measured for the same program (15 ms there, 84 ms here: 4.6, i.e. 460%)."""
    pooled = sorted(t for run in runs for t in run)
    if not pooled:
        return 0.0
    mid = median(pooled)
    if mid <= 0:
        return 0.0
    spread = (quantile(pooled, 0.75) - quantile(pooled, 0.25)) / mid
    drift = abs(mid / plain_ms - 1.0) if plain_ms else 0.0
    return max(spread, drift)


def judge_noise(d: Difference, noise: float) -> Difference:
    """`d` with its noise, called inconclusive where the noise is large and the interval unclear."""
    d.noise = noise
    if noise >= NOISE_LIMIT and d.unclear:
        d.verdict = INCONCLUSIVE
    return d


def _resampled_median(runs: Sequence[Sequence[float]], rng: random.Random) -> float:
    """The median of one bootstrap sample: runs drawn with replacement, then steps within each."""
    pooled = []
    for _ in runs:
        run = runs[rng.randrange(len(runs))]
        pooled.extend(run[rng.randrange(len(run))] for _ in run)
    return median(pooled)


def compare_times(
    before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], *, seed: int = 0
) -> Difference:
    """Step durations per timing run of two programs -> their Difference (see the module doc)."""
    before = [r for r in before if r]
    after = [r for r in after if r]
    if not before or not after:
        raise ValueError("no timed steps to compare")
    mb = median([t for r in before for t in r])
    ma = median([t for r in after for t in r])
    rng = random.Random(seed)
    diffs, ratios = [], []
    for _ in range(RESAMPLES):
        b, a = _resampled_median(before, rng), _resampled_median(after, rng)
        diffs.append(b - a)
        ratios.append(b / a if a > 0 else math.inf)
    tail = (1 - CONFIDENCE) / 2
    diffs.sort()
    ratios.sort()
    low, high = quantile(diffs, tail), quantile(diffs, 1 - tail)
    factor = mb / ma if ma > 0 else math.inf
    verdict = FASTER if low > 0 else SLOWER if high < 0 else SAME
    return Difference(
        before_ms=mb,
        after_ms=ma,
        saved_ms=mb - ma,
        saved_low_ms=min(low, mb - ma),
        saved_high_ms=max(high, mb - ma),
        speedup=Speedup(
            factor=factor,
            low=min(quantile(ratios, tail), factor),
            high=max(quantile(ratios, 1 - tail), factor),
        ),
        verdict=verdict,
    )


def speedup(before: StepTimes, after: StepTimes) -> Speedup:
    """The speedup of two summaries with its 95% interval (one run each: the steps' variation only)."""
    return compare_times([before.times_ms], [after.times_ms]).speedup
