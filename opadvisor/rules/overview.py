"""The run at a glance, beside the findings: what `suggest` and `report` show above them.

The public face of the rules' private helpers for the other packages (the CLI, the HTML report), which
render what the rules computed and never import a private module of this package:

    breakdown(profile)       where the median step's time goes (matrix products, elementwise, idle, data)
    step_words(profile)      "step 50 ms plain, 88 ms under the profiler" (or why there is no plain time)
    median_step_ms(profile)  the median step time, None when the profile recorded no step
    calibration(profile)     the plain step against the profiled one (`StepCalibration`)
    fmt_ms(ms), fmt_share(s) how a time and a share of the step are written everywhere
"""

from __future__ import annotations

from opadvisor.profile.model import Profile
from opadvisor.rules._breakdown import breakdown
from opadvisor.rules._calibration import StepCalibration
from opadvisor.rules._findings import fmt_ms, fmt_share
from opadvisor.rules._index import index_of, median_step_ms

__all__ = [
    "StepCalibration",
    "breakdown",
    "calibration",
    "fmt_ms",
    "fmt_share",
    "median_step_ms",
    "step_words",
]


def calibration(profile: Profile) -> StepCalibration:
    """The profile's step calibration, computed once with the index every rule shares."""
    return index_of(profile).calibration


def step_words(profile: Profile) -> str:
    """ "step 50 ms plain, 88 ms under the profiler" (or why there is no plain time), for headers."""
    cal = index_of(profile).calibration
    profiled = fmt_ms(cal.profiled_ms)
    if cal.plain_slower:
        return (
            f"step {fmt_ms(cal.plain_ms)} plain, {profiled} under the profiler (the plain steps were slower: "
            "the warm-up may not have been over; profile with a larger --warmup)"
        )
    if cal.plain_ms is not None:
        return f"step {fmt_ms(cal.plain_ms)} plain, {profiled} under the profiler"
    why = (
        "profile with --warmup 2 or more to time it"
        if profile.warmup_steps < 2
        else "this run did not time one (--calibrate 0, a time window, or an older opadvisor)"
    )
    return f"median step {profiled} under the profiler (no plain step time: {why})"
