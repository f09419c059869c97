"""Adam / AdamW / SGD stepping CUDA parameters with the for-loop or foreach path instead of the fused one.

What it finds
    In a CUDA profile: a `torch.optim.Adam`, `AdamW` or `SGD` built without `fused=True` (where the
    script built it is recorded while it ran, with the devices and dtypes of its parameters), whose
    parameters are all floating-point CUDA tensors, and whose `step()` (the `Optimizer.step#AdamW.step`
    range) launched many kernels: one `aten::_foreach_*` op per update term (the default foreach path) or
    several elementwise ops per parameter (`foreach=False`). The finding points at the optimizer's
    construction and gives the kernels per step, the GPU time they took and the span of the GPU
    timeline the step occupied (launch gaps included). Not reported when fusing would save less than 1%
    of the step: SGD without momentum, for one, is a single pass over the parameters either way.

Why it is slow
    The update of Adam is about ten elementwise operations per parameter. The for-loop path launches each
    of them for each parameter (hundreds to thousands of tiny kernels, bound by launch latency); the
    foreach path batches parameters but still makes one pass over all the optimizer state per operation.
    The fused kernel does the whole update in one pass. On an H200 with 16 small parameters, AdamW's step
    occupied the GPU for 3.5 ms (for-loop), 0.38 ms (foreach) and 0.09 ms (fused).

Example
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

Fix and its safety
    `opadvisor.kernels.AdamW(model.parameters(), lr=3e-4)` for an AdamW whose parameters are float32,
    float16 or bfloat16 CUDA tensors (torch's AdamW class, same arguments and state; its step is one Triton
    launch, 18-20% less GPU time than torch's fused=True on an H200), else
    `torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)` (`opadvisor apply --rule
    fused_optimizer`). Safe for floating-point CUDA parameters (float32, float16, bfloat16, float64): the
    same update up to rounding. Not offered (no finding) when some parameters are on the CPU or not
    floating point; the codemod refuses `foreach=True` (cannot be combined with `fused`),
    `differentiable=True`, and SGD with sparse gradients. On a CPU profile the rule reports nothing: recent
    torch has fused CPU kernels too, but the mission is GPU time and a CPU profile cannot measure it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from opadvisor.profile.model import Construction, Op, Profile
from opadvisor.rules._findings import fmt_ms, fmt_share
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules._timeline import annotation_intervals
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "fused_optimizer"
TITLE = "Optimizer without fused=True"
FIX = "safe"

FUSABLE = {"torch.optim.Adam": "Adam", "torch.optim.AdamW": "AdamW", "torch.optim.SGD": "SGD"}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
STEP_PREFIX = "Optimizer.step#"
# The fused step streams over the optimizer state once, in a few launches. Its kernel time is about that of
# this many passes of one foreach op (measured on an H200: AdamW's 8 foreach kernels took 80 us, the fused
# kernel 28 us, i.e. 2.8 of them). SGD's update is a single pass either way.
FUSED_PASSES = {"Adam": 2.8, "AdamW": 2.8, "SGD": 1.0}
MIN_KERNELS_PER_STEP = 2  # one kernel per step (SGD without momentum on one chunk) leaves nothing to fuse
MIN_SHARE = 0.01  # report when fusing would save at least this share of the training step (estimated)


def _step_ranges(profile: Profile, cls_name: str) -> list[tuple[float, float, int]]:
    """(start, end, thread) of this optimizer class's `step()` ranges inside the recorded steps."""
    want = f"{STEP_PREFIX}{cls_name}.step"
    return [
        (a, b, t)
        for a, b, t, ann in annotation_intervals(profile, STEP_PREFIX)
        if ann.name == want and ann.step is not None
    ]


def _ops_inside(ix: ProfileIndex, rng: tuple[float, float, int]) -> list[Op]:
    """Root ops the optimizer step ran (on the range's thread, inside its interval)."""
    start, end, thread = rng
    starts, order = _by_start(ix)
    ops = ix.profile.ops
    out = []
    i = bisect.bisect_left(starts, start)
    while i < len(order) and starts[i] <= end:
        op = ops[order[i]]
        if op.parent is None and not op.is_backward and op.thread == thread:
            out.append(op)
        i += 1
    return out


