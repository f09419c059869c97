"""What the data-parallel rules (issue 34) share: the DDP / FSDP2 constructions of a profile, the rank's
measured communication (cross_rank's numbers), and a finding at the construction's statement."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from opadvisor.profile.model import Construction, Profile
from opadvisor.ranks.cross_rank import rank_stats
from opadvisor.rules._findings import fmt_ms
from opadvisor.rules._index import index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules._units import unit_comm, words
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.finding import Evidence, Finding, FixSafety

GATHER = "all_gather"


@dataclass
class Comm:
    """One rank's communication per recorded step (medians, ms) and what it was measured from."""

    basis: str  # "gpu" (NCCL kernels) or "cpu" (gloo's ranges and the c10d ops: waiting included)
    total_ms: float
    exposed_ms: float
    by_name: dict[str, float]  # collective -> ms per step
    calls: dict[str, float]  # collective -> calls per step

    @property
    def exposed_share(self) -> float:
        """The share of the communication that no compute hid."""
        return min(1.0, self.exposed_ms / self.total_ms) if self.total_ms > 0 else 0.0

    def of(self, *names: str) -> float:
        return sum(self.by_name.get(n, 0.0) for n in names)

    def gradients_ms(self) -> float:
        """Gradient reduction: every collective but the parameters' all-gathers (FSDP)."""
        return sum(ms for name, ms in self.by_name.items() if name != GATHER)

    def words(self) -> str:
        what = "NCCL kernels" if self.basis == "gpu" else "gloo's CPU ranges, waiting for peers included"
        return f"measured from {what}: {fmt_ms(self.total_ms)}/step, {fmt_ms(self.exposed_ms)} of it exposed"


def comm_of(profile: Profile) -> Comm | None:
    """This rank's measured communication, None when the window recorded no collective."""
    found = rank_stats(profile)
    if found is None:
        return None
    stats, basis = found
    return Comm(
        basis, stats.comm_ms, stats.exposed_comm_ms, dict(stats.collectives), dict(stats.calls_per_step)
    )


def constructions(profile: Profile, kind: str) -> list[Construction]:
    """The constructions of `kind` ("ddp", "fsdp") the user's own files made; NotApplicable without any."""
    found = [c for c in profile.constructions if c.kind == kind and c.file and c.line]
    if not found:
        what = "DistributedDataParallel(...)" if kind == "ddp" else "fully_shard(...)"
        raise NotApplicable(f"the script built no {what} (recorded while it ran)")
    return found


def forward_wrapper(profile: Profile) -> Construction | None:
    """The DDP wrapper or root FSDP unit whose forward the script called (it carries `grad_sync`)."""
    for c in profile.constructions:
        if c.kind in ("ddp", "fsdp") and c.file and "grad_sync" in c.attrs:
            return c
    return None


def per_step_median(construction: Construction) -> tuple[float, float] | None:
    """(backward passes, synced ones) per optimizer step, medians over the steps seen; None if unknown."""
    sync = construction.attrs.get("grad_sync")
    rows = sync.get("per_step") if isinstance(sync, dict) else None
    if not rows:
        return None
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def finding_at(
    profile: Profile,
    c: Construction,
    rule: str,
    *,
    message: str,
    fix: FixSafety,
    time_ms: float | None,
    saving_ms: float | None,
    comm: Comm | None,
    notes: list[str],
    advice: str,
    details: dict[str, Any],
) -> Finding:
    """A finding at the statement that built the wrapper (the fix goes there)."""
    assert c.file is not None and c.line is not None
    src = load_profiled_source(profile, c.file)
    start, end = src.statement_span(c.line) if src is not None else (c.line, c.line)
    ix = index_of(profile)
    share = ix.share_of_step(time_ms) if time_ms is not None else None
    basis = comm.basis if comm is not None and time_ms is not None else "none"
    return Finding(
        rule=rule,
        path=c.file,
        line=start,
        end_line=end,
        message=message,
        fix=fix,
        function=c.function,
        module=c.module,
        evidence=Evidence(time_ms_per_step=time_ms, share_of_step=share, time_basis=basis, notes=notes),  # type: ignore[arg-type]
        time_ms_per_step=time_ms,
        est_saving_ms_per_step=saving_ms,
        advice=advice,
        details=details,
    )


def unit_notes(profile: Profile) -> tuple[list[dict[str, Any]], list[str]]:
    """Every FSDP unit's collectives as plain data (most exposed first), and a note naming the top ones."""
    units = unit_comm(profile)
    if not units:
        return [], []
    how = "NCCL kernel time, exposed part" if profile.has_gpu else "sizes; times per unit need a GPU profile"
    return [asdict(u) for u in units], [f"collectives per unit ({how}): {words(units)}"]


__all__ = [
    "Comm",
    "comm_of",
    "constructions",
    "finding_at",
    "forward_wrapper",
    "per_step_median",
    "unit_notes",
]
