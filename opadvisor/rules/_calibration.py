"""The plain step: how much of the profiled GPU idle time the step really has without the profiler.

The profiler's own cost (the Python tracer, shapes, stacks; per op) is paid on the host. It stretches the
host's part of every step, so on a GPU profile the GPU idles longer between kernels than it does in a plain
run, while the kernels take as long as ever (a BERT-base step: 49.7 ms plain, 87.5 ms profiled). `opadvisor
profile` times warm-up steps without the profiler (`Profile.calibration`); from them, per step on average:

    busy            GPU busy time (the union of the step's kernels; the profiler does not slow kernels)
    profiled idle   step length - busy, under the profiler (length: the step's GPU span, else its wall time)
    plain idle      max(0, plain step - busy)
    idle_scale      plain idle / profiled idle, kept within [0, 1]

Every time made of GPU idle (sparse_launch, host_sync and dataloader_stall findings, the gaps between an
unfused optimizer's launches, the breakdown's idle parts) is multiplied by idle_scale: each cause of idle is taken to shrink in proportion to the whole, so
the scaled parts add up to the plain step's idle time and no finding claims more than the plain step can
give. Shares of the step are then shares of the plain step (kernel times are GPU times: the same with or
without the profiler). Without a calibration (a CPU profile, a run with fewer than 2 warm-up steps, a
profile.json from before calibration existed) the scale is 1: idle times are upper bounds, as said.
"""

from __future__ import annotations

from dataclasses import dataclass

from opadvisor.profile.model import Profile


@dataclass(frozen=True)
class StepCalibration:
    profiled_ms: float | None  # median step under the profiler (the rules' step_ms)
    plain_ms: float | None = None  # median step without the profiler; None when not measured
    plain_samples: int = 0
    method: str | None = None  # "cuda_sync" | "wall" (Calibration.method)
    busy_ms: float | None = None  # mean GPU busy per step (GPU profiles)
    profiled_idle_ms: float | None = None  # mean GPU idle per step under the profiler
    plain_idle_ms: float | None = None  # max(0, plain - busy)
    idle_scale: float = 1.0  # multiply idle-based times by this

    @property
    def calibrated(self) -> bool:
        """True when idle-based times are scaled to the plain step (a GPU profile with a plain time)."""
        return self.plain_idle_ms is not None

    @property
    def share_base_ms(self) -> float | None:
        """The step that shares are of: the plain step once calibrated (never less than the GPU busy
        time, never more than the profiled step), else the profiled one."""
        if self.calibrated and self.plain_idle_ms is not None and self.busy_ms is not None:
            return self.busy_ms + self.plain_idle_ms
        return self.profiled_ms

    @property
    def plain_slower(self) -> bool:
        """The plain steps took longer than the profiled ones: the warm-up was probably not over."""
        return self.plain_ms is not None and self.profiled_ms is not None and self.plain_ms > self.profiled_ms

    def idle_ms(self, profiled_ms: float) -> float:
        """An idle time measured under the profiler, as the plain step would have it (never more than it)."""
        scaled = profiled_ms * self.idle_scale
        return min(scaled, self.plain_idle_ms) if self.plain_idle_ms is not None else scaled

    def to_json(self) -> dict:
        return {
            "plain_step_ms": _round(self.plain_ms),
            "profiled_step_ms": _round(self.profiled_ms),
            "plain_steps_timed": self.plain_samples,
            "method": self.method,
            "gpu_busy_ms": _round(self.busy_ms),
            "profiled_idle_ms": _round(self.profiled_idle_ms),
            "plain_idle_ms": _round(self.plain_idle_ms),
            "idle_scale": round(self.idle_scale, 4),
            "calibrated": self.calibrated,
        }


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def step_calibration(profile: Profile, profiled_ms: float | None) -> StepCalibration:
    """The calibration of `profile` (see the module doc); `profiled_ms` is its median profiled step."""
    plain = profile.plain_step_ms()
    samples = len(profile.calibration.step_ms) if profile.calibration is not None else 0
    method = profile.calibration.method if profile.calibration is not None else None
    if not profile.has_gpu or not profile.steps:
        return StepCalibration(profiled_ms, plain, samples, method)
    n = len(profile.steps)
    busy = sum(s.gpu_busy_ms or 0.0 for s in profile.steps) / n
    idle = sum(max(0.0, (s.gpu_span_ms or s.wall_ms) - (s.gpu_busy_ms or 0.0)) for s in profile.steps) / n
    if plain is None:
        return StepCalibration(profiled_ms, None, 0, None, busy, idle)
    # A plain step slower than the profiled one is not the steady state (the warm-up was not over): it
    # cannot say the profiler stretched anything, so nothing is scaled then.
    if profiled_ms is not None and plain >= profiled_ms:
        return StepCalibration(profiled_ms, plain, samples, method, busy, idle, idle, 1.0)
    plain_idle = max(0.0, plain - busy)
    scale = min(1.0, plain_idle / idle) if idle > 0 else 1.0
    return StepCalibration(profiled_ms, plain, samples, method, busy, idle, min(plain_idle, idle), scale)


def calibration_words(cal: StepCalibration) -> str:
    """One line for a finding's evidence: where its idle time came from."""
    if not cal.calibrated:
        return (
            "GPU idle measured under the profiler, whose own cost (shapes, stacks) lengthens the gaps: "
            "read it as an upper bound (this run has no plain step time to scale it by)"
        )
    return (
        f"GPU idle scaled to the plain step: {cal.plain_ms:.3g} ms plain vs {cal.profiled_ms:.3g} ms under "
        f"the profiler; GPU busy {cal.busy_ms:.3g} ms, so idle {cal.plain_idle_ms:.3g} ms plain vs "
        f"{cal.profiled_idle_ms:.3g} ms profiled (x{cal.idle_scale:.2f})"
    )
