"""Cross-rank analysis of a multi-process run: step time per rank, stragglers, and communication.

    from opadvisor.ranks import cross_rank

    report = cross_rank.analyse(profiles)     # the per-rank profiles of one run, any order
    console.print(cross_rank.render(report))  # a rich renderable
    data = cross_rank.to_json(report)         # a JSON-ready dict (suggest's JSON embeds it)

A pure function of the profiles; the single-rank rules run on every rank elsewhere (`rules.engine`).

What it measures, per rank and step (steps are matched across ranks by index: under DDP every rank runs
the same iterations in lockstep):
- communication: the union of the intervals in which a collective ran. The *basis* depends on the
  profile and is always reported:
  - "gpu": NCCL kernels (a kernel named nccl*), on a CUDA profile;
  - "cpu": on a CPU profile (gloo) there are no kernels; the gloo collectives run on gloo's own threads
    as `gloo:<collective>` ranges, and the calls into them are `c10d::<collective>` ops on the training
    thread (a blocking `dist.all_reduce` waits inside that op): the union of both. A collective's time
    includes the time it waits for the slowest rank to join it.
- compute: the union of every other kernel (gpu), or of the top-level ops of the training threads
  outside the communication intervals (cpu).
- exposed communication: communication time with no compute beside it; `overlap` = the share of the
  communication hidden behind compute.
- the run's communication *cost* (`comm_ms`, `exposed_comm_ms`, `overlap`) is read, step by step, on the
  rank that waited least (the last to join each collective): its collectives hold no waiting for others.
  What the other ranks spend beyond that is waiting (`wait_ms`: the largest gap, median over steps). A
  straggler therefore shows as waiting, not as expensive communication, and does not prompt the
  communication advice below.
- work: the step time (the GPU's span of the step on CUDA, else its wall time) minus the exposed
  communication: the time the rank needed for itself. Under DDP every rank's step takes as long as the
  slowest rank's work plus the transfer, so a rank's own slowness shows as *less* waiting in collectives
  than its peers, not as a longer step.

A *straggler* is a rank whose work is the largest in most steps (STRAGGLER_MIN_STEP_SHARE of them) and
larger than the median work of the other ranks by at least STRAGGLER_MIN_SHARE of the median step: it
sets the pace and the others wait for it. The report says by how much (ms/step, share of the step), how
much the others wait, and which ops and ranges take longer on that rank than on the others.

Advice (each item says what was measured that prompted it):
- "straggler": look at what differs on that rank (its data, rank-specific work such as logging on rank 0,
  its host or GPU), with the ops that take longer there;
- "overlap" / "bucket_size": exposed communication (cost) of at least EXPOSED_MIN_SHARE of the step while
  gradients go out in one DDP bucket per step: a smaller `bucket_cap_mb` lets early buckets reduce while
  backward goes on; with several buckets and still little overlap, larger buckets (fewer messages);
- "grad_accumulation": communication (cost) of at least COMM_HEAVY_SHARE of the step: accumulate gradients
  over micro-batches under `ddp.no_sync()`, so one all-reduce serves several micro-batches;
- "loop_collective": collectives called from the training loop itself (not from DDP's backward hooks),
  e.g. an all-reduce of the loss for logging every step, with their file:line: they overlap nothing.
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from opadvisor.profile.intervals import Interval, interval_union, length, subtract
from opadvisor.profile.model import Profile, Step
from opadvisor.rules.overview import fmt_ms, fmt_share

__all__ = [
    "Advice",
    "CrossRankReport",
    "RankStats",
    "Straggler",
    "analyse",
    "rank_stats",
    "render",
    "to_json",
]

JSON_SCHEMA = 1
STRAGGLER_MIN_SHARE = 0.05  # the straggler's extra work per step, as a share of the median step
STRAGGLER_MIN_STEP_SHARE = 0.75  # ... and it is the slowest rank in at least this share of the steps
EXPOSED_MIN_SHARE = 0.10  # exposed communication worth advice, as a share of the step
COMM_HEAVY_SHARE = 0.25  # communication this large suggests communicating less often
_OVERLAP_LOW = 0.5

Basis = Literal["gpu", "cpu", "none"]


# ---- the report ---------------------------------------------------------------------------------


@dataclass
class RankStats:
    """One rank, medians over its recorded steps (ms per step)."""

    rank: int
    steps: int
    step_ms: float
    comm_ms: float
    exposed_comm_ms: float
    work_ms: float
    overlap: float | None  # share of communication hidden behind compute; None without communication
    collectives: dict[str, float] = field(default_factory=dict)  # "all_reduce" -> ms/step
    calls_per_step: dict[str, float] = field(default_factory=dict)  # "all_reduce" -> calls/step
    complete: bool = True


@dataclass
class Straggler:
    rank: int
    extra_ms: float  # its work minus the median of the others', per step (median over steps)
    share: float  # extra_ms over the median step time
    slowest_steps: int  # steps in which it was the slowest rank
    steps: int
    others_wait_ms: float  # how much more the other ranks spend in exposed communication, per step
    differing: list[tuple[str, float]] = field(default_factory=list)  # (op or range, extra ms/step)


@dataclass
class Advice:
    id: str  # "straggler" | "overlap" | "bucket_size" | "grad_accumulation" | "loop_collective"
    message: str
    path: str | None = None
    line: int | None = None


@dataclass
class CrossRankReport:
    world_size: int
    ranks: list[RankStats]
    missing_ranks: list[int]
    basis: Basis
    basis_detail: str  # in words: what the communication times were read from
    device: str
    step_ms: float | None  # median over ranks of the per-rank median step
    # The cost of communication itself, read per step on the rank that waited least (the last to join
    # each collective): medians over steps of the per-step minimum over ranks. None without collectives.
    comm_ms: float | None
    exposed_comm_ms: float | None
    overlap: float | None  # share of that communication hidden behind compute
    wait_ms: float | None  # the rest: how much longer the most-waiting rank sat exposed in collectives
    straggler: Straggler | None
    advice: list[Advice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---- per rank -------------------------------------------------------------------------------------

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _nccl_collective(kernel_name: str) -> str | None:
    """ "ncclDevKernel_AllReduce_Sum_f32_RING_LL" -> "all_reduce"; None for a kernel that is not NCCL's."""
    if not kernel_name.lower().startswith("nccl"):
        return None
    parts = kernel_name.split("_")
    word = parts[1] if len(parts) > 1 else parts[0]
    return _CAMEL.sub("_", word).lower()


