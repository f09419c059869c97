"""The GPU waits for the CPU: many short kernels, idle gaps between launches, launch-bound steps.

What it finds
    Steps where the GPU sits idle between kernels for a large share of the step (the gaps that the data
    loader or a host synchronisation explain are left to `dataloader_stall` and `host_sync`). Each gap is
    charged to the user function whose op launched the kernel that ended it, and kernels shorter than the
    CPU time spent launching them are counted per function. The finding names, per function, the idle time
    it causes, its tiny kernels, the idle share of every step, and the remedies that fit: a fused
    optimizer for an optimizer step, fusing the elementwise chain, or CUDA graphs / torch.compile on that
    function. The idle time is scaled to the plain step when the run timed one (`opadvisor profile`
    times warm-up steps without the profiler, whose own per-op cost lengthens the gaps; see
    opadvisor/rules/_calibration.py), so no finding claims more than the plain step's idle time. On a
    CPU profile there are no kernels to judge: the rule says it needs a GPU profile.

Why it is slow
    Launching a kernel costs the CPU about 5-10 us (Python, dispatcher, driver). When kernels are shorter
    than that, the GPU finishes each one before the next arrives and idles in between: on an H200, 200
    tiny dependent elementwise ops took 2.8 ms, about 7 us each, nearly all of it launch time.

Example
    for p in model.parameters():          # one kernel per parameter and per op
        p.data.add_(p.grad, alpha=-lr)

Fix and its safety
    For launches in the model's forward and backward: CUDA graphs, unsafe (`opadvisor apply --rule
    sparse_launch --unsafe` wraps the module the optimizer trains in `opadvisor.kernels.cuda_graphed`, which
    captures its forward and backward once per input shape and replays them: the same values, but outputs
    are overwritten by the next call and Python side effects in forward run only at capture; see
    opadvisor/rules/launch/sparse_launch_fix.py). When the tiny kernels are an optimizer's, the fix is
    `fused_optimizer`'s and this finding has none; `torch.compile` (mode="reduce-overhead") is the other
    remedy the advice names.

    Capture blockers. A forward that copies between host and device (`torch.tensor(3).type_as(x)`,
    `.to(device)` of a CPU tensor, `.cpu()`), reads a value on the host (`.item()`, `if tensor:`) or makes
    an output whose size depends on the data (`nonzero`, boolean-mask indexing, `unique`) cannot be
    captured: cuda_graphed would fall back to the eager forward after paying for the attempt. The profile
    shows those ops inside the model's forward; the finding carries them (`GraphFacts`: op, why, the user
    line and the library line). A Python number copied to the device (`torch.tensor(c)` then `.type_as(t)`,
    `.to(t.device)`, or with `device=`) has an exact capture-safe form, `torch.full((), c, ...)`, which the
    fix writes first; any other blocker means the fix is not offered (`fix_blocked` names the line and why).
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._calibration import calibration_words
from opadvisor.rules._chains import norm_dtype
from opadvisor.rules._findings import fmt_ms, fmt_share, idle_cost
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._library import library_path, pattern_view
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.engine import NeedsGpuProfile, NotApplicable
from opadvisor.rules.facts import Facts, absent_as
from opadvisor.rules.finding import Evidence, Finding

ID = "sparse_launch"
TITLE = "GPU idle between short kernels"
FIX = "unsafe"
FIX_CAVEAT = "none where the optimizer launches the kernels (fused_optimizer fixes that)"

IDLE_SHARE_MIN = 0.10  # report when the unexplained idle share of the median step is at least this
FUNCTION_SHARE_MIN = 0.02  # ... and per function, when it causes at least this share of the step idle
MAX_FINDINGS = 5
DATALOADER_MARK = "DataLoader"
OPTIMIZER_MARK = "Optimizer.step"


# Ops inside the graphed forward that a CUDA graph cannot capture, and why (a copy between host and device
# is found from the profile's memcpy events instead, whatever op made it).
BLOCKING_OPS = {
    "aten::_local_scalar_dense": "reads a value on the host (.item(), float(t), int(t))",
    "aten::item": "reads a value on the host (.item(), float(t), int(t))",
    "aten::is_nonzero": "reads a value on the host (`if tensor:`, bool(tensor))",
    "aten::nonzero": "makes an output whose size depends on the data (nonzero, boolean-mask indexing)",
    "aten::masked_select": "makes an output whose size depends on the data (masked_select)",
    "aten::unique": "makes an output whose size depends on the data (unique)",
    "aten::_unique2": "makes an output whose size depends on the data (unique)",
    "aten::unique_consecutive": "makes an output whose size depends on the data (unique_consecutive)",
    "aten::unique_dim": "makes an output whose size depends on the data (unique)",
}
SCALAR_TENSOR = "scalar_tensor"  # the rewrite of a Python number copied to the device: torch.full((), c, ...)
# A library function that asks whether it is being traced or captured before it reads a value on the host
# (transformers' masking_utils: `is_tracing(mask)`, which counts a CUDA stream capture since 5.x) skips the
# read while a CUDA graph is captured: that read does not stop the capture.
CAPTURE_GUARD = re.compile(r"\b(is_tracing|is_current_stream_capturing|is_cuda_stream_capturing)\s*\(")
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero")


@dataclass
class CaptureBlocker:
    """One op in the model's forward that a CUDA graph capture cannot take.

    path/line/function: the user's frame (the line that calls into a library, for library code);
    library_file/library_line: the innermost library frame, when the op ran in installed code.
    rewrite: SCALAR_TENSOR where the op copies a Python number to the device (an exact capture-safe form
    exists), else None. src_dtype/dst_dtype: the copy's dtypes (a copy that casts keeps its cast).
    skipped_when_capturing: a host read in a library function that checks for tracing or capture first
    (CAPTURE_GUARD): the library skips it under capture, so it blocks nothing (if that library's check does
    not count a capture, cuda_graphed's capture fails, and it warns once and runs eagerly)."""

    op: str
    why: str
    path: str | None = None
    line: int | None = None
    function: str | None = None
    library_file: str | None = None
    library_line: int | None = None
    source: str | None = None
    rewrite: str | None = None
    src_dtype: str | None = None
    dst_dtype: str | None = None
    skipped_when_capturing: bool = False

    def where(self) -> str:
        at = f"{self.path}:{self.line}" if self.path else "an unknown line"
        if self.library_file:
            at = f"{self.library_file}:{self.library_line} (called from {at})"
        return at + (f" `{self.source}`" if self.source and not self.library_file else "")


@dataclass
class GraphFacts:
    """What the profile proved about capturing the model's forward: the ops that block a capture."""

    blockers: list[CaptureBlocker] = field(default_factory=list)
    # "blocker I" -> [line, line]: blocker I's line, which apply moves onto the text earlier rewrites left
    lines: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, blockers: list[CaptureBlocker]) -> GraphFacts:
        lines = {f"blocker {i}": [b.line, b.line] for i, b in enumerate(blockers) if b.line is not None}
        return cls(blockers, lines)

    def unfixable(self) -> list[CaptureBlocker]:
        return [b for b in self.blockers if b.rewrite is None and not b.skipped_when_capturing]


