"""Gradient accumulation that synchronises gradients on every micro-step (DDP or FSDP2).

What it finds
    A DDP-wrapped model or an FSDP2 root unit (recorded at the user's `DistributedDataParallel(...)` /
    `fully_shard(...)` line) that runs several backward passes per optimizer step, every one of which
    all-reduces (DDP) or reduce-scatters (FSDP2) the gradients: counted while the script ran, between
    optimizer steps (DDP's decision is read at each forward, `require_backward_grad_sync`; FSDP2's at the end
    of each backward, the units' `set_requires_gradient_sync` flag).

Why it is slow
    Only the last micro-step's synchronised gradients are used by the optimizer step; the earlier
    micro-steps send the same volume again. With K micro-steps a step communicates K times where once
    would do. The cost shown is the measured gradient communication per step (every collective but FSDP's
    all-gathers: NCCL kernels on a GPU, gloo's ranges on a CPU); the saving, an estimate: (K-1)/K of it,
    times the share of communication that compute did not hide.

Example
    for i, (x, y) in enumerate(loader):
        loss = model(x, y) / accum
        loss.backward()                        # all-reduces every micro-batch
        if (i + 1) % accum == 0:
            optimizer.step(); optimizer.zero_grad()

Fix and its safety
    `opadvisor apply --rule grad_accum_sync` makes only the last micro-step synchronise: for DDP, the
    micro-step's statements run under `model.no_sync()` unless it is the last (`with
    contextlib.nullcontext() if LAST else model.no_sync():`); for FSDP2, `model.set_requires_gradient_sync(
    LAST)` and `model.set_reshard_after_backward(LAST, recurse=False)` before the forward (the root unit's
    parameters stay gathered for the next micro-step instead of being gathered again). LAST is the
    condition under which the loop steps the optimizer (`(i + 1) % accum == 0`), or, for a loop of
    micro-steps inside the step loop (`for m in range(accum):`), `m == accum - 1`. Safe: the reduction is linear, so reducing the sum once gives the same gradients (up to
    float rounding). FSDP2 then keeps unsharded gradients between micro-steps (more memory).
"""

from __future__ import annotations

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import Comm, comm_of, finding_at, forward_wrapper, per_step_median
from opadvisor.rules.distributed.parallel_facts import GradSyncFacts
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.finding import Finding

ID = "grad_accum_sync"
TITLE = "gradients synchronised on every accumulation micro-step"
FIX = "safe"


def detect(profile: Profile) -> list[Finding]:
    wrapper = forward_wrapper(profile)
    if wrapper is None:
        raise NotApplicable("no DDP or FSDP2-wrapped model was called with gradients in this run")
    counts = per_step_median(wrapper)
    if counts is None or counts[0] < 2 or counts[1] < 2:
        return []  # no accumulation, or it already synchronises once
    return [_finding(profile, wrapper, *counts)]


def _finding(profile: Profile, c: Construction, backward: float, synced: float) -> Finding:
    comm = comm_of(profile)
    grads = comm.gradients_ms() if comm is not None else 0.0
    time_ms = grads if grads > 0 else None
    saving = _saving(comm, grads, synced) if time_ms is not None else None
    what = "all-reduce" if c.kind == "ddp" else "reduce-scatter"
    measured = (
        f"gradient communication {fmt_ms(time_ms)}/step ({comm.words()})"
        if time_ms is not None and comm is not None
        else "no gradient collective was recorded in the window"
    )
    forward = c.attrs.get("forward_at") or [None, None]
    step = c.attrs.get("step_at") or [None, None]
    facts = GradSyncFacts(
        wrapper=c.kind,
        construction_line=c.line,
        backward_per_step=backward,
        synced_per_step=synced,
        forward_file=forward[0],
        forward_line=forward[1],
        step_file=step[0],
        step_line=step[1],
        lines=_lines(c.file, forward, step),
    )
    fix_words = "model.no_sync()" if c.kind == "ddp" else "model.set_requires_gradient_sync(False)"
    return finding_at(
        profile,
        c,
        ID,
        message=f"{backward:g} backward passes per optimizer step, each {what}s the gradients ({synced:g} of "
        f"{backward:g}); only the last needs to: {measured}",
        fix="safe",
        time_ms=time_ms,
        saving_ms=saving,
        comm=comm,
        notes=[
            f"estimate: skipping {synced - 1:g} of {synced:g} gradient synchronisations saves that share of the "
            "gradient communication, times its exposed share"
            + (f" ({comm.exposed_share:.0%})" if comm is not None else ""),
            f"forward called at line {forward[1]}, optimizer step at line {step[1]}",
        ],
        advice=f"run the micro-steps that do not step the optimizer without gradient sync ({fix_words})",
        details=facts.to_details(),
    )


def _lines(file: str | None, forward: list, step: list) -> dict[str, list[int]]:
    """The loop's lines for the codemod, when they are in the construction's file."""
    out = {}
    for label, (where, line) in (("forward", forward), ("step", step)):
        if where == file and isinstance(line, int):
            out[label] = [line, line]
    return out


def _saving(comm: Comm | None, grads_ms: float, synced: float) -> float | None:
    if comm is None or synced < 2:
        return None
    return grads_ms * (synced - 1.0) / synced * comm.exposed_share


__all__ = ["FIX", "ID", "TITLE", "detect"]
