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
    opadvisor/rewrite/sparse_launch.py). When the tiny kernels are an optimizer's, the fix is
    `fused_optimizer`'s and this finding has none; `torch.compile` (mode="reduce-overhead" adds CUDA graphs)
    is the other remedy the advice names.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._calibration import calibration_words
from opadvisor.rules._findings import fmt_ms, fmt_share, idle_cost
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.engine import NeedsGpuProfile, NotApplicable
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

    loader_s, loader_e = _intervals(a for a in profile.annotations if DATALOADER_MARK in a.name)
    sync_s, sync_e = _intervals(profile.syncs)
    opt_s, opt_e = _intervals(a for a in profile.annotations if a.name.startswith(OPTIMIZER_MARK))

    # every kernel of the window with the op that launched it, in GPU start order
    kernels: list[tuple[float, float, Op]] = []
    for op in profile.ops:
        if op.kernels and ix.in_window(op):
            for k in op.kernels:
                kernels.append((k.start_us, k.duration_us, op))
    kernels.sort(key=lambda t: t[0])
    starts = [k[0] for k in kernels]

    sites: dict[tuple, _Site] = {}
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

    # tiny kernels: shorter than the CPU time their op spent per kernel launched (its launch cost)
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

    median_share = _median_idle_share(ix, step_rows, unexplained_ms)
    if median_share is None or median_share < IDLE_SHARE_MIN:
        return []
    cal = ix.calibration
    step_ms = cal.share_base_ms or 0.0
    findings: list[Finding] = []
    ranked = sorted(sites.values(), key=lambda s: -s.idle_us)
    for site in ranked[:MAX_FINDINGS]:
        profiled_ms = ix.per_step_ms(site.idle_us)
        ms, share, cost = idle_cost(ix, profiled_ms)
        if share is None or share < FUNCTION_SHARE_MIN:
            continue
        line, end = _lines(profile, site)
        tiny_per_step = round(site.tiny / ix.steps_recorded)
        kernels_per_step = round(site.kernels / ix.steps_recorded)
        remedies = _remedies(site)
        fix = "none" if _optimizer_bound(site) else FIX
        where = site.function or "this code"
        message = (
            f"GPU idle while {where} launches kernels: {tiny_per_step} of its {kernels_per_step} kernels/step are "
            f"shorter than their launch; {cost} of idle GPU "
            f"(steps idle {fmt_share(median_share)} overall)"
        )
        findings.append(
            Finding(
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
                    notes=[
                        f"median step {fmt_ms(step_ms)}{' plain' if cal.calibrated else ''}, GPU idle "
                        f"{fmt_share(median_share)} of it (gaps explained by data loading or host syncs excluded)",
                        f"{tiny_total // ix.steps_recorded} kernels/step in the whole run are shorter than their launch",
                        calibration_words(cal),
                    ],
                ),
                time_ms_per_step=ms,
                est_saving_ms_per_step=ms,
                advice="; ".join(remedies),
                details={
                    "steps": step_rows,
                    "tiny_kernels_per_step": tiny_per_step,
                    "kernels_per_step": kernels_per_step,
                    "remedies": remedies,
                    "upper_bound": not cal.calibrated,
                    "profiled_idle_ms_per_step": profiled_ms,
                },
            )
        )
    return findings


def _median_idle_share(ix: ProfileIndex, step_rows: list[dict], unexplained_ms: list[float]) -> float | None:
    """The unexplained GPU idle share of the median step: of the plain step once calibrated, else each
    step's idle over its own GPU span under the profiler."""
    if ix.calibration.calibrated:
        if not unexplained_ms:
            return None
        idle = sorted(unexplained_ms)[len(unexplained_ms) // 2]
        return ix.share_of_step(ix.calibration.idle_ms(idle))
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


def _remedies(site: _Site) -> list[str]:
    if _optimizer_bound(site):
        return [
            "fused optimizer: pass fused=True to the torch.optim constructor (see fused_optimizer)",
            'CUDA graphs: torch.compile(mode="reduce-overhead") or torch.cuda.graphs on the step',
        ]
    return [
        "CUDA graphs over the model's forward and backward: `opadvisor apply --rule sparse_launch --unsafe` "
        "wraps it in opadvisor.kernels.cuda_graphed",
        f"or fuse the chain of small ops in {site.function or 'this code'} (or torch.compile it)",
    ]