def _c10d_collective(op_name: str) -> str | None:
    """ "c10d::allreduce_" -> "all_reduce", "c10d::_allgather_base_" -> "all_gather"; None for other ops."""
    if not op_name.startswith("c10d::"):
        return None
    name = op_name.split("::", 1)[1].strip("_")
    for suffix in ("_coalesced", "_into_tensor", "_tensor", "_base"):
        name = name.replace(suffix, "")
    return _C10D_NAMES.get(name, name)


_C10D_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}


@dataclass
class _StepComm:
    step_ms: float
    comm_us: float
    exposed_us: float
    collectives: dict[str, float]  # name -> us
    calls: dict[str, int]
    untracked_us: float  # cpu: in no op, range or collective (Python, sleeps, I/O); gpu: no kernel running


def _basis(profile: Profile) -> Basis:
    if profile.has_gpu and any(_nccl_collective(k.name) for o in profile.ops for k in o.kernels):
        return "gpu"
    if any(a.name.startswith("gloo:") for a in profile.annotations):
        return "cpu"
    if not profile.has_gpu and any(_c10d_collective(o.name) for o in profile.ops):
        return "cpu"  # a CPU backend without gloo's ranges: the c10d ops alone
    # On a GPU, c10d ops without NCCL kernels only say when work was queued, not how long it ran.
    return "none"


