"""Two runs compared (before and after `opadvisor apply`, two commits): what got faster, what got slower.

    from opadvisor.report.diff import compare, to_json

    d = compare(Side(run_a, profiles_a, report_a), Side(run_b, profiles_b, report_b))
    d.step                      # Change of the median step time (suggest's `step_ms`)
    d.breakdown                 # [Change] per part of the step breakdown, largest change first
    d.findings                  # [FindingChange] fixed / new / changed findings, largest change first
    d.ops                       # [Change] time per step by op name, largest change first
    to_json(d)                  # the `opadvisor diff --format json` document (schema DIFF_SCHEMA)

A pure function of what `suggest` already computes for each run (`rules.engine.analyse`, the breakdown,
the per-op totals of `profile.summary`). Each change is B minus A, in ms per step, and ranked by its
size. Multi-rank runs: the step, breakdown and ops are rank 0's (as `suggest` reports them); per-rank step
times are compared when both runs have the same ranks.

Findings are matched by rule and file first on the same lines, then, for lines that moved (an edit
above them), on the same function in the order they appear; a finding of A with no match in B is "fixed"
(gone), one of B with no match in A is "new". Runs measured on different devices or time bases (a CPU and
a GPU profile) are compared all the same, with a note saying the numbers do not measure the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from opadvisor.profile.model import Profile
from opadvisor.profile.summary import summarize
from opadvisor.rules.engine import Report
from opadvisor.rules.finding import Finding
from opadvisor.rules.overview import breakdown, median_step_ms

__all__ = ["DIFF_SCHEMA", "Change", "FindingChange", "RunDiff", "Side", "compare", "to_json"]

DIFF_SCHEMA = 1


@dataclass
class Side:
    """One run as `suggest` sees it."""

    run_dir: Path
    profiles: Sequence[Profile]
    report: Report


@dataclass
class Change:
    name: str
    a_ms: float | None
    b_ms: float | None
    a_calls: float | None = None  # ops: calls per step
    b_calls: float | None = None

    @property
    def delta_ms(self) -> float | None:
        if self.a_ms is None and self.b_ms is None:
            return None
        return (self.b_ms or 0.0) - (self.a_ms or 0.0)

    @property
    def pct(self) -> float | None:
        """B's change as a percentage of A (None when A is zero or unknown)."""
        if not self.a_ms or self.b_ms is None:
            return None
        return (self.b_ms - self.a_ms) / self.a_ms * 100.0


@dataclass
class FindingChange:
    rule: str
    path: str
    status: Literal["fixed", "new", "changed"]
    a_line: int | None
    b_line: int | None
    a_ms: float | None
    b_ms: float | None
    message: str  # B's message when the finding is still there, else A's

    @property
    def delta_ms(self) -> float | None:
        if self.a_ms is None and self.b_ms is None:
            return None
        return (self.b_ms or 0.0) - (self.a_ms or 0.0)


@dataclass
class RunDiff:
    a: Side
    b: Side
    step: Change
    breakdown: list[Change]
    findings: list[FindingChange]
    ops: list[Change]
    ranks: list[Change] = field(default_factory=list)
    basis: str = "gpu"  # "gpu", "cpu", or "mixed" (the runs differ: see notes)
    notes: list[str] = field(default_factory=list)

    def slower_by_more_than(self, pct: float) -> bool:
        """True when B's step is slower than A's by more than `pct` percent (the CI gate)."""
        change = self.step.pct
        return change is not None and change > pct


def _device(profile: Profile) -> str:
    env = profile.environment
    return env.gpu_name if env.device == "cuda" and env.gpu_name else env.device


def _by_size(changes: list[Any]) -> list[Any]:
    return sorted(changes, key=lambda c: (-abs(c.delta_ms or 0.0), c.name if hasattr(c, "name") else ""))


def _breakdown_changes(a: Profile, b: Profile) -> list[Change]:
    parts_a = {p["name"]: p["ms"] for p in breakdown(a)["parts"]}
    parts_b = {p["name"]: p["ms"] for p in breakdown(b)["parts"]}
    names = list(parts_a) + [n for n in parts_b if n not in parts_a]
    return _by_size([Change(n, parts_a.get(n), parts_b.get(n)) for n in names])


def _op_changes(a: Profile, b: Profile) -> list[Change]:
    totals_a = {o.name: o for o in summarize(a, top=1 << 30).top_ops}
    totals_b = {o.name: o for o in summarize(b, top=1 << 30).top_ops}
    out = []
    for name in list(totals_a) + [n for n in totals_b if n not in totals_a]:
        oa, ob = totals_a.get(name), totals_b.get(name)
        out.append(
            Change(
                name,
                oa.ms_per_step if oa else None,
                ob.ms_per_step if ob else None,
                oa.calls_per_step if oa else None,
                ob.calls_per_step if ob else None,
            )
        )
    return _by_size([c for c in out if c.delta_ms or c.a_calls != c.b_calls])


