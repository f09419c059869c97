"""Where the step's time goes, at a glance: matrix products, elementwise work, launch gaps, idle, data.

`breakdown(profile)` returns a plain dict for `opadvisor suggest` (and its JSON):

    {"basis": "gpu" | "cpu", "step_ms": 12.3, "total_ms": 12.1, "of": "the mean GPU span of a step",
     "parts": [{"name": "matrix products", "ms": 4.1, "share": 0.33}, ...]}

On a GPU profile the parts are the GPU's view of the median step: busy time split into matrix products
(kernels of GEMM ops, attention kernels) and memory-bound elementwise work (every other kernel), and idle
time split into data loading (gaps while the DataLoader was fetching), launch-bound stretches (gaps under
LAUNCH_GAP_US between kernels, and the idle below the profile's gap threshold) and other GPU idle (longer
gaps: host work, synchronisations). On a CPU profile the parts cut each step's wall time by what ran at
each instant on any thread (issue 30: CPU op times overlap across threads and nest, so their sums can
exceed the step): a matrix product, else another op, else data loading, else nothing recorded (Python and
framework). Either way the parts add up to `total_ms` (`of` says what it is: the mean GPU span of a step,
the plain step once calibrated, or the mean step's wall time) and the shares are of it, summing to 1.

On a calibrated GPU profile (`_calibration`: the run timed steps without the profiler) the idle parts are
scaled to the plain step, so the parts add up to it; each part keeps its profiled time in `profiled_ms`
(None when nothing was scaled). CPU parts are CPU times under the profiler (not scaled: where the
profiler's own cost went among them is not known); `calibrated` says which.
"""

from __future__ import annotations

import bisect
from typing import Any

from opadvisor.profile.intervals import interval_union
from opadvisor.profile.model import Profile
from opadvisor.rules._chains import GEMM_OPS
from opadvisor.rules._index import ProfileIndex, index_of

LAUNCH_GAP_US = 100.0
_BUSY_PARTS = ("matrix products", "memory-bound elementwise")
_MATRIX_KERNEL_WORDS = ("gemm", "cutlass", "xmma", "cublas", "flash", "fmha", "attention", "wgmma")


def _is_matrix_kernel(op_name: str, kernel_name: str) -> bool:
    if op_name in GEMM_OPS:
        return True
    low = kernel_name.lower()
    return any(w in low for w in _MATRIX_KERNEL_WORDS)


def breakdown(profile: Profile) -> dict[str, Any]:
    ix = index_of(profile)
    step_ms = ix.step_ms
    parts: list[tuple[str, float]] = []
    profiled: dict[str, float] = {}
    loaders = sorted(
        (a.start_us, a.start_us + a.duration_us)
        for a in profile.annotations
        if "DataLoader" in a.name and (a.step is not None or not profile.steps)
    )
    if ix.gpu:
        parts = _gpu_parts(profile, ix, loaders)
        # idle parts as the plain step has them (scale 1 without a calibration): busy parts are GPU time
        profiled = dict(parts)
        parts = _idle_to_plain_step(parts, ix.calibration)
    else:
        parts = _cpu_parts(profile, loaders)
    # shares of the parts' sum, which is what they cut up: on a GPU the mean GPU span of a step (the
    # plain step's, once calibrated), on a CPU the mean step's wall time
    total = sum(ms for _, ms in parts)
    return {
        "basis": ix.basis,
        "step_ms": step_ms,
        "total_ms": round(total, 4),
        "of": _what_total_is(ix.gpu, ix.calibration.calibrated),
        "calibrated": ix.calibration.calibrated,
        "parts": [
            {
                "name": name,
                "ms": round(ms, 4),
                "share": round(ms / total, 4) if total else None,
                "profiled_ms": round(profiled[name], 4) if ix.calibration.calibrated else None,
            }
            for name, ms in parts
        ],
    }


