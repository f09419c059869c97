"""FSDP2 gathering float32 parameters while the forward runs under bfloat16 / float16 autocast.

What it finds
    `fully_shard(...)` calls (recorded at the user's line) with no MixedPrecisionPolicy param_dtype (or a
    float32 one) over float32 parameters, in a run whose wrapped model's forward ran under bf16 or fp16
    autocast (recorded at its first forward).

Why it is slow
    FSDP all-gathers every unit's parameters in their storage dtype before using them. Under autocast the
    matrix products cast those float32 parameters to 16 bits anyway: the all-gathers moved twice the bytes
    the compute needed, on every forward (and again in backward when the unit was resharded). With
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` FSDP casts the shards once and gathers half the
    bytes. The cost shown is the measured all-gather time per step (cross_rank's numbers: NCCL kernels on a
    GPU, gloo's ranges on a CPU); the saving, an estimate: half of it, times its exposed share.

Example
    fully_shard(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).loss

Fix and its safety
    `opadvisor apply --rule fsdp_fp32_gather --unsafe` adds
    `mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` (the autocast
    dtype) to every `fully_shard(...)` call of the file without one. Unsafe: the whole forward then sees
    16-bit parameters, also where autocast kept float32 (layer norms, softmax, the loss): the values change
    beyond autocast's own rounding. Gradients are still reduced in float32 and the optimizer keeps its
    float32 copy of the shards.
"""

from __future__ import annotations

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules.distributed._parallel import (
    comm_of,
    constructions,
    finding_at,
    forward_wrapper,
    unit_notes,
)
from opadvisor.rules.distributed.parallel_facts import FsdpFacts
from opadvisor.rules.finding import Finding

ID = "fsdp_fp32_gather"
TITLE = "FSDP all-gathers float32 parameters under 16-bit autocast"
FIX = "unsafe"

HALF = ("bfloat16", "float16")


def detect(profile: Profile) -> list[Finding]:
    calls = constructions(profile, "fsdp")
    root = forward_wrapper(profile)
    autocast = root.attrs.get("autocast") if root is not None else None
    if autocast not in HALF:
        return []
    fp32 = [c for c in calls if _gathers_fp32(c)]
    by_line: dict[tuple[str | None, int | None], list[Construction]] = {}
    for c in fp32:
        by_line.setdefault((c.file, c.line), []).append(c)
    return [_finding(profile, same, str(autocast), len(calls)) for same in by_line.values()]


def _gathers_fp32(c: Construction) -> bool:
    dtypes = c.attrs.get("param_dtypes") or []
    policy = c.attrs.get("mp_param_dtype")
    return dtypes == ["float32"] and policy in (None, "float32") and bool(c.attrs.get("own_params"))


def _finding(profile: Profile, calls: list[Construction], autocast: str, units: int) -> Finding:
    c = calls[0]
    comm = comm_of(profile)
    per_unit, unit_words = unit_notes(profile)
    gather = comm.of("all_gather") if comm is not None else 0.0
    time_ms = gather if gather > 0 else None
    saving = gather / 2.0 * comm.exposed_share if time_ms is not None and comm is not None else None
    params = sum(int(x.attrs.get("own_params") or 0) for x in calls)
    measured = (
        f"all-gather {fmt_ms(time_ms)}/step of {units} unit(s) ({comm.words()})"
        if time_ms is not None and comm is not None
        else "no all-gather was recorded in the window"
    )
    facts = FsdpFacts(
        construction_line=c.line,
        module=c.module,
        own_params=params,
        autocast=autocast,
        param_dtypes=list(c.attrs.get("param_dtypes") or []),
        mp_param_dtype=c.attrs.get("mp_param_dtype"),
        given=list(c.attrs.get("given") or []),
        units=per_unit,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"{len(calls)} fully_shard unit(s) here gather {params:,} float32 parameters while the forward "
        f"runs under {autocast} autocast: twice the bytes; {measured}",
        fix="unsafe",
        time_ms=time_ms,
        saving_ms=saving,
        comm=comm,
        notes=[
            f"estimate: {autocast} all-gathers move half the bytes: half the all-gather time, times its exposed "
            "share",
            "unsafe: parameters autocast keeps in float32 (norms, softmax, loss) become 16-bit",
            *unit_words,
        ],
        advice=f"pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.{autocast}, reduce_dtype=torch.float32) "
        "to fully_shard",
        details=facts.to_details(),
    )


__all__ = ["FIX", "ID", "TITLE", "detect"]