def _match_findings(fa: list[Finding], fb: list[Finding]) -> list[FindingChange]:
    """Pair A's findings with B's: same rule, file and lines; else same rule, file and function in order."""
    pairs: list[tuple[Finding | None, Finding | None]] = []
    left_b = list(fb)
    unmatched_a = []
    for f in fa:
        g = next(
            (
                g
                for g in left_b
                if (g.rule, g.path, g.line, g.end_line) == (f.rule, f.path, f.line, f.end_line)
            ),
            None,
        )
        if g is None:
            unmatched_a.append(f)
        else:
            left_b.remove(g)
            pairs.append((f, g))
    for f in sorted(unmatched_a, key=lambda f: f.line):
        candidates = [g for g in left_b if (g.rule, g.path, g.function) == (f.rule, f.path, f.function)]
        g = min(candidates, key=lambda g: g.line) if candidates else None
        if g is not None:
            left_b.remove(g)
        pairs.append((f, g))
    pairs += [(None, g) for g in left_b]
    out = []
    for f, g in pairs:
        status = "changed" if f and g else ("fixed" if f else "new")
        both = g or f
        assert both is not None
        out.append(
            FindingChange(
                rule=both.rule,
                path=both.path,
                status=status,  # type: ignore[arg-type]
                a_line=f.line if f else None,
                b_line=g.line if g else None,
                a_ms=f.time_ms_per_step if f else None,
                b_ms=g.time_ms_per_step if g else None,
                message=both.message,
            )
        )
    return sorted(out, key=lambda c: (-abs(c.delta_ms or 0.0), c.path, c.a_line or c.b_line or 0, c.rule))


def _rank_changes(a: Sequence[Profile], b: Sequence[Profile]) -> list[Change]:
    if len(a) < 2 or [p.rank for p in a] != [p.rank for p in b]:
        return []
    return [
        Change(f"rank {pa.rank}", median_step_ms(pa), median_step_ms(pb)) for pa, pb in zip(a, b, strict=True)
    ]


def _notes(a: Profile, b: Profile, basis_a: str, basis_b: str) -> list[str]:
    notes = []
    if basis_a != basis_b:
        notes.append(
            f"A was profiled on {_device(a)} and B on {_device(b)}: GPU and CPU times do not measure the "
            "same thing, so these changes say little"
        )
    elif _device(a) != _device(b):
        notes.append(f"A was profiled on {_device(a)} and B on {_device(b)}: the devices differ")
    if Path(a.script).name != Path(b.script).name:
        notes.append(f"the runs profiled different scripts ({Path(a.script).name}, {Path(b.script).name})")
    for side, p in (("A", a), ("B", b)):
        if not p.complete:
            notes.append(f"{side} is incomplete: {len(p.steps)} of {p.steps_requested} steps recorded")
    return notes


def compare(a: Side, b: Side) -> RunDiff:
    """What changed from run A to run B (both as `suggest` analyses them)."""
    pa, pb = a.profiles[0], b.profiles[0]
    basis_a, basis_b = ("gpu" if p.has_gpu else "cpu" for p in (pa, pb))
    return RunDiff(
        a=a,
        b=b,
        step=Change("step", median_step_ms(pa), median_step_ms(pb)),
        breakdown=_breakdown_changes(pa, pb),
        findings=_match_findings(a.report.findings, b.report.findings),
        ops=_op_changes(pa, pb),
        ranks=_rank_changes(a.profiles, b.profiles),
        basis=basis_a if basis_a == basis_b else "mixed",
        notes=_notes(pa, pb, basis_a, basis_b),
    )


# ---- JSON ---------------------------------------------------------------------------------------


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def _change_json(c: Change) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": c.name,
        "a_ms": _round(c.a_ms),
        "b_ms": _round(c.b_ms),
        "delta_ms": _round(c.delta_ms),
        "pct": _round(c.pct, 1),
    }
    if c.a_calls is not None or c.b_calls is not None:
        out["a_calls"], out["b_calls"] = _round(c.a_calls, 2), _round(c.b_calls, 2)
    return out


def _side_json(side: Side, display: Any) -> dict[str, Any]:
    p = side.profiles[0]
    return {
        "run": display(str(side.run_dir)),
        "script": display(p.script) if p.script else None,
        "device": _device(p),
        "ranks": len(side.profiles),
        "steps": len(p.steps),
        "step_ms": _round(median_step_ms(p)),
    }


def to_json(d: RunDiff, display: Any = str, fail_above: float | None = None) -> dict[str, Any]:
    """The `opadvisor diff --format json` document; `display` turns absolute paths into shown ones."""
    findings = []
    for f in d.findings:
        entry = asdict(f)
        entry["path"] = display(f.path)
        entry["a_ms"], entry["b_ms"], entry["delta_ms"] = _round(f.a_ms), _round(f.b_ms), _round(f.delta_ms)
        findings.append(entry)
    doc: dict[str, Any] = {
        "schema": DIFF_SCHEMA,
        "a": _side_json(d.a, display),
        "b": _side_json(d.b, display),
        "basis": d.basis,
        "step": _change_json(d.step),
        "breakdown": [_change_json(c) for c in d.breakdown],
        "findings": findings,
        "ops": [_change_json(c) for c in d.ops],
        "ranks": [_change_json(c) for c in d.ranks],
        "notes": d.notes,
    }
    if fail_above is not None:
        doc["fail_above"] = fail_above
        doc["regressed"] = d.slower_by_more_than(fail_above)
    return doc
