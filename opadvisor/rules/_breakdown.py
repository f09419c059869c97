"""Where the step's time goes, at a glance: matrix products, elementwise work, launch gaps, idle, data.

`breakdown(profile)` returns a plain dict for `opadvisor suggest` (and its JSON):

    {"basis": "gpu" | "cpu", "step_ms": 12.3,
     "parts": [{"name": "matrix products", "ms": 4.1, "share": 0.33}, ...]}

On a GPU profile the parts are the GPU's view of the median step: busy time split into matrix products
(kernels of GEMM ops, attention kernels) and memory-bound elementwise work (every other kernel), and idle
time split into data loading (gaps while the DataLoader was fetching), launch-bound stretches (gaps under
LAUNCH_GAP_US between kernels, and the idle below the profile's gap threshold) and other GPU idle (longer
gaps: host work, synchronisations). On a CPU profile the parts are CPU times: matrix products, other ops,
data loading, and the rest of the step (Python and framework overhead). Shares are of the median step
(CPU) or of the parts' sum (GPU: the mean GPU span of a step).

On a calibrated GPU profile (`_calibration`: the run timed steps without the profiler) the idle parts are
scaled to the plain step, so the parts add up to it; each part keeps its profiled time in `profiled_ms`
(None when nothing was scaled). CPU parts are CPU times under the profiler (not scaled: where the
profiler's own cost went among them is not known); `calibrated` says which.
"""

from __future__ import annotations

import bisect
from typing import Any

from opadvisor.profile.model import Profile
from opadvisor.rules._chains import GEMM_OPS
from opadvisor.rules._index import index_of

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
    n = ix.steps_recorded
    step_ms = ix.step_ms
    parts: list[tuple[str, float]] = []
    profiled: dict[str, float] = {}
    loaders = sorted(
        (a.start_us, a.start_us + a.duration_us)
        for a in profile.annotations
        if "DataLoader" in a.name and (a.step is not None or not profile.steps)
    )
    loader_ms = sum(b - a for a, b in loaders) / 1000.0 / n
    if ix.gpu:
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
        parts = [
            ("matrix products", matrix * scale),
            ("memory-bound elementwise", other * scale),
            ("launch-bound gaps", launch),
            ("GPU idle", idle),
            ("data loading", data),
        ]
        parts = [(name, us / 1000.0 / n) for name, us in parts]
        # idle parts as the plain step has them (scale 1 without a calibration): busy parts are GPU time
        profiled = dict(parts)
        parts = [(name, ms if name in _BUSY_PARTS else ms * ix.calibration.idle_scale) for name, ms in parts]
    else:
        gemm_roots = [op for op in ix.forward_root_ops if op.name in GEMM_OPS]
        matrix = ix.per_step_ms(ix.site_cost_us(gemm_roots))
        all_roots = sum(op.duration_us for op in profile.ops if op.parent is None and ix.in_window(op))
        others = max(0.0, ix.per_step_ms(all_roots) - matrix)
        parts = [("matrix products", matrix), ("other ops", others), ("data loading", loader_ms)]
        if step_ms:
            parts.append(("Python and framework", max(0.0, step_ms - matrix - others - loader_ms)))
    # shares of the parts' sum: on a GPU that is the mean GPU span of a step (the plain step's, once
    # calibrated), which they add up to
    total = sum(ms for _, ms in parts) if ix.gpu else step_ms
    return {
        "basis": ix.basis,
        "step_ms": step_ms,
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
