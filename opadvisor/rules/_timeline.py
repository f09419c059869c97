"""Time-line helpers several rules share: GPU idle inside CPU intervals, annotation ranges per step."""

from __future__ import annotations

from opadvisor.profile.model import Annotation, Profile


def gpu_idle_overlap_us(profile: Profile, intervals: list[tuple[float, float]]) -> float:
    """GPU idle time (the steps' idle gaps) that falls inside the union of `intervals` (us)."""
    if not intervals:
        return 0.0
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for step in profile.steps:
        for g in step.idle_gaps:
            g0, g1 = g.start_us, g.start_us + g.duration_us
            for a, b in merged:
                if b <= g0:
                    continue
                if a >= g1:
                    break
                total += min(b, g1) - max(a, g0)
    return total


def annotation_intervals(profile: Profile, prefix: str) -> list[tuple[float, float, int, Annotation]]:
    """(start, end, thread, annotation) of the annotations named `prefix...`, in the recorded steps.

    The last `Optimizer.step#...` range of a step is stretched to the end of the step: the window closes
    inside the optimizer's step hook, so the final step's range is recorded cut short.
    """
    out = []
    anns = [a for a in profile.annotations if a.name.startswith(prefix)]
    last_in_step: dict[int, Annotation] = {}
    if prefix.startswith("Optimizer.step"):
        for a in anns:
            if a.step is not None and (
                a.step not in last_in_step or a.start_us > last_in_step[a.step].start_us
            ):
                last_in_step[a.step] = a
    for a in anns:
        end = a.start_us + a.duration_us
        if a.step is not None and last_in_step.get(a.step) is a and 0 <= a.step < len(profile.steps):
            end = max(end, profile.steps[a.step].end_us)
        out.append((a.start_us, end, a.thread, a))
    return out
