"""The GPU idles while the training step waits for its next batch.

What it finds
    In a CUDA profile: the GPU idle time that falls inside the DataLoader's `__next__` (the
    `enumerate(DataLoader)#..._DataLoaderIter.__next__` ranges torch records) and inside host-to-device
    copies from pageable memory (`Memcpy HtoD (Pageable -> Device)`, which also block the host), per step
    and as a share of the step. It is reported at the line that built the DataLoader (recorded while the
    script ran), with its settings (`num_workers`, `pin_memory`, `persistent_workers`) and the lines of the
    batch's `.to(device)` copies. Without a recorded construction it points at the copies (or the loop).
    Reported when the GPU idles at least 2% of the step this way (the idle time scaled to the plain
    step when the run timed one: see opadvisor/rules/_calibration.py).

Why it is slow
    With `num_workers=0` the main process loads and collates every batch between two steps, and the GPU
    has nothing to do meanwhile. A copy from pageable memory is staged through a driver buffer and makes
    the host wait for it, so the host cannot queue the next kernels; from pinned memory with
    `non_blocking=True` the copy is asynchronous and faster.

Example
    loader = DataLoader(dataset, batch_size=32, shuffle=True)         # loads in the main process
    for x, y in loader:
        x, y = x.to("cuda"), y.to("cuda")                              # pageable, blocking copies

Fix and its safety
    `DataLoader(..., num_workers=N, pin_memory=True, persistent_workers=True)` and
    `x.to(device, non_blocking=True)` (`opadvisor apply --rule dataloader_stall --unsafe`). Unsafe: worker
    processes pickle the dataset, collate_fn and worker_init_fn under the spawn / forkserver start methods
    (macOS, Windows, Linux from Python 3.14), so a dataset holding an open file, a database handle, a
    lambda or a CUDA tensor breaks there; an unguarded script is re-run by each worker; an
    IterableDataset yields its stream once per worker unless it shards with `get_worker_info()`; and
    random augmentations draw from per-worker generators, so batches (and losses) change. `pin_memory` and
    `non_blocking` on host-to-device copies alone keep the function. On a CPU profile the rule reports
    nothing: GPU idle time needs a GPU profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.profile.model import Annotation, Construction, Memcpy, Op, Profile
from opadvisor.rules._calibration import calibration_words
from opadvisor.rules._chains import scalar
from opadvisor.rules._findings import fmt_ms, idle_cost
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules._timeline import gpu_idle_overlap_us
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "dataloader_stall"
TITLE = "GPU idle while waiting for the next batch"
FIX = "unsafe"
FIX_CAVEAT = "none where the profile did not see the DataLoader built, or nothing is left to change"

LOADER_PREFIX = "enumerate(DataLoader)#"
MIN_SHARE = 0.02  # report when the GPU idles at least this share of the step waiting for data ...
MIN_MS = 0.02  # ... and at least this long per step


def _loader_annotations(profile: Profile) -> list[Annotation]:
    return [
        a
        for a in profile.annotations
        if a.name.startswith(LOADER_PREFIX) and a.name.endswith("__next__") and a.step is not None
    ]


def _copy_op(profile: Profile, m: Memcpy) -> Op | None:
    return profile.ops[m.op] if m.op is not None and 0 <= m.op < len(profile.ops) else None


def _non_blocking(profile: Profile, op: Op) -> bool | None:
    """aten::copy_(self, src, non_blocking): the flag the copy ran with, None when not recorded."""
    cur: Op | None = op
    while cur is not None:
        if cur.name == "aten::copy_":
            v = scalar(cur, 2)
            return v if isinstance(v, bool) else None
        cur = profile.ops[cur.parent] if cur.parent is not None else None
    return None


def _sync_intervals(profile: Profile, op_ids: set[int]) -> list[tuple[float, float]]:
    """Host waits (SyncEvents) caused by the given copy ops: the host blocked on a pageable copy."""
    return [
        (s.start_us, s.start_us + s.duration_us)
        for s in profile.syncs
        if s.op in op_ids and s.step is not None
    ]


def _pick_loader(
    profile: Profile, annotations: list[Annotation]
) -> tuple[Construction | None, list[Construction]]:
    loaders = [c for c in profile.constructions if c.kind == "dataloader" and c.file and c.line]
    if not loaders:
        return None, []
    multi = any("MultiProcessing" in a.name for a in annotations)
    single = any("SingleProcess" in a.name for a in annotations)
    fitting = [
        c
        for c in loaders
        if (not annotations)
        or (multi and (c.attrs.get("num_workers") or 0) > 0)
        or (single and (c.attrs.get("num_workers") or 0) == 0)
    ] or loaders
    return fitting[0], fitting[1:]


def _copy_sites(ix: ProfileIndex, copies: list[Memcpy]) -> list[dict]:
    profile = ix.profile
    sites: dict[tuple[str, int], dict] = {}
    for m in copies:
        op = _copy_op(profile, m)
        if op is None:
            continue
        root = ix.root(op)
        where = root if root.file is not None else op
        if where.file is None or where.line is None:
            continue
        key = (where.file, where.line)
        site = sites.setdefault(
            key,
            {
                "path": where.file,
                "line": where.line,
                "end_line": where.line,
                "copies": 0,
                "pageable": False,
                "non_blocking": None,
                "ms_per_step": 0.0,
            },
        )
        site["copies"] += 1
        site["pageable"] = site["pageable"] or "Pageable" in m.name
        nb = _non_blocking(profile, op)
        if nb is not None:
            site["non_blocking"] = nb if site["non_blocking"] is None else (site["non_blocking"] and nb)
        site["ms_per_step"] += m.duration_us / 1000.0
    out = []
    for site in sites.values():
        src = load_profiled_source(profile, site["path"])
        if src is not None:
            site["line"], site["end_line"] = src.statement_span(site["line"])
        site["copies"] = site["copies"] / ix.steps_recorded
        site["ms_per_step"] = site["ms_per_step"] / ix.steps_recorded
        out.append(site)
    return sorted(out, key=lambda s: (s["path"], s["line"]))


def _suggested_workers(profile: Profile) -> int:
    cpus = profile.environment.cpu_count or 2
    return max(1, min(8, cpus))


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile("GPU idle time while loading data cannot be measured on the CPU")
    ix = index_of(profile)
    annotations = _loader_annotations(profile)
    h2d = [m for m in profile.memcpys if "HtoD" in m.name and m.step is not None]
    pageable = [m for m in h2d if "Pageable" in m.name]
    idle_loader_ms, idle_copy_ms, profiled_idle_ms = _idle_times(profile, ix, annotations, pageable)
    idle_ms, share, cost = idle_cost(ix, profiled_idle_ms)
    if idle_ms < MIN_MS or share is None or share < MIN_SHARE:
        return []
    construction, others = _pick_loader(profile, annotations)
    copies = _copy_sites(ix, h2d)
    wait_ms = ix.per_step_ms(sum(a.duration_us for a in annotations))
    attrs = dict(construction.attrs) if construction is not None else {}
    iterator = _iterator_kind(annotations)
    causes = _causes(ix, annotations, pageable, wait_ms, iterator)
    changes = _changes(profile, construction, attrs, copies)
    site = _site(profile, construction, copies, annotations)
    if site is None:
        return []
    path, first, last, function = site
    fix = "unsafe" if construction is not None and changes else "none"
    measured = {
        "gpu_idle_ms_per_step": idle_ms,
        "profiled_gpu_idle_ms_per_step": profiled_idle_ms,
        "gpu_idle_in_loader_ms_per_step": idle_loader_ms,
        "gpu_idle_in_pageable_copies_ms_per_step": idle_copy_ms,
        "loader_wait_ms_per_step": wait_ms,
        "pageable_copies_per_step": len(pageable) / ix.steps_recorded,
    }
    details = _details(profile, construction, attrs, iterator, copies, measured, changes)
    evidence = Evidence(
        ops=sorted({a.name for a in annotations} | {m.name for m in h2d}),
        time_ms_per_step=idle_ms,
        share_of_step=share,
        time_basis="gpu",
        occurrences=max(1, round(len(annotations) / ix.steps_recorded)),
        profiled_time_ms_per_step=profiled_idle_ms if ix.calibration.calibrated else None,
        notes=[*_notes(construction, others, attrs), calibration_words(ix.calibration)],
    )
    message = f"GPU idle {cost} while the step " + " and ".join(causes)
    return [
        Finding(
            rule=ID,
            path=path,  # type: ignore[arg-type]
            line=first,
            end_line=last,
            message=message,
            fix=fix,  # type: ignore[arg-type]
            function=function,
            evidence=evidence,
            time_ms_per_step=idle_ms,
            est_saving_ms_per_step=idle_ms,
            advice=_advice(construction, changes, fix),
            details=details,
        )
    ]


@dataclass
class CopySite:
    """A user line whose host-to-device copies the profile measured: copies and ms per step, whether any
    was from pageable memory, whether all were non_blocking (None: the profile cannot tell)."""

    path: str
    line: int
    end_line: int
    copies: float = 0.0
    pageable: bool = False
    non_blocking: bool | None = None
    ms_per_step: float = 0.0


@dataclass
class DataLoaderFacts(Facts):
    """What a dataloader_stall finding carries: the loader's arguments as built (None: no construction
    recorded), the iterator kind, where it was built, the copies (the codemod makes those it finds
    asynchronous), the idle and wait times measured, and the changes suggested."""

    RULES = ("dataloader_stall",)
    num_workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    batch_size: int | None = None
    dataset: str | None = None
    iterator: str | None = None
    construction: dict[str, str | int | None] | None = None  # {"path", "line"}
    copies: list[CopySite] = field(default_factory=list)
    gpu_idle_ms_per_step: float = 0.0
    profiled_gpu_idle_ms_per_step: float | None = None
    gpu_idle_in_loader_ms_per_step: float | None = None
    gpu_idle_in_pageable_copies_ms_per_step: float | None = None
    loader_wait_ms_per_step: float | None = None
    pageable_copies_per_step: float = 0.0
    suggested: list[str] = field(default_factory=list)
    suggested_num_workers: int = 0


def _details(
    profile: Profile,
    construction: Construction | None,
    attrs: dict,
    iterator: str | None,
    copies: list[dict],
    measured: dict[str, float | None],
    changes: list[str],
) -> dict:
    """The finding's details: the loader's arguments, the copies, the times measured, what to change."""
    workers = attrs.get("num_workers")
    return DataLoaderFacts(
        num_workers=workers,
        pin_memory=attrs.get("pin_memory"),
        persistent_workers=attrs.get("persistent_workers"),
        batch_size=attrs.get("batch_size"),
        dataset=attrs.get("dataset"),
        iterator=iterator,
        construction=(
            {"path": construction.file, "line": construction.line} if construction is not None else None
        ),
        copies=[CopySite(**c) for c in copies],
        **measured,  # type: ignore[arg-type]
        suggested=changes,
        suggested_num_workers=_suggested_workers(profile) if not workers else workers,
    ).to_details()


def _idle_times(
    profile: Profile, ix: ProfileIndex, annotations: list[Annotation], pageable: list[Memcpy]
) -> tuple[float | None, float | None, float | None]:
    """GPU idle per step while the loader runs, while pageable copies (and their syncs) run (both scaled
    to the plain step), and under either, as profiled."""
    loader_iv = [(a.start_us, a.start_us + a.duration_us) for a in annotations]
    pageable_ops = {m.op for m in pageable if m.op is not None}
    copy_iv = [(m.start_us, m.start_us + m.duration_us) for m in pageable] + _sync_intervals(
        profile, pageable_ops
    )
    cal = ix.calibration
    idle_loader_ms = cal.idle_ms(ix.per_step_ms(gpu_idle_overlap_us(profile, loader_iv)))
    idle_copy_ms = cal.idle_ms(ix.per_step_ms(gpu_idle_overlap_us(profile, copy_iv)))
    profiled_idle_ms = ix.per_step_ms(gpu_idle_overlap_us(profile, loader_iv + copy_iv))
    return idle_loader_ms, idle_copy_ms, profiled_idle_ms


def _iterator_kind(annotations: list[Annotation]) -> str | None:
    if any("MultiProcessing" in a.name for a in annotations):
        return "multi-process"
    return "single-process" if annotations else None


def _causes(
    ix: ProfileIndex,
    annotations: list[Annotation],
    pageable: list[Memcpy],
    wait_ms: float | None,
    iterator: str | None,
) -> list[str]:
    """What the step does while the GPU idles: waits in the loader, pageable copies."""
    causes: list[str] = []
    if annotations:
        causes.append(f"waits in the DataLoader ({fmt_ms(wait_ms)}/step on the host, {iterator})")
    if pageable:
        causes.append(
            f"makes {len(pageable) / ix.steps_recorded:.0f} pageable host-to-device copies per step"
        )
    return causes


def _changes(
    profile: Profile, construction: Construction | None, attrs: dict, copies: list[dict]
) -> list[str]:
    """The loader's arguments to add and the copies' non_blocking, where missing."""
    changes: list[str] = []
    if construction is not None:
        if not attrs.get("num_workers"):
            changes.append(f"num_workers={_suggested_workers(profile)}")
        if not attrs.get("pin_memory"):
            changes.append("pin_memory=True")
        if not attrs.get("persistent_workers"):
            changes.append("persistent_workers=True")
    if any(c["non_blocking"] is not True for c in copies):
        changes.append("non_blocking=True on the .to(device) copies")
    return changes


def _site(
    profile: Profile, construction: Construction | None, copies: list[dict], annotations: list[Annotation]
) -> tuple[str, int, int, str | None] | None:
    """(path, first line, last line, function) of the finding: the statement of the loader's construction,
    else of the first copy, else where the loader was iterated; None when none is known."""
    if construction is not None:
        path, line, function = construction.file, construction.line, construction.function
    elif copies:
        path, line, function = copies[0]["path"], copies[0]["line"], None
    elif annotations and annotations[0].file and annotations[0].line:
        path, line, function = annotations[0].file, annotations[0].line, None
    else:
        return None
    src = load_profiled_source(profile, path)  # type: ignore[arg-type]
    first, last = src.statement_span(line) if src is not None else (line, line)  # type: ignore[arg-type]
    return path, first, last, function  # type: ignore[return-value]


def _advice(construction: Construction | None, changes: list[str], fix: str) -> str:
    if fix == "unsafe":
        advice = "DataLoader(..., " + ", ".join(c for c in changes if "=" in c and "copies" not in c) + ")"
        if any("copies" in c for c in changes):
            advice += " and x.to(device, non_blocking=True)"
        return advice + (
            "; unsafe: workers pickle the dataset under spawn (macOS/Windows) and draw their own random "
            "numbers, so a dataset that is not picklable breaks and random augmentations change"
        )
    if construction is not None:
        return (
            "the loader already uses workers and pinned memory: raise num_workers / prefetch_factor, make "
            "__getitem__ and collate_fn cheaper (pre-tokenise, cache decoded data), or send fewer, larger "
            "tensors per batch (receiving a batch from a worker costs host time too)"
        )
    return "pin the host tensors (tensor.pin_memory()) and copy with .to(device, non_blocking=True)"


def _notes(construction: Construction | None, others: list[Construction], attrs: dict) -> list[str]:
    notes = []
    if others:
        notes.append(
            "more than one DataLoader fits; also built at "
            + ", ".join(f"{c.file.rsplit('/', 1)[-1]}:{c.line}" for c in others if c.file)
        )
    if construction is not None and attrs.get("dataset"):
        notes.append(f"dataset {attrs['dataset']} (workers must be able to pickle it under spawn)")
    return notes


__all__ = ["FIX", "ID", "TITLE", "detect"]
