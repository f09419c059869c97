"""FSDP2 units whose forward all-gather starts only after the previous unit has finished computing.

What it finds
    On a GPU profile, per-block `fully_shard` units (recorded at the user's line) whose forward all-gather
    NCCL kernel started only after the last compute kernel of the unit before them had ended, in at least
    MIN_LATE_SHARE of the forward's unit-to-unit hand-overs (FSDP2's `FSDP::pre_forward (unit)` ranges give
    the order; the kernels of the previous unit's modules its compute; the unit's `FSDP::all_gather` range
    its gather). The GPU then waited for the whole gather: its time outside any compute kernel is the
    cost shown. A CPU profile has no kernel times: the rule says it cannot judge.

Why it is slow
    FSDP2 issues a unit's all-gather when the CPU reaches that unit's forward. Where the CPU runs ahead of
    the GPU the gather overlaps the previous unit's compute; where it does not (a launch-bound step, a
    Python-heavy block, a synchronisation in the loop) the gather starts once the previous unit is done and
    the GPU idles for it, unit after unit. Explicit prefetching issues the next unit's all-gather at the
    previous unit's pre-forward, one unit earlier.

Example
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Fix
    Advice (no automatic fix: the prefetch list must follow the forward's order, which the source does not
    state). After the `fully_shard` calls:

        blocks = list(model.blocks)
        for prev, nxt in zip(blocks, blocks[1:]):
            prev.set_modules_to_forward_prefetch([nxt])

    The same values (only the issue order of the gathers changes); memory holds one more gathered unit at
    a time. The saving shown is an estimate: the exposed gather time, which the prefetch can hide up to
    the previous unit's compute. Backward needs nothing: FSDP2 prefetches one unit in backward by default
    (`set_modules_to_backward_prefetch` changes how far).
"""

from __future__ import annotations

import statistics

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules._units import LateGather, late_forward_gathers
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at, unit_notes
from opadvisor.rules.distributed.parallel_facts import PrefetchFacts
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.finding import Finding

ID = "fsdp_prefetch"
TITLE = "FSDP forward all-gathers start after the previous unit's compute"
FIX = "none"

MIN_LATE_SHARE = 0.25  # report when at least this share of the hand-overs had a late gather


def detect(profile: Profile) -> list[Finding]:
    units = [c for c in constructions(profile, "fsdp") if c.module and not c.attrs.get("root")]
    if len(units) < 2:
        return []
    if not profile.has_gpu:
        raise NeedsGpuProfile(
            "when each unit's forward all-gather started against the previous unit's compute (kernel times)"
        )
    late, pairs = late_forward_gathers(profile)
    if not late or len(late) < MIN_LATE_SHARE * pairs:
        return []
    by_line: dict[tuple[str | None, int | None], list[Construction]] = {}
    for c in units:
        by_line.setdefault((c.file, c.line), []).append(c)
    out = []
    for calls in by_line.values():
        names = {c.module for c in calls}
        mine = [g for g in late if g.unit in names]
        if mine:
            out.append(_finding(profile, calls[0], mine, pairs))
    return out


def _finding(profile: Profile, c: Construction, late: list[LateGather], pairs: int) -> Finding:
    steps = max(len(profile.steps), 1)
    exposed = sum(g.exposed_us for g in late) / 1000.0 / steps
    gap = statistics.median(g.gap_us for g in late)
    container = (c.module or "").rpartition(".")[0] or "blocks"
    _, unit_words = unit_notes(profile)
    facts = PrefetchFacts(
        construction_line=c.line,
        late_units=sorted({g.unit for g in late}),
        late_gathers=len(late),
        handovers=pairs,
        median_gap_us=gap,
        exposed_ms=exposed,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"{len(late)} of {pairs} forward all-gathers of these units started only after the previous "
        f"unit's compute ended (median {gap:.0f} us later): {fmt_ms(exposed)}/step the GPU waited for them",
        fix="none",
        time_ms=exposed,
        saving_ms=exposed,
        comm=comm_of(profile),
        notes=[
            "estimate: prefetching one unit ahead hides the gather behind the previous unit's compute, up to "
            "that compute's time",
            *unit_words,
        ],
        advice=f"after the fully_shard calls, for each consecutive pair of the model's `{container}`: "
        "`prev.set_modules_to_forward_prefetch([nxt])`",
        details=facts.to_details(),
    )


__all__ = ["FIX", "ID", "MIN_LATE_SHARE", "TITLE", "detect"]