_NO_CAPTURE = "written only where the finding has an automatic fix (its codemod reads them); absent: none"


@dataclass
class SparseLaunchFacts(Facts):
    """What a sparse_launch finding carries: the steps' idle rows, the tiny and all kernels per step, the
    remedies, whether the time is an upper bound (uncalibrated), the idle time as profiled, and, on a
    finding with a fix, the capture facts (`GraphFacts`: the blockers, and "blocker I" -> [line, line])."""

    RULES = ("sparse_launch",)
    steps: list[dict[str, Any]] = field(default_factory=list)
    tiny_kernels_per_step: int = 0
    kernels_per_step: int = 0
    remedies: list[str] = field(default_factory=list)
    upper_bound: bool = False
    profiled_idle_ms_per_step: float | None = None
    blockers: list[CaptureBlocker] | None = absent_as(None, _NO_CAPTURE)
    lines: dict[str, list[int]] | None = absent_as(None, _NO_CAPTURE)

    def unwritten(self) -> frozenset[str]:
        return frozenset({"blockers", "lines"}) if self.blockers is None else frozenset()

    def graph(self) -> GraphFacts:
        """The capture facts (none on a finding without a fix)."""
        return GraphFacts(list(self.blockers or []), dict(self.lines or {}))


def capture_blockers(profile: Profile, ix: ProfileIndex) -> list[CaptureBlocker]:
    """The ops inside the model's forward (recorded steps) that a CUDA graph capture cannot take, one per
    user line and op: host<->device copies (memcpy events), host reads and data-dependent shapes."""
    found: dict[tuple, CaptureBlocker] = {}
    ops = profile.ops
    for op in ops:  # first: their reason is the more precise one (.item() copies to the host too)
        why = BLOCKING_OPS.get(op.name)
        if why is not None:
            _add(found, ix, op, why, None)
    for copy in profile.memcpys:
        if copy.op is None or "DtoD" in copy.name or not 0 <= copy.op < len(ops):
            continue
        op = ops[copy.op]
        to_device = "HtoD" in copy.name
        scalar = to_device and len(op.input_shapes) > 1 and op.input_shapes[1] == []
        why = (
            "copies a Python number to the GPU (torch.tensor(...) of a number, then moved)"
            if scalar
            else (
                "copies a CPU tensor to the GPU" if to_device else "copies a GPU tensor to the host (.cpu())"
            )
        )
        _add(found, ix, op, why, SCALAR_TENSOR if scalar else None)
    return sorted(found.values(), key=lambda b: (b.path or "", b.line or 0, b.op))


