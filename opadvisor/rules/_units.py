"""FSDP2's collectives per unit (issue 34): which all-gather and reduce-scatter belongs to which module.

FSDP2 names its ranges by unit: `FSDP::all_gather (blocks.3)`, `FSDP::post_backward_reduce (blocks.3)` (the
root unit's without a suffix: `FSDP::all_gather`). Each c10d collective op the training thread called
inside such a range belongs to that unit. Per unit and collective this gives calls per step, the bytes
one call moves (its largest tensor: the gathered parameters, the gradients reduced), and on a GPU profile
the time of its NCCL kernels and the part of it no other kernel overlapped (exposed: the GPU waited for
it); on a CPU profile (gloo) the transfers run on gloo's own threads and cannot be told apart by unit, so
times are None there.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from opadvisor.profile.intervals import interval_union
from opadvisor.profile.model import Annotation, Kernel, Op, Profile

_PRE_FORWARD = re.compile(
    r"^FSDP::pre_forward \((?P<unit>.+)\)$"
)  # a non-root unit's (the root's has no suffix)
_RANGE = re.compile(r"^FSDP::(?P<phase>all_gather|post_backward_reduce)(?: \((?P<unit>.*)\))?$")
_COLLECTIVE = {"all_gather": "all_gather", "post_backward_reduce": "reduce_scatter"}
# FSDP2 gathers a unit in backward inside these ranges (its own pre-backward, or the unit before it
# prefetching it)
_BACKWARD_RANGES = ("FSDP::pre_backward", "FSDP::backward_prefetch")
_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


@dataclass
class UnitComm:
    unit: str  # the wrapped module's path ("" the root unit)
    collective: str  # "all_gather" | "reduce_scatter"
    calls_per_step: float
    mib_per_call: float | None  # MiB of the largest tensor of one call
    dtype: str | None
    ms_per_step: float | None  # GPU: NCCL kernel time; None on a CPU profile
    exposed_ms_per_step: float | None  # GPU: the part no other kernel overlapped


def unit_comm(profile: Profile) -> list[UnitComm]:
    """Every unit's collectives, most exposed first (on a CPU profile: most bytes per step first)."""
    return _collect(profile, None)


def backward_gathers(profile: Profile) -> list[UnitComm]:
    """Each unit's all-gathers issued in backward: inside FSDP2's `FSDP::pre_backward (unit)` or
    `FSDP::backward_prefetch for unit` ranges (the parameters gathered again because the unit resharded
    after forward), most exposed first."""
    backward: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for a in profile.annotations:
        if a.step is not None and a.name.startswith(_BACKWARD_RANGES):
            backward[a.thread].append((a.start_us, a.start_us + a.duration_us))
    units = _collect(profile, lambda op: any(s <= op.start_us <= e for s, e in backward.get(op.thread, ())))
    return [u for u in units if u.collective == "all_gather"]


def _collect(profile: Profile, keep: Callable[[Op], bool] | None) -> list[UnitComm]:
    """The units' collectives made of the ops `keep` accepts (None: every op)."""
    steps = max(len(profile.steps), 1)
    ranges = _ranges_by_thread(profile)
    compute = _compute(profile)
    found: dict[tuple[str, str], list[Op]] = defaultdict(list)
    nccl: dict[tuple[str, str], list[Kernel]] = defaultdict(list)
    for op in profile.ops:
        if op.step is None or (keep is not None and not keep(op)):
            continue
        calls = op.name.startswith("c10d::")
        kernels = [k for k in op.kernels if _is_nccl(k)]
        if not (calls or kernels):
            continue
        hit = _enclosing(ranges.get(op.thread, []), op.start_us)
        if hit is None:
            continue
        if calls:
            found[hit].append(op)
        # the NCCL kernel belongs to the innermost op that launched it: the c10d op, or an op inside it
        # (ProcessGroupNCCL's `record_param_comms`, `nccl:_all_gather_base`), in the same unit range
        nccl[hit].extend(kernels)
    out = [
        _summary(unit, coll, ops, steps, compute, nccl[(unit, coll)] if profile.has_gpu else None)
        for (unit, coll), ops in found.items()
    ]
    if profile.has_gpu:
        return sorted(out, key=lambda u: -(u.exposed_ms_per_step or 0.0))
    return sorted(out, key=lambda u: -(u.mib_per_call or 0.0) * u.calls_per_step)


def _compute(profile: Profile) -> list[tuple[float, float]]:
    """The union of the step's kernels that are no NCCL kernel (sorted, disjoint intervals, us)."""
    return interval_union(
        (k.start_us, k.start_us + k.duration_us)
        for o in profile.ops
        for k in o.kernels
        if o.step is not None and not _is_nccl(k)
    )


def _is_nccl(kernel: Kernel) -> bool:
    return kernel.name.lower().startswith("nccl")


@dataclass
class LateGather:
    """A unit's forward all-gather that started on the GPU only after the unit before it had computed."""

    unit: str
    previous: str  # the unit before it in the forward
    step: int
    gap_us: float  # from the previous unit's last compute kernel to the gather's first kernel
    exposed_us: float  # the gather's kernel time no compute kernel overlapped


