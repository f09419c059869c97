"""The host waits for the GPU inside the training step (`.item()`, `.cpu()`, `print(tensor)`, `if tensor:`).

What it finds
    Device-to-host synchronisations recorded inside the steps of a CUDA profile, grouped by the user line
    that caused them: `.item()` / `float(t)` (aten::_local_scalar_dense), `.cpu()` / `.tolist()` /
    `.numpy()` (a device-to-host aten::copy_), `if t:` / `bool(t)` (aten::is_nonzero), and ops whose output
    size depends on the data (`nonzero`, boolean-mask indexing, `unique`, `masked_select`). For each line:
    how many times per step it synchronised and how long the GPU then sat idle. Host-to-device copies from
    pageable memory also block the host; they belong to `dataloader_stall` and are not reported here, nor
    are waits inside the DataLoader or `torch.cuda.synchronize()` calls (no op points at them).

Why it is slow
    CUDA runs asynchronously: the host queues kernels and runs ahead while the GPU works. A
    synchronisation makes the host wait until the GPU has drained its queue; when the host resumes, the
    GPU has nothing queued and idles until the host has launched the next kernel (Python, the autograd
    engine and launch latency: tens of microseconds to milliseconds, every time). The cost is that idle
    time, measured here from the profile's GPU idle gaps (scaled to the plain step when the run timed one:
    see opadvisor/rules/_calibration.py).

Example
    for batch in loader:
        loss = model(batch).mean()
        loss.backward(); opt.step()
        print(f"loss {loss.item():.4f}")        # waits for the GPU every step

Fix and its safety
    No automatic fix (none): moving a sync changes what the program prints or decides. Keep metrics on
    the device (`running += loss.detach()`) and read them every N steps, log asynchronously, replace
    data-dependent ops by fixed-size ones (`torch.where`), and copy to the host with
    `.to("cpu", non_blocking=True)` into pinned memory plus an event when the value is needed later.
    On a CPU profile there is no device to wait for: the rule reports nothing and says a GPU profile is
    needed.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from opadvisor.profile.model import Op, Profile, SyncEvent
from opadvisor.rules._calibration import calibration_words
from opadvisor.rules._findings import fmt_ms, idle_cost
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules._timeline import annotation_intervals
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "host_sync"
TITLE = "Host waits for the GPU inside the step"
FIX = "none"

# A sync "opens" an idle gap when the gap starts no later than this after the host stopped waiting.
GAP_SLACK_US = 20.0
DATALOADER_PREFIX = "enumerate(DataLoader)#"

_KINDS: tuple[tuple[frozenset[str], str, str], ...] = (
    (
        frozenset({"aten::is_nonzero"}),
        "`if tensor:` / bool(tensor)",
        "compare on the device (torch.where) or check every N steps",
    ),
    (
        frozenset({"aten::item", "aten::_local_scalar_dense"}),
        ".item()",
        "keep the value on the device (e.g. accumulate loss.detach()) and read it every N steps",
    ),
    (
        frozenset(
            {
                "aten::nonzero",
                "aten::nonzero_static",
                "aten::masked_select",
                "aten::unique",
                "aten::_unique2",
                "aten::unique_consecutive",
                "aten::unique_dim",
                "aten::index",
                "aten::repeat_interleave",
                "aten::bincount",
                "aten::histc",
            }
        ),
        "an op whose output size depends on the data (nonzero / boolean-mask indexing / unique)",
        "use fixed-size ops (torch.where, masking by multiplication, nonzero_static) so the host need not wait",
    ),
    (
        frozenset(
            {"aten::to", "aten::_to_copy", "aten::copy_", "aten::cpu", "aten::numpy_T", "aten::tolist"}
        ),
        ".cpu() / .to('cpu') / .tolist()",
        "copy with .to('cpu', non_blocking=True) into pinned memory and read it later, or every N steps",
    ),
)


@dataclass
class HostSyncFacts(Facts):
    """What a host_sync finding carries: the syncs per step at the line, the GPU idle they cost (scaled to
    the plain step, and as profiled), the host's wait, the sync calls and ops, and the line's source."""

    RULES = ("host_sync",)
    syncs_per_step: float = 0.0
    gpu_idle_ms_per_step: float = 0.0
    profiled_gpu_idle_ms_per_step: float | None = None
    host_wait_ms_per_step: float | None = None
    sync_calls: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    source: str | None = None


def _kind(names: Iterable[str]) -> tuple[str, str]:
    names = list(names)
    for ops, words, advice in _KINDS:
        if any(n in ops for n in names):
            return words, advice
    return names[0].rsplit("::", 1)[-1] if names else "a synchronising op", "move it out of the step"


def _gaps(profile: Profile) -> tuple[list[float], list[float]]:
    gaps = sorted((g.start_us, g.start_us + g.duration_us) for s in profile.steps for g in s.idle_gaps)
    return [g[0] for g in gaps], [g[1] for g in gaps]


def _opened_gap(starts: list[float], ends: list[float], sync: SyncEvent) -> int | None:
    """Index of the idle gap the GPU fell into when this wait ended (None when it kept working)."""
    t_end = sync.start_us + sync.duration_us
    i = bisect.bisect_right(starts, t_end + GAP_SLACK_US) - 1
    if i >= 0 and ends[i] > t_end - GAP_SLACK_US and ends[i] > sync.start_us:
        return i
    return None


def _in_loader(profile: Profile) -> list[tuple[float, float, int]]:
    return [
        (a.start_us, a.start_us + a.duration_us, a.thread)
        for a in profile.annotations
        if a.name.startswith(DATALOADER_PREFIX)
    ]


def _site_op(ix: ProfileIndex, op: Op) -> Op | None:
    """The op (this one or an ancestor) that carries the user's file and line."""
    cur: Op | None = op
    while cur is not None:
        if cur.file is not None and cur.line is not None:
            return cur
        cur = ix.profile.ops[cur.parent] if cur.parent is not None else None
    return None