def _add(found: dict[tuple, CaptureBlocker], ix: ProfileIndex, op: Op, why: str, rewrite: str | None) -> None:
    if op.is_backward or not ix.in_window(op):
        return
    root = ix.root(op)
    if op.module is None and root.module is None:
        return  # not inside a module's forward: outside what cuda_graphed captures
    lib_file, lib_line = (op.lib_file, op.lib_line) if op.lib_file else (root.lib_file, root.lib_line)
    key = (root.file, root.line, lib_file, lib_line, root.name)  # one blocker per call at a line
    if key in found or root.file is None:
        return
    src = load_profiled_source(ix.profile, root.file) if root.line else None
    dtypes = [norm_dtype(d) for d in op.input_dtypes[:2]] if op.name == "aten::copy_" else []
    found[key] = CaptureBlocker(
        op=root.name,
        why=why,
        path=root.file,
        line=root.line,
        function=root.function,
        library_file=lib_file,
        library_line=lib_line,
        source=src.line_text(root.line).strip() if src is not None and root.line else None,
        rewrite=rewrite if lib_file is None else None,
        dst_dtype=dtypes[0] if dtypes else None,
        src_dtype=dtypes[1] if len(dtypes) > 1 else None,
        skipped_when_capturing=bool(
            lib_file and lib_line and op.name in HOST_READS and _guarded(ix.profile, lib_file, lib_line)
        ),
    )


def _guarded(profile: Profile, rel: str, line: int) -> bool:
    """Whether the library function holding `line` checks for tracing or capture (CAPTURE_GUARD), in the
    file as it was profiled (the pattern view holds the library files' hashes)."""
    src = load_profiled_source(pattern_view(profile), library_path(profile, rel))
    if src is None:
        return False
    span = src.enclosing_function(line)
    return span is not None and bool(
        CAPTURE_GUARD.search("\n".join(src.lines[span.line - 1 : span.end_line]))
    )