def _by_start(ix: ProfileIndex) -> tuple[list[float], list[int]]:
    """Op start times in ascending order and the op ids in that order (ops are stored thread by thread)."""
    cached = ix.__dict__.get("_fused_optimizer_by_start")
    if cached is None or len(cached[1]) != len(ix.profile.ops):
        order = sorted(range(len(ix.profile.ops)), key=lambda i: ix.profile.ops[i].start_us)
        cached = ([ix.profile.ops[i].start_us for i in order], order)
        ix.__dict__["_fused_optimizer_by_start"] = cached
    return cached


def _all_kernels(ix: ProfileIndex, roots: list[Op]):
    for root in roots:
        yield from root.kernels
        for d in ix.descendants(root):
            yield from d.kernels


def attrs_params(c: Construction) -> int:
    n = c.attrs.get("param_count")
    return n if isinstance(n, int) and n > 0 else 0


def _applicable(c: Construction) -> bool:
    attrs = c.attrs
    if c.cls not in FUSABLE or attrs.get("fused") is True:
        return False
    devices = attrs.get("param_devices") or []
    dtypes = attrs.get("param_dtypes") or []
    return devices == ["cuda"] and bool(dtypes) and set(dtypes) <= FLOAT_DTYPES


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile("the optimizer's kernel launches and GPU time cannot be measured on the CPU")
    ix = index_of(profile)
    findings: list[Finding] = []
    seen_classes: dict[str, int] = {}
    for c in profile.constructions:
        if c.kind != "optimizer" or not _applicable(c) or not c.file or not c.line:
            continue
        cls_name = FUSABLE[c.cls]
        # Two optimizers of one class cannot be told apart by their step ranges: share them out in order.
        nth = seen_classes.get(cls_name, 0)
        seen_classes[cls_name] = nth + 1
        anns = _step_ranges(profile, cls_name)
        same = [x for x in profile.constructions if x.kind == "optimizer" and x.cls == c.cls]
        if len(same) > 1:
            anns = anns[nth :: len(same)]
        if not anns:
            continue
        finding = _finding(profile, ix, c, cls_name, anns)
        if finding is not None:
            findings.append(finding)
    return findings


@dataclass
class _StepCost:
    """An optimizer's step, per training step (ms)."""

    kernels_per_step: float
    gpu_ms: float  # its kernels
    span_ms: float  # first kernel start to last kernel end, per step() call, summed
    cpu_ms: float  # host time in step()
    time_ms: (
        float  # the GPU time the step occupies: kernels + the idle between them (scaled to the plain step)
    )
    passes: float  # passes over the state (per parameter on the loop path)
    saving: float


def _finding(
    profile: Profile, ix: ProfileIndex, c: Construction, cls_name: str, anns: list
) -> Finding | None:
    roots = [op for a in anns for op in _ops_inside(ix, a)]
    names = {op.name for op in roots}
    if any(n.startswith("aten::_fused_") for n in names):
        return None  # already fused (e.g. set through a param group)
    path_kind = "foreach" if any(n.startswith("aten::_foreach_") for n in names) else "for-loop"
    kernels = list(_all_kernels(ix, roots))
    if not kernels:
        return None
    cost = _step_cost(ix, c, cls_name, anns, roots, kernels, path_kind)
    share = ix.share_of_step(cost.time_ms)
    saving_share = ix.share_of_step(cost.saving)
    if cost.kernels_per_step < MIN_KERNELS_PER_STEP or saving_share is None or saving_share < MIN_SHARE:
        return None
    attrs = c.attrs
    src = load_profiled_source(profile, c.file)
    first, last = src.statement_span(c.line) if src is not None else (c.line, c.line)
    params = attrs.get("param_count")
    message = (
        f"{cls_name} runs the {path_kind} path on {params if params is not None else 'its'} CUDA parameters: "
        f"{cost.kernels_per_step:.0f} kernels per step, the step occupies the GPU {fmt_ms(cost.time_ms)}/step "
        f"({fmt_share(share)} of the step); {_fix_name(cls_name)} does it in one pass"
    )
    return Finding(
        rule=ID,
        path=c.file,
        line=first,
        end_line=last,
        message=message,
        fix="safe",
        function=c.function,
        evidence=Evidence(
            ops=sorted(names),
            kernel_count=round(cost.kernels_per_step),
            dtypes=list(attrs.get("param_dtypes") or []),
            time_ms_per_step=cost.time_ms,
            share_of_step=share,
            time_basis="gpu",
            occurrences=max(1, round(len(anns) / ix.steps_recorded)),
            profiled_time_ms_per_step=max(cost.gpu_ms, cost.span_ms) if ix.calibration.calibrated else None,
            notes=_notes(cost, attrs),
        ),
        time_ms_per_step=cost.time_ms,
        est_saving_ms_per_step=cost.saving,
        advice=_advice(cls_name),
        details=_details(c, path_kind, cost),
    )