def _cpu_reads(profile: Profile) -> str:
    """On a CPU profile: the lines that read tensors on the host (they will sync on a GPU), as a hint.

    Reads inside `optimizer.step()` are left out: the optimizers keep their step counters on the CPU.
    """
    ix = index_of(profile)
    in_optimizer = [(a, b, t) for a, b, t, _ in annotation_intervals(profile, "Optimizer.step#")]
    lines = sorted(
        {
            f"{o.file.rsplit('/', 1)[-1]}:{o.line}"
            for o in profile.ops
            if o.name in ("aten::item", "aten::is_nonzero")
            and o.parent is None
            and o.file is not None
            and o.line is not None
            and ix.in_window(o)
            and not o.is_backward
            and not any(a <= o.start_us <= b and t == o.thread for a, b, t in in_optimizer)
        }
    )
    if not lines:
        return ""
    shown = ", ".join(lines[:5]) + (", ..." if len(lines) > 5 else "")
    return f".item()-style reads at {shown} will wait for the GPU there"


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile(
            "on the CPU there is no device to wait for, so a sync costs nothing here", _cpu_reads(profile)
        )
    ix = index_of(profile)
    per_site = _syncs_by_site(profile, ix)
    idle = _idle_by_site(profile, ix, per_site)
    return [
        _finding(profile, ix, path, line, items, idle[(path, line)])
        for (path, line), items in per_site.items()
    ]