@dataclass
class _Site:
    file: str
    function: str | None
    idle_us: float = 0.0
    kernels: int = 0
    tiny: int = 0
    in_optimizer: int = 0  # tiny kernels launched inside an optimizer step
    lines: dict[int, float] = field(default_factory=lambda: defaultdict(float))  # line -> idle us
    ops: list[Op] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)


def _intervals(items) -> tuple[list[float], list[float]]:
    spans = sorted((a.start_us, a.start_us + a.duration_us) for a in items)
    return [s for s, _ in spans], [e for _, e in spans]


def _overlaps(starts: list[float], ends: list[float], a: float, b: float) -> bool:
    """True when [a, b] overlaps any interval (intervals sorted by start; short lists in practice)."""
    i = bisect.bisect_right(starts, b)
    return any(ends[j] > a for j in range(max(0, i - 64), i))


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile("a CPU profile has no kernels or GPU idle time to judge")
    ix = index_of(profile)
    if not profile.steps or not any(s.kernel_count for s in profile.steps):
        raise NotApplicable("the profile recorded no kernels inside its steps")
    kernels = _window_kernels(profile, ix)
    sites: dict[tuple, _Site] = {}
    step_rows, unexplained_ms = _idle_by_site(profile, ix, kernels, sites)
    tiny_total = _count_tiny(profile, ix, kernels, sites)
    median_share = _median_idle_share(ix, step_rows, unexplained_ms)
    if median_share is None or median_share < IDLE_SHARE_MIN:
        return []
    findings: list[Finding] = []
    ranked = sorted(sites.values(), key=lambda s: -s.idle_us)
    graph_facts = GraphFacts.of(capture_blockers(profile, ix))
    for site in ranked[:MAX_FINDINGS]:
        finding = _finding(profile, ix, site, median_share, step_rows, tiny_total, graph_facts)
        if finding is not None:
            findings.append(finding)
    return findings


def _window_kernels(profile: Profile, ix: ProfileIndex) -> list[tuple[float, float, Op]]:
    """Every kernel of the window with the op that launched it, in GPU start order: (start, duration, op)."""
    kernels: list[tuple[float, float, Op]] = []
    for op in profile.ops:
        if op.kernels and ix.in_window(op):
            for k in op.kernels:
                kernels.append((k.start_us, k.duration_us, op))
    kernels.sort(key=lambda t: t[0])
    return kernels


def _idle_by_site(
    profile: Profile, ix: ProfileIndex, kernels: list[tuple[float, float, Op]], sites: dict[tuple, _Site]
) -> tuple[list[dict], list[float]]:
    """Each idle gap not explained by data loading or a host sync goes to the site of the kernel that ends
    it (added to `sites`); (one row per step, the unexplained idle ms of each step)."""
    loader_s, loader_e = _intervals(a for a in profile.annotations if DATALOADER_MARK in a.name)
    sync_s, sync_e = _intervals(profile.syncs)
    starts = [k[0] for k in kernels]
    step_rows = []
    unexplained_ms: list[float] = []
    for step in profile.steps:
        explained = unexplained = 0.0
        for gap in step.idle_gaps:
            a, b = gap.start_us, gap.start_us + gap.duration_us
            if _overlaps(loader_s, loader_e, a, b) or _overlaps(sync_s, sync_e, a, b):
                explained += gap.duration_us
                continue
            unexplained += gap.duration_us
            i = bisect.bisect_left(starts, b - 1e-3)
            if i >= len(kernels):
                continue
            site = _site_of(sites, ix, kernels[i][2])
            if site is not None:
                site.idle_us += gap.duration_us
                site.lines[ix.root(kernels[i][2]).line or 0] += gap.duration_us
        span_ms = step.gpu_span_ms or step.wall_ms
        unexplained_ms.append(unexplained / 1000.0)
        step_rows.append(
            {
                "step": step.index,
                "span_ms": round(span_ms, 4),
                "busy_ms": step.gpu_busy_ms,
                "idle_share": round(unexplained / 1000.0 / span_ms, 4) if span_ms else None,
                "idle_explained_ms": round(explained / 1000.0, 4),
                "kernels": step.kernel_count,
            }
        )
    return step_rows, unexplained_ms