def late_forward_gathers(profile: Profile) -> tuple[list[LateGather], int]:
    """On a GPU profile: the forward all-gathers of the non-root units that started only after the previous
    unit's compute kernels had ended (FSDP2 issues a unit's all-gather at its pre-forward unless an earlier
    unit prefetches it), and how many unit-to-unit hand-overs the forwards had. Each hand-over is a pair of
    `FSDP::pre_forward (unit)` ranges in forward order; the previous unit's compute is the kernels of its
    module's ops issued between the two; the gather, the NCCL kernels of the next unit's all-gather range
    issued from the previous unit's pre-forward to the end of the next one's."""
    ranges = _ranges_by_thread(profile)
    compute = _compute(profile)
    ops = sorted((o for o in profile.ops if o.step is not None and o.kernels), key=lambda o: o.start_us)
    starts = [o.start_us for o in ops]
    forwards = _forward_order(profile)
    order = {unit: i for i, unit in enumerate(dict.fromkeys(u for _, _, u, _ in forwards))}
    late, pairs = [], 0
    for (tp, _, prev, step), (tn, en, nxt, _) in zip(forwards, forwards[1:], strict=False):
        if order[nxt] != order[prev] + 1:
            continue
        window = ops[bisect_left(starts, tp) : bisect_right(starts, en)]
        gather = [
            k
            for o in window
            for k in o.kernels
            if _is_nccl(k) and _enclosing(ranges.get(o.thread, []), o.start_us) == (nxt, "all_gather")
        ]
        done = [
            k.start_us + k.duration_us
            for o in window
            if o.start_us < tn and not o.is_backward and _within(o.module, prev)
            for k in o.kernels
            if not _is_nccl(k)
        ]
        if not gather or not done:
            continue
        pairs += 1
        first = min(k.start_us for k in gather)
        if first >= max(done):
            exposed = sum(_outside(k.start_us, k.start_us + k.duration_us, compute) for k in gather)
            late.append(LateGather(nxt, prev, step, first - max(done), exposed))
    return late, pairs


def _forward_order(profile: Profile) -> list[tuple[float, float, str, int]]:
    """(start, end, unit, step) of every non-root unit's `FSDP::pre_forward (unit)` range, in time order."""
    found = []
    for a in profile.annotations:
        match = _PRE_FORWARD.match(a.name)
        if match and a.step is not None:
            found.append((a.start_us, a.start_us + a.duration_us, match["unit"], a.step))
    return sorted(found)


def _within(module: str | None, unit: str) -> bool:
    return module is not None and (module == unit or module.startswith(unit + "."))


def _ranges_by_thread(profile: Profile) -> dict[int, list[tuple[Annotation, str, str]]]:
    out: dict[int, list[tuple[Annotation, str, str]]] = defaultdict(list)
    for a in profile.annotations:
        match = _RANGE.match(a.name)
        if match and a.step is not None:
            out[a.thread].append((a, match["unit"] or "", _COLLECTIVE[match["phase"]]))
    return out


def _enclosing(ranges: list[tuple[Annotation, str, str]], at_us: float) -> tuple[str, str] | None:
    """(unit, collective) of the innermost unit range holding the instant."""
    best = None
    for a, unit, coll in ranges:
        if a.start_us <= at_us <= a.start_us + a.duration_us and (best is None or a.duration_us < best[0]):
            best = (a.duration_us, unit, coll)
    return (best[1], best[2]) if best else None


def _summary(
    unit: str,
    coll: str,
    ops: list[Op],
    steps: int,
    compute: list[tuple[float, float]],
    kernels: list[Kernel] | None,
) -> UnitComm:
    """One unit's collective: `ops` its c10d calls, `kernels` its NCCL kernels (None on a CPU profile)."""
    sizes = [_largest(op) for op in ops]
    known = [s for s in sizes if s is not None]
    ms = exposed = None
    if kernels is not None:
        ms = sum(k.duration_us for k in kernels) / 1000.0 / steps
        exposed = (
            sum(_outside(k.start_us, k.start_us + k.duration_us, compute) for k in kernels) / 1000.0 / steps
        )
    return UnitComm(
        unit=unit,
        collective=coll,
        calls_per_step=len(ops) / steps,
        mib_per_call=round(max(b for b, _ in known) / 2**20, 3) if known else None,
        dtype=max(known)[1] if known else None,
        ms_per_step=ms,
        exposed_ms_per_step=exposed,
    )


def _largest(op: Op) -> tuple[int, str] | None:
    """(bytes, dtype) of the op's largest tensor input (a collective's gathered or reduced buffer)."""
    best = None
    for shape, dtype in zip(op.input_shapes, op.input_dtypes, strict=False):
        if not isinstance(shape, list) or dtype not in _BYTES:
            continue
        size = math.prod(shape) * _BYTES[dtype]
        if best is None or size > best[0]:
            best = (size, dtype)
    return best


def dtype_bytes(dtype: str | None) -> int | None:
    """Bytes of one element of a dtype named as the profile names it ("bfloat16"); None when unknown."""
    return _BYTES.get(dtype) if dtype is not None else None


def _outside(start: float, end: float, covered: list[tuple[float, float]]) -> float:
    """Microseconds of [start, end) that no interval of `covered` (sorted, disjoint) holds."""
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in covered if b > start and a < end)
    return (end - start) - inside


def words(units: list[UnitComm], top: int = 3) -> str:
    """ "blocks.3 all_gather 2x 12.0 MiB float32, exposed 1.2 ms/step; ..." for a note."""
    parts = []
    for u in units[:top]:
        name = u.unit or "(root)"
        size = f" {u.mib_per_call:.1f} MiB {u.dtype}" if u.mib_per_call is not None else ""
        time = (
            f", {u.ms_per_step:.2f} ms/step, {u.exposed_ms_per_step:.2f} exposed"
            if u.ms_per_step is not None
            else ""
        )
        parts.append(f"{name} {u.collective} {u.calls_per_step:g}x{size}{time}")
    return "; ".join(parts)


__all__ = [
    "LateGather",
    "UnitComm",
    "backward_gathers",
    "dtype_bytes",
    "late_forward_gathers",
    "unit_comm",
    "words",
]