def _step_cost(
    ix: ProfileIndex,
    c: Construction,
    cls_name: str,
    anns: list,
    roots: list[Op],
    kernels: list,
    path_kind: str,
) -> _StepCost:
    kernel_us = sum(k.duration_us for k in kernels)
    span_us = 0.0
    for a in anns:
        ks = list(_all_kernels(ix, _ops_inside(ix, a)))
        if ks:
            span_us += max(k.start_us + k.duration_us for k in ks) - min(k.start_us for k in ks)
    kernels_per_step = len(kernels) / ix.steps_recorded
    gpu_ms = ix.per_step_ms(kernel_us)
    span_ms = ix.per_step_ms(span_us)
    cpu_ms = ix.per_step_ms(sum(b - a for a, b, _ in anns))
    # the GPU idles between the step's kernels: that part is scaled to the plain step (_calibration)
    time_ms = gpu_ms + ix.calibration.idle_ms(max(0.0, span_ms - gpu_ms))
    # passes over the state per step: elementwise ops that launched kernels (per parameter on the loop path)
    launching = [op for op in roots if ix.kernel_count(op) > 0]
    passes = len(launching) / ix.steps_recorded
    if path_kind == "for-loop" and attrs_params(c):
        passes /= attrs_params(c)
    fused_ms = gpu_ms * min(1.0, FUSED_PASSES[cls_name] / passes) if passes else gpu_ms
    saving = max(0.0, time_ms - fused_ms)
    return _StepCost(kernels_per_step, gpu_ms, span_ms, cpu_ms, time_ms, passes, saving)


def _fix_name(cls_name: str) -> str:
    return "opadvisor.kernels.AdamW" if cls_name == "AdamW" else "fused=True"


def _advice(cls_name: str) -> str:
    if cls_name == "AdamW":
        return (
            "opadvisor.kernels.AdamW(...) with the same arguments: torch's AdamW (same state) whose step is one "
            "Triton launch for the whole update, faster than fused=True (safe for float32/16-bit CUDA "
            "parameters; fused=True where the kernel does not apply)"
        )
    return (
        f"torch.optim.{cls_name}(..., fused=True): one kernel pass for the whole update (safe for "
        "floating-point CUDA parameters)"
    )


def _notes(cost: _StepCost, attrs: dict) -> list[str]:
    notes = [
        f"GPU kernel time {fmt_ms(cost.gpu_ms)}/step, host time in step() {fmt_ms(cost.cpu_ms)}/step; the GPU "
        "time the step occupies includes the gaps between its launches (profiling slows the host, so a "
        "launch-bound step looks longer under the profiler than without it)",
    ]
    if attrs.get("foreach") is True:
        notes.append("foreach=True is set: replace it by fused=True (they cannot be combined)")
    return notes


@dataclass
class FusedOptimizerFacts(Facts):
    """What a fused_optimizer finding carries: the optimizer class and the path its step took ("for-loop",
    "foreach"), its fused/foreach arguments, where the parameters live (the codemod refuses a device or
    dtype fused does not support) and the step's cost per training step."""

    RULES = ("fused_optimizer",)
    optimizer: str = ""
    path: str = ""
    fused: bool | None = None
    foreach: bool | None = None
    param_count: int | None = None
    param_devices: list[str] = field(default_factory=list)
    param_dtypes: list[str] = field(default_factory=list)
    kernels_per_step: float = 0.0
    gpu_kernel_ms_per_step: float = 0.0
    gpu_span_ms_per_step: float = 0.0
    host_ms_per_step: float = 0.0
    passes_per_step: float = 0.0


def _details(c: Construction, path_kind: str, cost: _StepCost) -> dict:
    attrs = c.attrs
    return FusedOptimizerFacts(
        optimizer=c.cls,
        path=path_kind,
        fused=attrs.get("fused"),
        foreach=attrs.get("foreach"),
        param_count=attrs.get("param_count"),
        param_devices=list(attrs.get("param_devices") or []),
        param_dtypes=list(attrs.get("param_dtypes") or []),
        kernels_per_step=cost.kernels_per_step,
        gpu_kernel_ms_per_step=cost.gpu_ms,
        gpu_span_ms_per_step=cost.span_ms,
        host_ms_per_step=cost.cpu_ms,
        passes_per_step=cost.passes,
    ).to_details()


__all__ = ["FIX", "ID", "TITLE", "detect"]
