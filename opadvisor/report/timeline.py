"""One recorded step laid out in time, for pictures (`opadvisor report`): what ran when, and the longest items.

    from opadvisor.report.timeline import step_timeline

    tl = step_timeline(profile)          # the median step; step_timeline(profile, step=2) for another
    tl.lanes                             # [Lane(name, segments)] in display order
    tl.longest                           # [Item] the longest kernels (GPU) or ops (CPU), longest first

On a GPU profile the step is the GPU's span of it (from the end of the previous step's GPU work to the end
of this one's, as the profile measured it): a "GPU" lane with the kernels that ran (busy) and the idle gaps
the profile recorded, and a "CPU" lane with the step's wall-clock range and the DataLoader ranges inside it
(the CPU runs ahead of the GPU, so the two need not line up). The longest items are kernels, each with the
op that launched it and its file:line.

On a CPU profile there is no GPU timeline: the lanes are the step's threads (the training thread's forward
ops, the autograd thread's backward ops), each segment a top-level op, and the longest items are ops.

Times are microseconds on the profile's clock; `start_us`/`end_us` bound the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from opadvisor.profile.model import Profile, Step
from opadvisor.rules.overview import median_step_ms

__all__ = ["Item", "Lane", "Segment", "StepTimeline", "step_timeline"]

SegmentKind = Literal["busy", "idle", "cpu", "data", "op"]


@dataclass
class Segment:
    start_us: float
    end_us: float
    kind: SegmentKind
    label: str | None = None


@dataclass
class Lane:
    name: str
    segments: list[Segment] = field(default_factory=list)


@dataclass
class Item:
    """A kernel (GPU) or top-level op (CPU) of the step, with where it came from."""

    name: str
    op: str
    start_us: float
    duration_us: float
    file: str | None = None
    line: int | None = None
    module: str | None = None


@dataclass
class StepTimeline:
    step: int
    basis: Literal["gpu", "cpu"]
    start_us: float
    end_us: float
    lanes: list[Lane]
    longest: list[Item]
    busy_ms: float | None = None  # GPU busy time of the step (GPU profiles)
    idle_ms: float | None = None  # recorded idle gaps of the step (GPU profiles)

    @property
    def duration_ms(self) -> float:
        return (self.end_us - self.start_us) / 1000.0


def _median_step(profile: Profile) -> Step | None:
    """The recorded step closest to the median step time (the one a picture should show)."""
    target = median_step_ms(profile)
    if target is None:
        return None
    return min(profile.steps, key=lambda s: abs(max(s.wall_ms, s.gpu_span_ms or 0.0) - target))


def step_timeline(profile: Profile, step: int | None = None, top: int = 8) -> StepTimeline | None:
    """The timeline of one step (default: the median one); None when the profile recorded no step."""
    chosen = _median_step(profile) if step is None else profile.steps[step]
    if chosen is None:
        return None
    if profile.has_gpu and chosen.kernel_count:
        return _gpu_timeline(profile, chosen, top)
    return _cpu_timeline(profile, chosen, top)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _gpu_timeline(profile: Profile, step: Step, top: int) -> StepTimeline:
    items = [
        Item(k.name, op.name, k.start_us, k.duration_us, op.file, op.line, op.module)
        for op in profile.ops
        if op.step == step.index
        for k in op.kernels
    ]
    busy = _union([(k.start_us, k.start_us + k.duration_us) for k in items])
    end = busy[-1][1]
    # the profile's span of the step ends at its last kernel and reaches back to the previous step's work
    start = end - (step.gpu_span_ms or 0.0) * 1000.0 if step.gpu_span_ms else busy[0][0]
    gpu = Lane("GPU", [Segment(a, b, "busy") for a, b in busy])
    gpu.segments += [Segment(g.start_us, g.start_us + g.duration_us, "idle") for g in step.idle_gaps]
    gpu.segments.sort(key=lambda s: s.start_us)
    cpu = Lane("CPU", [Segment(step.start_us, step.end_us, "cpu", f"step {step.index} on the CPU")])
    cpu.segments += [
        Segment(a.start_us, a.start_us + a.duration_us, "data", a.name)
        for a in profile.annotations
        if a.step == step.index and "DataLoader" in a.name
    ]
    longest = sorted(items, key=lambda k: -k.duration_us)[:top]
    return StepTimeline(
        step=step.index,
        basis="gpu",
        start_us=min(start, step.start_us),
        end_us=max(end, step.end_us),
        lanes=[gpu, cpu],
        longest=longest,
        busy_ms=step.gpu_busy_ms,
        idle_ms=sum(g.duration_us for g in step.idle_gaps) / 1000.0,
    )


def _cpu_timeline(profile: Profile, step: Step, top: int) -> StepTimeline:
    by_thread: dict[tuple[bool, int], Lane] = {}
    items: list[Item] = []
    for op in profile.ops:
        if op.step != step.index or op.parent is not None:
            continue
        key = (op.is_backward, op.thread)
        lane = by_thread.get(key)
        if lane is None:
            lane = by_thread[key] = Lane(
                f"{'backward' if op.is_backward else 'forward'} (thread {op.thread})"
            )
        name = op.name.split(": ", 1)[-1]
        lane.segments.append(Segment(op.start_us, op.end_us, "op", name))
        items.append(Item(name, name, op.start_us, op.duration_us, op.file, op.line, op.module))
    lanes = [by_thread[k] for k in sorted(by_thread)]  # forward lanes first
    return StepTimeline(
        step=step.index,
        basis="cpu",
        start_us=step.start_us,
        end_us=step.end_us,
        lanes=lanes,
        longest=sorted(items, key=lambda i: -i.duration_us)[:top],
    )