@dataclass
class _Intervals:
    """A rank's intervals (us) by step index: communication, compute, per collective, and (cpu) the named
    ranges of the training threads; the calls of each collective."""

    comm: dict[int, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    compute: dict[int, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    by_name: dict[int, dict[str, list[Interval]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    calls: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    ranges: dict[int, list[Interval]] = field(default_factory=lambda: defaultdict(list))


def _per_step(profile: Profile, basis: Basis) -> list[_StepComm]:
    found = _Intervals()
    if basis == "gpu":
        _gpu_intervals(profile, found)
    elif basis == "cpu":
        _cpu_intervals(profile, found)
    return [_step_comm(profile.steps[i], i, basis, found) for i in range(len(profile.steps))]


def _gpu_intervals(profile: Profile, found: _Intervals) -> None:
    """NCCL kernels are communication, every other kernel compute."""
    for op in profile.ops:
        if op.step is None:
            continue
        for k in op.kernels:
            iv = (k.start_us, k.start_us + k.duration_us)
            name = _nccl_collective(k.name)
            if name is None:
                found.compute[op.step].append(iv)
            else:
                found.comm[op.step].append(iv)
                found.by_name[op.step][name].append(iv)
                found.calls[op.step][name] += 1


def _cpu_intervals(profile: Profile, found: _Intervals) -> None:
    """gloo's ranges and the c10d ops are communication; the training threads' top-level ops compute."""
    comm, by_name, calls = found.comm, found.by_name, found.calls
    comm_threads = set()
    for a in profile.annotations:
        if a.step is not None and a.name.startswith("gloo:"):
            iv = (a.start_us, a.start_us + a.duration_us)
            comm[a.step].append(iv)
            by_name[a.step][a.name.split(":", 1)[1]].append(iv)
            calls[a.step][a.name.split(":", 1)[1]] += 1
            comm_threads.add(a.thread)
    gloo_ranges = bool(comm)
    for op in profile.ops:
        if op.step is None:
            continue
        name = _c10d_collective(op.name)
        if name is not None:
            iv = (op.start_us, op.end_us)
            comm[op.step].append(iv)
            by_name[op.step][name].append(iv)
            if not gloo_ranges:
                calls[op.step][name] += 1
        elif op.parent is None and op.thread not in comm_threads:
            found.compute[op.step].append((op.start_us, op.end_us))
    for a in profile.annotations:
        if a.step is not None and a.thread not in comm_threads:
            found.ranges[a.step].append((a.start_us, a.start_us + a.duration_us))


def _step_comm(s: Step, i: int, basis: Basis, found: _Intervals) -> _StepComm:
    """Step `i`'s communication, exposed communication and untracked time."""
    comm_u = interval_union(found.comm.get(i, ()))
    compute_u = (
        subtract(interval_union(found.compute.get(i, ())), comm_u)
        if basis == "cpu"
        else interval_union(found.compute.get(i, ()))
    )
    exposed = length(subtract(comm_u, compute_u))
    step_ms = s.gpu_span_ms if basis == "gpu" and s.gpu_span_ms else s.wall_ms
    if basis == "gpu":
        untracked = max(step_ms * 1000.0 - length(interval_union([*comm_u, *compute_u])), 0.0)
    else:
        covered = interval_union([*comm_u, *found.compute.get(i, ()), *found.ranges.get(i, ())])
        untracked = length(subtract([(s.start_us, s.end_us)], covered))
    return _StepComm(
        step_ms=step_ms,
        comm_us=length(comm_u),
        exposed_us=exposed,
        collectives={n: length(interval_union(v)) for n, v in found.by_name.get(i, {}).items()},
        calls=dict(found.calls.get(i, {})),
        untracked_us=untracked,
    )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _rank_stats(profile: Profile, steps: list[_StepComm]) -> RankStats:
    comm = [s.comm_us / 1000.0 for s in steps]
    exposed = [s.exposed_us / 1000.0 for s in steps]
    names = sorted({n for s in steps for n in s.collectives})
    total_comm = sum(comm)
    return RankStats(
        rank=profile.rank,
        steps=len(steps),
        step_ms=_median([s.step_ms for s in steps]),
        comm_ms=_median(comm),
        exposed_comm_ms=_median(exposed),
        work_ms=_median([s.step_ms - s.exposed_us / 1000.0 for s in steps]),
        overlap=(1.0 - sum(exposed) / total_comm) if total_comm > 0 else None,
        collectives={n: _median([s.collectives.get(n, 0.0) for s in steps]) / 1000.0 for n in names},
        calls_per_step={n: sum(s.calls.get(n, 0) for s in steps) / len(steps) for n in names},
        complete=profile.complete,
    )


def rank_stats(profile: Profile) -> tuple[RankStats, Basis] | None:
    """One rank's communication, medians per recorded step, and what it was measured from; None when the
    profile recorded no collective (or, on a GPU, no NCCL kernel) or no step. The rules of issue 34 read
    their measured cost here (a rule sees one rank's profile at a time)."""
    basis = _basis(profile)
    if basis == "none" or not profile.steps:
        return None
    return _rank_stats(profile, _per_step(profile, basis)), basis


# ---- across ranks ----------------------------------------------------------------------------------


def analyse(profiles: Sequence[Profile]) -> CrossRankReport:
    """The cross-rank report of one run's per-rank profiles (at least one)."""
    if not profiles:
        raise ValueError("cross_rank.analyse needs at least one profile")
    profiles = sorted(profiles, key=lambda p: p.rank)
    world = max(max(p.world_size for p in profiles), len(profiles))
    present = {p.rank for p in profiles}
    bases = {_basis(p) for p in profiles}
    basis: Basis = "gpu" if "gpu" in bases else ("cpu" if "cpu" in bases else "none")
    per_rank = {p.rank: _per_step(p, basis) for p in profiles}
    n = min(len(s) for s in per_rank.values())
    stats = [_rank_stats(p, per_rank[p.rank][:n] or per_rank[p.rank]) for p in profiles]
    report = CrossRankReport(
        world_size=world,
        ranks=stats,
        missing_ranks=[r for r in range(world) if r not in present],
        basis=basis,
        basis_detail=_basis_words(basis),
        device=profiles[0].environment.gpu_name or profiles[0].environment.device.upper(),
        step_ms=_median([s.step_ms for s in stats]) if n else None,
        comm_ms=None,
        exposed_comm_ms=None,
        overlap=None,
        wait_ms=None,
        straggler=None,
    )
    if basis != "none" and n:
        steps = [[per_rank[p.rank][i] for p in profiles] for i in range(n)]
        report.comm_ms = _median([min(s.comm_us for s in step) / 1000.0 for step in steps])
        report.exposed_comm_ms = _median([min(s.exposed_us for s in step) / 1000.0 for step in steps])
        report.wait_ms = _median(
            [(max(s.exposed_us for s in st) - min(s.exposed_us for s in st)) / 1000.0 for st in steps]
        )
        if report.comm_ms > 0:
            report.overlap = max(0.0, 1.0 - report.exposed_comm_ms / report.comm_ms)
    report.notes += _notes(profiles, per_rank, report)
    if len(profiles) > 1 and n:
        report.straggler = _straggler(profiles, per_rank, n, report.step_ms or 0.0, basis)
    report.advice = _advice(profiles, report)
    return report


def _basis_words(basis: Basis) -> str:
    if basis == "gpu":
        return "NCCL kernels on the GPU"
    if basis == "cpu":
        return "CPU time of the collectives (gloo: ranges on gloo's threads and c10d ops): no GPU kernels"
    return "no collectives were recorded"


def _notes(
    profiles: Sequence[Profile], per_rank: dict[int, list[_StepComm]], report: CrossRankReport
) -> list[str]:
    notes = []
    if report.missing_ranks:
        notes.append(
            f"no profile from rank(s) {_list(report.missing_ranks)} of {report.world_size}: "
            "the comparison covers the ranks present"
        )
    incomplete = [p.rank for p in profiles if not p.complete]
    if incomplete:
        notes.append(
            f"rank(s) {_list(incomplete)} did not record the whole window (the run ended or failed early)"
        )
    counts = {len(v) for v in per_rank.values()}
    if len(counts) > 1:
        notes.append(
            f"ranks recorded different numbers of steps ({_list(sorted(counts))}); compared the first {min(counts)}"
        )
    if report.basis == "cpu":
        notes.append("communication times include waiting for the slowest rank to join each collective")
    if report.basis == "none" and any(_c10d_collective(o.name) for p in profiles for o in p.ops):
        notes.append(
            "collectives were called (c10d ops) but no NCCL kernel was recorded: communication time unknown"
        )
    elif report.basis == "none" and len(profiles) > 1:
        notes.append("no collective was recorded: the ranks did not communicate inside the window")
    return notes


def _straggler(
    profiles: Sequence[Profile], per_rank: dict[int, list[_StepComm]], n: int, step_ms: float, basis: Basis
) -> Straggler | None:
    ranks = [p.rank for p in profiles]
    work = {r: [s.step_ms - s.exposed_us / 1000.0 for s in per_rank[r][:n]] for r in ranks}
    slowest = [max(ranks, key=lambda r: work[r][i]) for i in range(n)]
    candidate = max(set(slowest), key=lambda r: (slowest.count(r), -r))
    count = slowest.count(candidate)
    if count < STRAGGLER_MIN_STEP_SHARE * n:
        return None
    extra = _median(
        [work[candidate][i] - _median([work[r][i] for r in ranks if r != candidate]) for i in range(n)]
    )
    if step_ms <= 0 or extra < STRAGGLER_MIN_SHARE * step_ms:
        return None
    exposed = {r: _median([s.exposed_us / 1000.0 for s in per_rank[r][:n]]) for r in ranks}
    others_wait = _median([exposed[r] for r in ranks if r != candidate]) - exposed[candidate]
    by_rank = {p.rank: p for p in profiles}
    return Straggler(
        rank=candidate,
        extra_ms=extra,
        share=extra / step_ms,
        slowest_steps=count,
        steps=n,
        others_wait_ms=max(others_wait, 0.0),
        differing=_differing(
            by_rank[candidate], [by_rank[r] for r in ranks if r != candidate], per_rank, n, basis
        ),
    )


def _time_by_name(profile: Profile, basis: Basis) -> dict[str, float]:
    """ms/step per top-level op name and per range (DataLoader, optimizer step ...), communication left out."""
    steps = max(len(profile.steps), 1)
    totals: dict[str, float] = defaultdict(float)
    roots: dict[int, int] = {}  # op id -> id of its top-level op (parents come before children)
    for op in profile.ops:
        roots[op.id] = op.id if op.parent is None else roots.get(op.parent, op.parent)
        root = profile.ops[roots[op.id]]
        if op.step is None or _c10d_collective(root.name):
            continue
        name = root.name.rsplit(": ", 1)[-1]
        if basis == "gpu":  # kernels sit on nested ops: each counts for its top-level op
            totals[name] += sum(k.duration_us for k in op.kernels if not _nccl_collective(k.name))
        elif op.parent is None:
            totals[name] += op.duration_us
    for a in profile.annotations:
        if a.step is not None and not a.name.startswith(("gloo:", "nccl:")):
            totals[a.name] += a.duration_us
    return {k: v / 1000.0 / steps for k, v in totals.items()}


def _untracked_name(basis: Basis) -> str:
    return (
        "GPU idle (no kernel running)" if basis == "gpu" else "time in no torch op (Python code, sleeps, I/O)"
    )


def _differing(
    slow: Profile,
    others: list[Profile],
    per_rank: dict[int, list[_StepComm]],
    n: int,
    basis: Basis,
    top: int = 3,
) -> list[tuple[str, float]]:
    """What takes longer on the slow rank than (the median of) the others: ops, ranges, untracked time."""

    def by_name(p: Profile) -> dict[str, float]:
        times = _time_by_name(p, basis)
        times[_untracked_name(basis)] = _median([s.untracked_us / 1000.0 for s in per_rank[p.rank][:n]])
        return times

    mine = by_name(slow)
    theirs = [by_name(p) for p in others]
    extra = {name: ms - _median([t.get(name, 0.0) for t in theirs]) for name, ms in mine.items()}
    ranked = sorted(((n, e) for n, e in extra.items() if e > 0), key=lambda kv: -kv[1])
    return ranked[:top]


def _loop_collectives(profile: Profile) -> list[tuple[str, str, int, float]]:
    """(collective, file, line, calls/step) of collectives called from Python, not from autograd hooks."""
    steps = max(len(profile.steps), 1)
    # FSDP2 gathers a unit's parameters from its module's forward hook: the op's Python line is the model
    # call in the loop, but FSDP issued it (the fsdp_* rules speak for those, at the fully_shard line)
    fsdp = _fsdp_ranges(profile)
    sites: dict[tuple[str, str, int], int] = defaultdict(int)
    for op in profile.ops:
        name = _c10d_collective(op.name)
        if not (name and op.step is not None and not op.is_backward and op.file and op.line):
            continue
        if not _inside(op.start_us, fsdp.get(op.thread, [])):
            sites[(name, op.file, op.line)] += 1
    return [(n, f, line, c / steps) for (n, f, line), c in sorted(sites.items(), key=lambda kv: -kv[1])]


def _fsdp_ranges(profile: Profile) -> dict[int, list[Interval]]:
    """Per thread, the union of FSDP2's own ranges (`FSDP::all_gather (unit)`, `FSDP::pre_forward`, ...)."""
    spans: dict[int, list[Interval]] = defaultdict(list)
    for a in profile.annotations:
        if a.name.startswith("FSDP::"):
            spans[a.thread].append((a.start_us, a.start_us + a.duration_us))
    return {thread: interval_union(s) for thread, s in spans.items()}


def _inside(t: float, spans: list[Interval]) -> bool:
    i = bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t <= spans[i][1]


def _advice(profiles: Sequence[Profile], report: CrossRankReport) -> list[Advice]:
    out: list[Advice] = []
    step = report.step_ms or 0.0
    if report.straggler is not None:
        out.append(_straggler_advice(report.straggler))
    if report.basis == "none" or not step or report.comm_ms is None:
        return out
    exposed_share = (report.exposed_comm_ms or 0.0) / step
    comm_share = report.comm_ms / step
    backward_calls = _backward_collectives_per_step(profiles)
    measured = (
        f"Communication costs {fmt_ms(report.comm_ms)}/step, {fmt_share(report.overlap or 0.0)} of it overlapped "
        f"with compute: {fmt_ms(report.exposed_comm_ms)}/step exposed ({fmt_share(exposed_share)} of the step)"
    )
    # FSDP shards parameters and reduce-scatters per unit: DDP's bucket and no_sync advice does not apply
    # (the fsdp_* and grad_accum_sync rules speak for it, at the fully_shard line)
    fsdp = any(c.kind == "fsdp" for p in profiles for c in p.constructions)
    if not fsdp and exposed_share >= EXPOSED_MIN_SHARE and (report.overlap or 0.0) < _OVERLAP_LOW:
        if backward_calls is not None and backward_calls <= 1.0:
            out.append(
                Advice(
                    "bucket_size",
                    f"{measured}. The gradients go out in one DDP bucket per step, so the all-reduce starts only "
                    "when the whole backward is done and nothing overlaps it: a smaller bucket "
                    "(DDP(model, bucket_cap_mb=...), default 25) lets the first buckets reduce while backward "
                    "goes on.",
                )
            )
        else:
            n = f"{backward_calls:.0f} " if backward_calls else ""
            out.append(
                Advice(
                    "overlap",
                    f"{measured}. DDP sends {n}buckets per step and still little of it overlaps: the last "
                    "buckets wait for the end of backward. Larger buckets (bucket_cap_mb) mean fewer, faster "
                    "messages; `gradient_as_bucket_view=True` saves a copy; check that nothing in backward "
                    "synchronises (a hook calling .item()).",
                )
            )
    if comm_share >= COMM_HEAVY_SHARE and not fsdp:
        out.append(
            Advice(
                "grad_accumulation",
                f"Communication costs {fmt_ms(report.comm_ms)}/step, {fmt_share(comm_share)} of the step. Accumulate "
                "gradients over several micro-batches and all-reduce once: run the backward of all but the last "
                "micro-batch under `with ddp.no_sync():`. A larger per-rank batch, where memory allows, does the "
                "same.",
            )
        )
    out.extend(_loop_collective_advice(profiles[0]))
    return out


def _straggler_advice(s: Straggler) -> Advice:
    where = (
        "; it spends longer in " + ", ".join(f"{n} (+{fmt_ms(ms)}/step)" for n, ms in s.differing)
        if s.differing
        else ""
    )
    return Advice(
        "straggler",
        f"rank {s.rank} is the slowest in {s.slowest_steps} of {s.steps} steps, by {fmt_ms(s.extra_ms)}/step "
        f"({fmt_share(s.share)} of the step); the other ranks wait about {fmt_ms(s.others_wait_ms)}/step "
        f"for it in their collectives{where}. Look at what differs on rank {s.rank}: its share of the "
        "data (uneven batches or sequence lengths), work only it does (logging, .item(), evaluation or "
        "checkpoints on one rank), or its host and device (CPU contention, a slower or throttled GPU).",
    )


def _loop_collective_advice(profile: Profile) -> list[Advice]:
    """Collectives called from the training loop itself (the first three), with their file:line."""
    return [
        Advice(
            "loop_collective",
            f"{name} called from the training loop {per_step:.0f}x per step (not from DDP's backward hooks): "
            "it waits for every rank and overlaps nothing. If it only feeds a log line, do it every N steps.",
            path=path,
            line=line,
        )
        for name, path, line, per_step in _loop_collectives(profile)[:3]
    ]


def _backward_collectives_per_step(profiles: Sequence[Profile]) -> float | None:
    """Collectives launched during backward (DDP's bucket all-reduces) per step, median over ranks."""
    counts = []
    for p in profiles:
        if not p.steps:
            continue
        n = sum(1 for o in p.ops if o.step is not None and o.is_backward and _c10d_collective(o.name))
        counts.append(n / len(p.steps))
    return _median(counts) if counts else None


def _list(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values)


# ---- output ---------------------------------------------------------------------------------------


def to_json(report: CrossRankReport) -> dict[str, Any]:
    """The report as a JSON-ready dict, versioned by `schema` (suggest's JSON carries it as `cross_rank`)."""
    data = asdict(report)
    if report.straggler is not None:
        data["straggler"]["differing"] = [{"name": n, "extra_ms": ms} for n, ms in report.straggler.differing]
    return {"schema": JSON_SCHEMA, **data}


def render(report: CrossRankReport, *, brief: bool = False):
    """A rich renderable: the headline, a table of ranks, the straggler and (unless brief) the advice."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text()
    head.append(f"{len(report.ranks)} of {report.world_size} rank(s)", style="bold")
    head.append(f" on {report.device}")
    if report.step_ms is not None:
        head.append(f", median step {fmt_ms(report.step_ms)}")
    if report.comm_ms is not None and report.step_ms:
        head.append(
            f"; communication {fmt_ms(report.comm_ms)}/step, {fmt_share(report.overlap)} overlapped, "
            f"exposed {fmt_ms(report.exposed_comm_ms)}/step ({fmt_share((report.exposed_comm_ms or 0) / report.step_ms)})"
        )
        if len(report.ranks) > 1:
            head.append(f"; waiting for other ranks up to {fmt_ms(report.wait_ms)}/step")
    head.append(
        f"\nCommunication measured from: {report.basis_detail}; its cost is read on the rank that waits least",
        style="dim",
    )
    table = Table(box=None, title="Per rank (medians per step)", title_justify="left")
    for col in ("rank", "steps", "step", "work", "comm", "exposed", "overlap", "collectives"):
        table.add_column(col, justify="left" if col == "collectives" else "right")
    slow = report.straggler.rank if report.straggler else None
    for s in report.ranks:
        colls = ", ".join(f"{n} {s.calls_per_step[n]:.0f}x {fmt_ms(ms)}" for n, ms in s.collectives.items())
        table.add_row(
            f"{s.rank}{' (slow)' if s.rank == slow else ''}",
            str(s.steps),
            fmt_ms(s.step_ms),
            fmt_ms(s.work_ms),
            fmt_ms(s.comm_ms) if report.basis != "none" else "-",
            fmt_ms(s.exposed_comm_ms) if report.basis != "none" else "-",
            fmt_share(s.overlap) if s.overlap is not None else "-",
            colls or "-",
            style="bold" if s.rank == slow else None,
        )
    parts: list[Any] = [head, table]
    if report.straggler is None and len(report.ranks) > 1:
        parts.append(Text("No straggler: no rank is consistently slower than the others."))
    items = [a for a in report.advice if not brief or a.id == "straggler"]
    for a in items:
        where = f"{a.path}:{a.line}: " if a.path else ""
        parts.append(Text(f"- [{a.id}] {where}{a.message}"))
    for note in report.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)
