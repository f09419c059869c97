"""DistributedDataParallel built with find_unused_parameters=True where every parameter gets a gradient.

What it finds
    A `DistributedDataParallel(model, find_unused_parameters=True, ...)` construction (recorded at the
    user's line while the script ran) after which, at every optimizer step the run made, each parameter
    that requires grad had a gradient: no parameter was unused, so the flag bought nothing.

Why it is slow
    With the flag, DDP walks the autograd graph from the forward's outputs after every forward (to find the
    parameters that will get no gradient) and marks the outputs for its own backward hook; without it,
    it does neither. The cost is host time on every forward, growing with the number of autograd nodes:
    measured here as the median host time of DDP's `_post_forward` per call, times the forwards per step.
    torch itself warns about it once ("find_unused_parameters=True was specified ... but did not find any
    unused parameters").

Example
    model = DDP(model, device_ids=[rank], find_unused_parameters=True)

Fix and its safety
    `opadvisor apply --rule ddp_find_unused` removes `find_unused_parameters=True` from the call. Safe: the
    same gradients. Should a later iteration leave a parameter unused (control flow the profiled steps did
    not take), DDP raises at that step saying so, rather than computing something else.
"""

from __future__ import annotations

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at, per_step_median
from opadvisor.rules.distributed.parallel_facts import DdpFacts
from opadvisor.rules.finding import Finding

ID = "ddp_find_unused"
TITLE = "DDP's find_unused_parameters=True with no unused parameter"
FIX = "safe"


def detect(profile: Profile) -> list[Finding]:
    findings = []
    for c in constructions(profile, "ddp"):
        a = c.attrs
        if not a.get("find_unused_parameters") or a.get("static_graph"):
            continue
        if a.get("unused_params") != 0 or not a.get("unused_checked_steps"):
            continue  # a parameter was unused at some step (or none was checked): the flag is needed
        findings.append(_finding(profile, c))
    return findings


def _finding(profile: Profile, c: Construction) -> Finding:
    a = c.attrs
    per_call = a.get("post_forward_ms")
    counts = per_step_median(c)
    forwards = counts[0] if counts else 1.0
    time_ms = per_call * forwards if isinstance(per_call, int | float) else None
    steps = a.get("unused_checked_steps")
    measured = (
        f"DDP's graph traversal after each forward: {fmt_ms(per_call)} a call, {forwards:g} forward(s) a step, "
        f"{fmt_ms(time_ms)}/step of host time"
        if time_ms is not None
        else "DDP traverses the autograd graph after every forward (not timed in this run)"
    )
    facts = DdpFacts(
        construction_line=c.line,
        find_unused_parameters=True,
        bucket_cap_mb=a.get("bucket_cap_mb"),
        gradient_as_bucket_view=bool(a.get("gradient_as_bucket_view")),
        static_graph=bool(a.get("static_graph")),
        grad_bytes=int(a.get("grad_bytes") or 0),
        unused_params=0,
        unused_checked_steps=int(steps or 0),
        post_forward_ms=per_call,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"find_unused_parameters=True, but every parameter got a gradient at each of {steps} optimizer "
        f"step(s): {measured}",
        fix="safe",
        time_ms=time_ms,
        saving_ms=time_ms,
        comm=comm_of(profile),
        notes=[
            f"{a.get('param_tensors')} parameter tensors require grad; none was without a gradient at an "
            "optimizer step",
            "saving (estimate): the measured _post_forward time, most of which is the traversal; it is host "
            "time, which lengthens the step where the host sets the pace (on a GPU-bound step it may hide)",
        ],
        advice="drop find_unused_parameters=True from DistributedDataParallel(...)",
        details=facts.to_details(),
    )


__all__ = ["FIX", "ID", "TITLE", "detect"]