def _count_tiny(
    profile: Profile, ix: ProfileIndex, kernels: list[tuple[float, float, Op]], sites: dict[tuple, _Site]
) -> int:
    """Tiny kernels: shorter than the CPU time their op spent per kernel launched (its launch cost). Counted
    per site (those inside the optimizer's step apart); returns the run's total."""
    opt_s, opt_e = _intervals(a for a in profile.annotations if a.name.startswith(OPTIMIZER_MARK))
    tiny_total = 0
    for _start, dur, op in kernels:
        site = _site_of(sites, ix, op)
        if site is None:
            continue
        site.kernels += 1
        launch_us = op.duration_us / max(1, len(op.kernels))
        if dur < launch_us:
            site.tiny += 1
            tiny_total += 1
            root = ix.root(op)
            if _overlaps(opt_s, opt_e, root.start_us, root.start_us):
                site.in_optimizer += 1
    return tiny_total


def _finding(
    profile: Profile,
    ix: ProfileIndex,
    site: _Site,
    median_share: float,
    step_rows: list[dict],
    tiny_total: int,
    graph_facts: GraphFacts,
) -> Finding | None:
    cal = ix.calibration
    profiled_ms = ix.per_step_ms(site.idle_us)
    ms, share, cost = idle_cost(ix, profiled_ms)
    if share is None or share < FUNCTION_SHARE_MIN:
        return None
    line, end = _lines(profile, site)
    tiny_per_step = round(site.tiny / ix.steps_recorded)
    kernels_per_step = round(site.kernels / ix.steps_recorded)
    fix = "none" if _optimizer_bound(site) else FIX
    remedies = _remedies(site, graph_facts if fix != "none" else None)
    where = site.function or "this code"
    message = (
        f"GPU idle while {where} launches kernels: {tiny_per_step} of its {kernels_per_step} kernels/step are "
        f"shorter than their launch; {cost} of idle GPU "
        f"(steps idle {fmt_share(median_share)} overall)"
    )
    return Finding(
        rule=ID,
        path=site.file,
        line=line,
        end_line=end,
        message=message,
        fix=fix,  # type: ignore[arg-type]
        function=site.function,
        module=", ".join(sorted(site.modules)[:2]) or None,
        evidence=Evidence(
            ops=sorted({o.name for o in site.ops})[:12],
            kernel_count=kernels_per_step,
            time_ms_per_step=ms,
            share_of_step=share,
            time_basis="gpu",
            occurrences=1,
            profiled_time_ms_per_step=profiled_ms if cal.calibrated else None,
            notes=_notes(ix, median_share, tiny_total),
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=ms,
        advice="; ".join(remedies),
        details=SparseLaunchFacts(
            step_rows,
            tiny_per_step,
            kernels_per_step,
            remedies,
            not cal.calibrated,
            profiled_ms,
            *((graph_facts.blockers, graph_facts.lines) if fix != "none" else ()),
        ).to_details(),
    )


def _notes(ix: ProfileIndex, median_share: float, tiny_total: int) -> list[str]:
    cal = ix.calibration
    step_ms = cal.share_base_ms or 0.0
    return [
        f"median step {fmt_ms(step_ms)}{' plain' if cal.calibrated else ''}, GPU idle "
        f"{fmt_share(median_share)} of it (gaps explained by data loading or host syncs excluded)",
        f"{tiny_total // ix.steps_recorded} kernels/step in the whole run are shorter than their launch",
        calibration_words(cal),
    ]


def _median_idle_share(ix: ProfileIndex, step_rows: list[dict], unexplained_ms: list[float]) -> float | None:
    """The unexplained GPU idle share of the median step: once calibrated, the median step's unexplained
    part of its idle applied to the plain step's idle (the scale is per-step means, and one slow step in the
    window, e.g. 1.9 s against 0.12-0.14 s, would shrink the median step's idle to nothing), else each
    step's idle over its own GPU span under the profiler."""
    if ix.calibration.calibrated:
        fractions = sorted(
            min(1.0, u / (r["span_ms"] - (r["busy_ms"] or 0.0)))
            for u, r in zip(unexplained_ms, step_rows, strict=True)
            if r["span_ms"] and r["span_ms"] > (r["busy_ms"] or 0.0)
        )
        if not fractions:
            return None
        return ix.share_of_step(fractions[len(fractions) // 2] * (ix.calibration.plain_idle_ms or 0.0))
    shares = sorted(r["idle_share"] for r in step_rows if r["idle_share"] is not None)
    return shares[len(shares) // 2] if shares else None


def _site_of(sites: dict[tuple, _Site], ix: ProfileIndex, op: Op) -> _Site | None:
    root = ix.root(op)
    if root.file is None:
        return None
    key = (root.file, root.function, _def_line(ix, root.file, root.line))
    site = sites.get(key)
    if site is None:
        site = sites[key] = _Site(root.file, root.function)
    if len(site.ops) < 2000:
        site.ops.append(root)
    if root.module:
        site.modules.add(root.module)
    return site


def _def_line(ix: ProfileIndex, path: str, line: int | None) -> int | None:
    """The `def` line of the function holding `line` (tells apart methods that share a name)."""
    cache = ix.__dict__.setdefault("_sparse_def_lines", {})
    key = (path, line)
    if key not in cache:
        src = load_profiled_source(ix.profile, path) if line else None
        fn = src.enclosing_function(line) if src is not None and line else None
        cache[key] = fn.line if fn else None
    return cache[key]


def _lines(profile: Profile, site: _Site) -> tuple[int, int]:
    """The line that caused most of the idle time when it dominates, else the whole function."""
    if site.lines:
        top_line, top_us = max(site.lines.items(), key=lambda kv: kv[1])
        src = load_profiled_source(profile, site.file)
        if top_line and (top_us >= 0.6 * site.idle_us or src is None):
            return src.statement_span(top_line) if src is not None else (top_line, top_line)
        if src is not None and top_line:
            fn = src.enclosing_function(top_line)
            if fn is not None:
                return fn.line, fn.end_line
        if top_line:
            return top_line, top_line
    return 1, 1


def _optimizer_bound(site: _Site) -> bool:
    """Most of the site's tiny kernels run inside an optimizer step (fused_optimizer's fix, not graphs)."""
    return bool(site.in_optimizer) and site.in_optimizer >= site.tiny / 2


def _remedies(site: _Site, graph_facts: GraphFacts | None) -> list[str]:
    if _optimizer_bound(site):
        return [
            "fused optimizer: pass fused=True to the torch.optim constructor (see fused_optimizer)",
            'CUDA graphs: torch.compile(mode="reduce-overhead") or torch.cuda.graphs on the step',
        ]
    fuse = f"or fuse the chain of small ops in {site.function or 'this code'} (or torch.compile it)"
    blocked = graph_facts.unfixable() if graph_facts is not None else []
    if blocked:
        first = blocked[0]
        more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
        return [
            f"CUDA graphs once the forward can be captured: {first.where()} {first.why}{more}; move it out of "
            "the forward or keep it on the device, then `opadvisor apply --rule sparse_launch --unsafe`",
            fuse,
        ]
    graphs = (
        "CUDA graphs over the model's forward and backward: `opadvisor apply --rule sparse_launch --unsafe` "
        "wraps it in opadvisor.kernels.cuda_graphed"
    )
    fixable = graph_facts.blockers if graph_facts is not None else []
    if fixable:
        lines = ", ".join(f"{b.path}:{b.line}" for b in fixable[:3])
        graphs += f", after rewriting the copies of Python numbers that would stop its capture ({lines})"
    return [graphs, fuse]
