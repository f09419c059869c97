"""FSDP2 units that free their gathered parameters after forward and gather them again for backward,
where the measured peak memory leaves room to keep them.

What it finds
    `fully_shard(...)` calls (recorded at the user's line) left at `reshard_after_forward=True` (given, or
    FSDP2's default for every unit but the root) whose unit's parameters were all-gathered a second time
    in backward: the profile attributes each all-gather to its unit by FSDP2's ranges, and one issued
    inside `FSDP::pre_backward (unit)` or `FSDP::backward_prefetch for unit` is a backward gather. It
    reports them only where the step's measured CUDA peak (`peak_allocated_bytes`) plus the unsharded size
    of those units (kept from forward to backward after the fix) stays within MEMORY_FRACTION of the GPU's
    memory (`gpu_memory_bytes`); the numbers are in the finding. On a profile without GPU memory facts (a
    CPU / gloo run) it says it cannot judge the memory and reports nothing.

Why it is slow
    Resharding after forward frees each unit's gathered parameters as soon as its forward ends, so the
    backward must all-gather every unit once more: a second all-gather of the whole model per step, which
    the backward waits for where no compute hides it (measured on the NCCL kernels: the exposed part).
    With `reshard_after_forward=False` the parameters stay gathered from forward to backward: no backward
    all-gather, at the cost of holding the unsharded parameters of every unit through the step. Measured by
    hand on 2 H200s (GPT-2-medium, one unit per block): 617 -> 442 ms/step.

Example
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Fix and its safety
    `opadvisor apply --rule fsdp_reshard --unsafe` writes `reshard_after_forward=False` in the reported
    calls (the per-block calls where the script shards per block; the root's call where it passed
    `reshard_after_forward=True` there). Unsafe: the same values, but memory grows by the unsharded
    parameters of those units (the finding's estimate); a run near the limit, or a larger batch later, can
    run out of memory. The cost shown is the backward all-gather time per step, the saving its exposed part
    (an estimate: the gathers go away; the forward ones remain).
"""

from __future__ import annotations

from dataclasses import dataclass

from opadvisor.profile.model import Construction, Profile
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules._units import UnitComm, backward_gathers, dtype_bytes
from opadvisor.rules.distributed._parallel import comm_of, constructions, finding_at, unit_notes
from opadvisor.rules.distributed.parallel_facts import ReshardFacts
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.finding import Finding

ID = "fsdp_reshard"
TITLE = "FSDP reshards after forward where memory allows keeping the parameters"
FIX = "unsafe"

MEMORY_FRACTION = 0.85  # keep the parameters only where the estimated peak stays within this share of the GPU


@dataclass
class Memory:
    """The memory facts the judgement rests on (bytes)."""

    peak: int  # the largest per-step CUDA peak of the window
    device: int  # the GPU's memory
    kept: int  # the unsharded parameters of the units the fix keeps gathered

    @property
    def after(self) -> int:
        return self.peak + self.kept

    @property
    def fits(self) -> bool:
        return self.after <= MEMORY_FRACTION * self.device

    def words(self) -> str:
        return (
            f"peak {_size(self.peak)} + {_size(self.kept)} kept gathered = {_size(self.after)} of "
            f"{_size(self.device)} ({self.after / self.device:.0%}; limit {MEMORY_FRACTION:.0%})"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def detect(profile: Profile) -> list[Finding]:
    calls = [c for c in constructions(profile, "fsdp") if _reshards(c)]
    again = {u.unit: u for u in backward_gathers(profile)}
    regathered = [(c, again[c.module]) for c in calls if c.module is not None and c.module in again]
    if not regathered:
        return []
    memory = _memory(profile, [c for c, _ in regathered])
    if memory is None:
        raise NeedsGpuProfile(
            "whether the GPU's memory leaves room to keep the gathered parameters (peak_allocated_bytes, "
            "gpu_memory_bytes)",
            hint=f"{len(regathered)} unit(s) all-gathered their parameters again in backward",
        )
    if not memory.fits:
        return []
    by_line: dict[tuple[str | None, int | None], list[tuple[Construction, UnitComm]]] = {}
    for c, u in regathered:
        by_line.setdefault((c.file, c.line), []).append((c, u))
    return [_finding(profile, same, memory) for same in by_line.values()]


def _reshards(c: Construction) -> bool:
    """Whether the call leaves the unit resharding after forward (None: FSDP2's default; an int reshards to
    a smaller group, a choice of its own, left alone)."""
    value = c.attrs.get("reshard_after_forward")
    return value is None or value is True


def _unsharded_bytes(c: Construction) -> int:
    """The unit's gathered parameters: its own parameters in the dtype they are gathered in."""
    dtypes = c.attrs.get("param_dtypes") or []
    dtype = c.attrs.get("mp_param_dtype") or (dtypes[0] if len(dtypes) == 1 else "float32")
    return int(c.attrs.get("own_params") or 0) * (dtype_bytes(dtype) or 4)


def _memory(profile: Profile, kept: list[Construction]) -> Memory | None:
    peak, _ = profile.peak_memory()
    device = profile.environment.gpu_memory_bytes
    if peak is None or not device:
        return None
    return Memory(peak=peak, device=device, kept=sum(_unsharded_bytes(c) for c in kept))


def _finding(profile: Profile, units: list[tuple[Construction, UnitComm]], memory: Memory) -> Finding:
    c = units[0][0]
    gathers = [u for _, u in units]
    timed = all(u.ms_per_step is not None for u in gathers)
    time_ms = sum(u.ms_per_step or 0.0 for u in gathers) if timed else None
    exposed = sum(u.exposed_ms_per_step or 0.0 for u in gathers) if timed else None
    calls = sum(u.calls_per_step for u in gathers)
    measured = (
        f"backward all-gathers {fmt_ms(time_ms)}/step, {fmt_ms(exposed)} of it exposed (NCCL kernels)"
        if time_ms is not None
        else "backward all-gathers not timed (a CPU profile)"
    )
    root = any(x.attrs.get("root") for x, _ in units)
    where = "the root's call" if root else f"{len(units)} unit(s) of this call"
    _, unit_words = unit_notes(profile)
    facts = ReshardFacts(
        construction_line=c.line,
        modules=[x.module or "" for x, _ in units],
        root=root,
        backward_gathers_per_step=calls,
        backward_gather_ms=time_ms,
        backward_gather_exposed_ms=exposed,
        peak_allocated_bytes=memory.peak,
        gpu_memory_bytes=memory.device,
        kept_bytes=memory.kept,
        memory_fraction=MEMORY_FRACTION,
    )
    return finding_at(
        profile,
        c,
        ID,
        message=f"{where} reshard(s) after forward and gather again in backward "
        f"({calls:g} all-gather(s)/step): "
        f"{measured}; memory allows keeping them: {memory.words()}",
        fix="unsafe",
        time_ms=time_ms,
        saving_ms=exposed,
        comm=comm_of(profile),
        notes=[
            "estimate: the backward all-gathers go away; the saving is their exposed part",
            f"memory after the fix (estimate): {memory.words()}",
            "unsafe: the unsharded parameters stay in memory from forward to backward",
            *unit_words,
        ],
        advice="pass reshard_after_forward=False to fully_shard",
        details=facts.to_details(),
    )


__all__ = ["FIX", "ID", "MEMORY_FRACTION", "TITLE", "detect"]