def _gpu_parts(
    profile: Profile, ix: ProfileIndex, loaders: list[tuple[float, float]]
) -> list[tuple[str, float]]:
    """The mean step's GPU span cut up (ms, as profiled): matrix products and other kernels (shares of the
    busy union), and the idle gaps: waiting for data, launch-bound (short gaps), idle."""
    n = ix.steps_recorded
    matrix = other = 0.0
    for op in profile.ops:
        if op.kernels and ix.in_window(op):
            for k in op.kernels:
                if _is_matrix_kernel(op.name, k.name):
                    matrix += k.duration_us
                else:
                    other += k.duration_us
    busy = sum((s.gpu_busy_ms or 0.0) for s in profile.steps) * 1000.0
    total_k = matrix + other
    scale = busy / total_k if total_k else 0.0  # overlapping streams: shares of the busy union
    data, launch, idle = _gap_parts(profile, loaders)
    parts = [
        ("matrix products", matrix * scale),
        ("memory-bound elementwise", other * scale),
        ("launch-bound gaps", launch),
        ("GPU idle", idle),
        ("data loading", data),
    ]
    return [(name, us / 1000.0 / n) for name, us in parts]


def _gap_parts(profile: Profile, loaders: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(waiting for data, launch-bound, idle) us over the steps: each idle gap by what it overlaps or how
    short it is; the span not covered by busy time or gaps counts as launch-bound."""
    data = launch = idle = 0.0
    starts = [a for a, _ in loaders]
    for s in profile.steps:
        span = (s.gpu_span_ms or s.wall_ms) * 1000.0
        gaps = 0.0
        for g in s.idle_gaps:
            a, b = g.start_us, g.start_us + g.duration_us
            gaps += g.duration_us
            i = bisect.bisect_right(starts, b)
            if any(loaders[j][1] > a for j in range(max(0, i - 16), i)):
                data += g.duration_us
            elif g.duration_us < LAUNCH_GAP_US:
                launch += g.duration_us
            else:
                idle += g.duration_us
        launch += max(0.0, span - (s.gpu_busy_ms or 0.0) * 1000.0 - gaps)
    return data, launch, idle


def _what_total_is(gpu: bool, calibrated: bool) -> str:
    if not gpu:
        return "the mean step's wall time"
    if calibrated:
        return "the plain step (timed without the profiler; within the GPU busy time and the profiled span)"
    return "the mean GPU span of a step"


def _cpu_parts(profile: Profile, loaders: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """Each step's wall time, in ms per step, cut by what ran at each instant on any thread: a matrix
    product (at any depth), else another op (outermost ops), else data loading, else nothing recorded."""
    matrix = interval_union([(o.start_us, o.end_us) for o in profile.ops if o.name in GEMM_OPS])
    ops = interval_union(
        [(o.start_us, o.end_us) for o in profile.ops if o.parent is None or o.name in GEMM_OPS]
    )
    with_data = interval_union(ops + loaders)
    totals = [0.0, 0.0, 0.0, 0.0]
    for step in profile.steps:
        lo, hi = step.start_us, step.end_us
        covered = [_within(matrix, lo, hi), _within(ops, lo, hi), _within(with_data, lo, hi), hi - lo]
        for i, us in enumerate(covered):
            totals[i] += us - (covered[i - 1] if i else 0.0)  # each layer holds the one before it
    n = max(len(profile.steps), 1)
    names = ("matrix products", "other ops", "data loading", "Python and framework")
    return [(name, max(0.0, us) / 1000.0 / n) for name, us in zip(names, totals, strict=True)]


def _within(union: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of a disjoint sorted union inside [lo, hi]."""
    i = max(0, bisect.bisect_right(union, (lo, float("inf"))) - 1)
    total = 0.0
    for a, b in union[i:]:
        if a >= hi:
            break
        total += max(0.0, min(b, hi) - max(a, lo))
    return total


def _idle_to_plain_step(parts: list[tuple[str, float]], cal: Any) -> list[tuple[str, float]]:
    """The idle parts scaled so that all parts add up to the plain step the shares are of (issue 30: the
    calibration's own idle is of the median step, the parts' of the mean GPU span); as is uncalibrated."""
    base = cal.share_base_ms
    if not cal.calibrated or base is None:
        return parts
    busy = sum(ms for name, ms in parts if name in _BUSY_PARTS)
    idle = sum(ms for name, ms in parts if name not in _BUSY_PARTS)
    scale = max(0.0, base - busy) / idle if idle else 0.0
    return [(name, ms if name in _BUSY_PARTS else ms * scale) for name, ms in parts]
