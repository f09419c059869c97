"""Turning matched ops into a Finding: cost per step, evidence, and the one-line message users read.

A rule collects the *occurrences* of its pattern (each: the forward root ops of one run of the pattern),
groups them by source site (file and line range), and calls `build_finding` once per site:

    from opadvisor.rules._findings import build_finding, cost_words, module_pattern

    f = build_finding(
        ix, rule=ID, fix="safe", path=frame.file, line=10, end_line=12, function="forward",
        occurrences=[[op_a, op_b, op_c], ...],      # forward root ops per occurrence; backward is added
        head="masked_fill -> softmax -> dropout",   # what ran, in words
        fused_kernels=1,                            # how many kernels the fix leaves
        est_saving_ms=0.8,                          # None when it cannot be estimated (CPU profiles)
        advice="use opadvisor.kernels.masked_softmax", details={...},
    )

The message reads "masked_fill -> softmax -> dropout: 3 kernels where 1 would do, 12x per step,
1.9 ms/step (15% of the step)". On a CPU profile times are CPU times, `evidence.time_basis` is "cpu", the
message says so, and no GPU number is invented. `source_status` is left "ok": the engine sets it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from opadvisor.profile.model import Op
from opadvisor.rules._chains import in_dtype, shape
from opadvisor.rules._index import ProfileIndex, owner_module
from opadvisor.rules.finding import Evidence, Finding, FixSafety

__all__ = [
    "build_finding",
    "cost_words",
    "fmt_ms",
    "fmt_share",
    "idle_cost",
    "module_pattern",
    "short_name",
]

_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def short_name(op_name: str) -> str:
    """ "aten::masked_fill_" -> "masked_fill_"; "autograd::engine::evaluate_function: X" -> "X"."""
    return op_name.rsplit(": ", 1)[-1].rsplit("::", 1)[-1]


def module_pattern(modules: Iterable[str | None]) -> str | None:
    """One module path for many: equal paths stay; paths differing only in indices get "*".

    ["h.0.attn", "h.1.attn"] -> "h.*.attn"; ["enc.attn", "dec.attn"] -> "enc.attn, dec.attn" (first two);
    all None -> None.
    """
    mods = sorted({m for m in modules if m is not None})
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]
    starred = sorted({_NUM.sub("*", m) for m in mods})
    if len(starred) == 1:
        return starred[0]
    return ", ".join(starred[:2]) + (", ..." if len(starred) > 2 else "")


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    if ms < 0:  # a cost (a fix that trades time for memory)
        return "-" + fmt_ms(-ms)
    if ms >= 10:
        return f"{ms:.0f} ms"
    if ms >= 0.1:
        return f"{ms:.2g} ms" if ms < 1 else f"{ms:.1f} ms"
    return f"{ms * 1000:.0f} us"


def fmt_share(share: float | None) -> str:
    if share is None:
        return "n/a"
    pct = share * 100
    return f"{pct:.0f}%" if pct >= 1 else f"{pct:.1f}%"


def cost_words(ix: ProfileIndex, ms: float | None, share: float | None) -> str:
    """ "1.9 ms/step (15% of the step)"; on a CPU profile "1.9 ms/step of CPU time (15% of the step)"."""
    if ms is None:
        return "time not measured"
    basis = "" if ix.gpu else " of CPU time"
    tail = f" ({fmt_share(share)} of the step)" if share is not None else ""
    return f"{fmt_ms(ms)}/step{basis}{tail}"


def idle_cost(ix: ProfileIndex, profiled_ms: float) -> tuple[float, float | None, str]:
    """A GPU idle time measured under the profiler, as the plain step has it: (ms, share, words).

    Scaled by the run's calibration (`_calibration`); the words say both when they differ:
    "1.9 ms/step (15% of the step; 4.2 ms under the profiler)".
    """
    ms = ix.calibration.idle_ms(profiled_ms)
    share = ix.share_of_step(ms)
    words = cost_words(ix, ms, share)
    if ix.calibration.calibrated and fmt_ms(ms) != fmt_ms(profiled_ms):
        tail = f"; {fmt_ms(profiled_ms)} under the profiler"
        words = words[:-1] + tail + ")" if words.endswith(")") else words + f" ({tail[2:]})"
    return ms, share, words


def build_finding(
    ix: ProfileIndex,
    *,
    rule: str,
    fix: FixSafety,
    path: str,
    line: int,
    end_line: int,
    occurrences: Sequence[Sequence[Op]],
    head: str,
    function: str | None = None,
    fused_kernels: int | None = 1,
    est_saving_ms: float | None = None,
    advice: str = "",
    details: dict | None = None,
    notes: Sequence[str] = (),
    backward: bool = True,
) -> Finding:
    """A Finding for one source site from the forward root ops of each occurrence (see module doc)."""
    first = list(occurrences[0]) if occurrences else []
    every = [op for occ in occurrences for op in occ]
    total_us = ix.site_cost_us(every, backward=backward)
    ms = ix.per_step_ms(total_us) if every else None
    share = ix.share_of_step(ms)
    per_step = max(1, round(len(occurrences) / ix.steps_recorded))
    kernels_per_step = (
        round(ix.site_kernels(every, backward=backward) / ix.steps_recorded) if ix.gpu else None
    )
    message = _site_message(ix, head, first, fused_kernels, per_step, ms, share)
    evidence = Evidence(
        ops=[op.name for op in first],
        kernel_count=kernels_per_step,
        shapes=[s for s in (shape(op, 0) for op in first) if s is not None],
        dtypes=[d for d in (in_dtype(op) for op in first) if d is not None],
        time_ms_per_step=ms,
        share_of_step=share,
        time_basis=ix.basis if every else "none",  # type: ignore[arg-type]
        occurrences=per_step,
        notes=list(notes),
    )
    if not ix.gpu:
        evidence.notes.append("CPU profile: times are CPU op times; profile on a GPU for kernel times")
    return Finding(
        rule=rule,
        path=path,
        line=line,
        end_line=end_line,
        message=message,
        fix=fix,
        function=function,
        module=module_pattern(owner_module(op) or None for op in every),
        evidence=evidence,
        time_ms_per_step=ms,
        est_saving_ms_per_step=est_saving_ms,
        advice=advice,
        details=dict(details or {}),
    )


def _site_message(
    ix: ProfileIndex,
    head: str,
    first: list[Op],
    fused_kernels: int | None,
    per_step: int,
    ms: float | None,
    share: float | None,
) -> str:
    """ "head: 3 kernels where one would do, 2x per step, 1.9 ms/step (15%)" (ops on a CPU profile)."""
    if ix.gpu:
        fwd_kernels = sum(ix.kernel_count(op) for op in first)
        what = f"{fwd_kernels} kernels" if fwd_kernels != 1 else "1 kernel"
    else:
        fwd_kernels = len(first)
        what = f"{fwd_kernels} separate ops"
    parts = [head + ":"]
    if fused_kernels is not None and fwd_kernels > fused_kernels:
        parts.append(f"{what} where {'one' if fused_kernels == 1 else fused_kernels} would do,")
    if per_step > 1:
        parts.append(f"{per_step}x per step,")
    parts.append(cost_words(ix, ms, share))
    return " ".join(parts)