def _syncs_by_site(profile: Profile, ix: ProfileIndex) -> dict[tuple[str, int], list[tuple[SyncEvent, Op]]]:
    """The step's syncs by the user's line that caused them, in time order; those of host-to-device copies
    and inside the DataLoader left to dataloader_stall."""
    loaders = _in_loader(profile)
    ops = profile.ops
    h2d_ops = {m.op for m in profile.memcpys if "HtoD" in m.name and m.op is not None}
    per_site: dict[tuple[str, int], list[tuple[SyncEvent, Op]]] = defaultdict(list)
    for sync in sorted(profile.syncs, key=lambda s: s.start_us):
        if sync.step is None or sync.op is None or not 0 <= sync.op < len(ops):
            continue
        op = ops[sync.op]
        chain_ids = {op.id}
        cur = op
        while cur.parent is not None:
            cur = ops[cur.parent]
            chain_ids.add(cur.id)
        if chain_ids & h2d_ops:
            continue  # a pageable host-to-device copy: dataloader_stall's business
        if any(a <= sync.start_us <= b and t == op.thread for a, b, t in loaders):
            continue  # waiting inside the DataLoader (pinning): dataloader_stall's business
        site = _site_op(ix, op)
        if site is None:
            continue
        per_site[(site.file, site.line)].append((sync, op))  # type: ignore[index]
    return per_site


def _idle_by_site(
    profile: Profile, ix: ProfileIndex, per_site: dict[tuple[str, int], list[tuple[SyncEvent, Op]]]
) -> dict[tuple[str, int], float]:
    """GPU idle (us) each site opened: each idle gap goes to the first sync that opened it."""
    starts, ends = _gaps(profile)
    ops = profile.ops
    claimed: set[int] = set()
    idle: dict[tuple[str, int], float] = defaultdict(float)
    for sync in sorted((s for items in per_site.values() for s, _ in items), key=lambda s: s.start_us):
        gi = _opened_gap(starts, ends, sync)
        if gi is None or gi in claimed:
            continue
        claimed.add(gi)
        op = ops[sync.op]  # type: ignore[index]
        site = _site_op(ix, op)
        opened = ends[gi] - max(starts[gi], sync.start_us)
        idle[(site.file, site.line)] += max(0.0, opened)  # type: ignore[union-attr]
    return idle


def _finding(
    profile: Profile,
    ix: ProfileIndex,
    path: str,
    line: int,
    items: list[tuple[SyncEvent, Op]],
    idle_us: float,
) -> Finding:
    roots = [ix.root(op) for _, op in items]
    words, advice = _kind([r.name for r in roots] + [op.name for _, op in items])
    per_step = len(items) / ix.steps_recorded
    profiled_idle_ms = ix.per_step_ms(idle_us)
    idle_ms, share, cost = idle_cost(ix, profiled_idle_ms)
    wait_ms = ix.per_step_ms(sum(s.duration_us for s, _ in items))
    src = load_profiled_source(profile, path)
    first, last = src.statement_span(line) if src is not None else (line, line)
    count = (
        f"{per_step:.0f}x" if per_step >= 1 and abs(per_step - round(per_step)) < 0.05 else f"{per_step:.2g}x"
    )
    message = f"{words} waits for the GPU {count} per step; the GPU then idles {cost}"
    root = roots[0]
    return Finding(
        rule=ID,
        path=path,
        line=first,
        end_line=last,
        message=message,
        fix="none",
        function=root.function,
        module=root.module,
        evidence=Evidence(
            ops=sorted({r.name for r in roots}),
            kernel_count=None,
            time_ms_per_step=idle_ms,
            share_of_step=share,
            time_basis="gpu",
            occurrences=max(1, round(per_step)),
            profiled_time_ms_per_step=profiled_idle_ms if ix.calibration.calibrated else None,
            notes=[
                f"the host waited {fmt_ms(wait_ms)}/step in {sorted({s.name for s, _ in items})[0]}",
                calibration_words(ix.calibration),
            ],
        ),
        time_ms_per_step=idle_ms,
        est_saving_ms_per_step=idle_ms,
        advice=advice,
        details=HostSyncFacts(
            syncs_per_step=per_step,
            gpu_idle_ms_per_step=idle_ms,
            profiled_gpu_idle_ms_per_step=profiled_idle_ms,
            host_wait_ms_per_step=wait_ms,
            sync_calls=sorted({s.name for s, _ in items}),
            ops=sorted({r.name for r in roots}),
            source=src.line_text(line).strip() if src is not None else None,
        ).to_details(),
    )


__all__ = ["FIX", "ID", "TITLE", "detect"]
