"""The rule engine: run the selected rules on every rank's profile, merge, check sources, rank.

    from opadvisor.rules.engine import analyse, run_rules

    findings = run_rules(profiles, select=["fused_softmax"], ignore=None)   # list[Finding], ranked
    report = analyse(profiles)          # Report: findings + notes (rules that do not apply) + breakdown

A rule that cannot judge a profile (sparse_launch on a CPU profile) raises `NotApplicable("why")` from
its `detect`; the engine turns that into a `Note`, never into a finding. A rule that fails unexpectedly
becomes a note too (its id and the error in one line), so one bad rule never hides the others' findings.

A rule that holds findings back unless the user asks (the memory rule: it reports only when the step's
peak is high against the device) sets `ON_REQUEST = True` and takes `detect(profile, requested=...)`: it
is asked when its id is in `requested` (`suggest --memory`, or the rule named by `apply --rule R`).

Rules run on the profile's pattern view (`_library.pattern_view`): an op issued in an installed library's
code carries the library's file and line, so a finding names the place where its pattern is written; such
a finding gets `library` (package, module class, the user's call site, the fix for library code).

Multi-rank runs: every rule runs on every rank; findings at the same rule and lines merge into one, with
`ranks` listing where they were found and the largest per-step time of any rank (the slowest rank sets
the step). `source_status` is set per finding by hashing the file now against `profile.sources`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from opadvisor.errors import UserError
from opadvisor.profile.model import Profile
from opadvisor.rules import registry
from opadvisor.rules._compiled import compiled_regions
from opadvisor.rules._library import describe_library, pattern_view
from opadvisor.rules._source import source_status
from opadvisor.rules.finding import Alternative, Finding

__all__ = [
    "NeedsGpuProfile",
    "NotApplicable",
    "Note",
    "Report",
    "analyse",
    "run_rules",
    "select_rules",
    "sort_findings",
]

SortKey = Literal["time", "saving"]


class NotApplicable(Exception):
    """Raised by a rule's `detect` when the profile cannot answer it (e.g. needs a GPU profile)."""


class NeedsGpuProfile(NotApplicable):
    """Raised by a rule's `detect` on a CPU profile: what it measures exists only on a GPU.

    `why` says what cannot be measured here; `hint`, when given, what the profile did show that a GPU
    profile would measure (the table folds these notes into one line and keeps the hints).
    """

    def __init__(self, why: str, hint: str = ""):
        super().__init__(f"needs a CUDA profile: {why}" + (f"; {hint}" if hint else ""))
        self.hint = hint


@dataclass
class Note:
    """A rule that did not apply to the profile, or failed: said to the user apart from findings."""

    rule: str
    message: str
    ranks: list[int] | None = None
    needs_gpu: bool = False  # the rule cannot judge a CPU profile (NeedsGpuProfile)
    hint: str = ""  # NeedsGpuProfile's hint
    failed: bool = False  # the rule crashed (a bug), rather than not applying to this profile


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    rules_run: list[str] = field(default_factory=list)
    # time inside torch.compile graphs, which no rule sees into (see _compiled.py); None: none ran
    compiled: dict | None = None


def select_rules(select: Sequence[str] | None = None, ignore: Sequence[str] | None = None) -> list[str]:
    """Rule ids to run, in registry order; an unknown id is a UserError naming the known ones."""
    known = registry.rule_ids()
    for rid in [*(select or ()), *(ignore or ())]:
        if rid not in known:
            raise UserError(f"unknown rule {rid!r}; known rules: {', '.join(known)}")
    chosen = [r for r in known if not select or r in select]
    return [r for r in chosen if r not in set(ignore or ())]


def _sort_value(f: Finding, by: SortKey) -> float:
    v = f.est_saving_ms_per_step if by == "saving" else f.time_ms_per_step
    if v is None and by == "saving":
        v = f.time_ms_per_step  # no estimate: fall back to the measured time, below any estimate tie
        return -1.0 if v is None else v * 1e-6
    return -1.0 if v is None else v


def sort_findings(findings: list[Finding], by: SortKey = "time") -> list[Finding]:
    """Largest first by time per step (or estimated saving); ties by file and line for a stable order."""
    return sorted(findings, key=lambda f: (-_sort_value(f, by), f.path, f.line, f.rule))


def _merge(per_rank: list[tuple[int, list[Finding]]], multi: bool) -> list[Finding]:
    merged: dict[tuple, Finding] = {}
    for rank, found in per_rank:
        for f in found:
            key = (f.rule, f.path, f.line, f.end_line)
            have = merged.get(key)
            if have is None:
                if multi:
                    f.ranks = [rank]
                merged[key] = f
                continue
            if (f.time_ms_per_step or 0.0) > (have.time_ms_per_step or 0.0):
                f.ranks = have.ranks
                merged[key] = have = f
            if have.ranks is not None and rank not in have.ranks:
                have.ranks.append(rank)
    return list(merged.values())


def analyse(
    profiles: Sequence[Profile],
    select: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    *,
    sort: SortKey = "time",
    requested: Sequence[str] = (),
) -> Report:
    """Run the selected rules on every profile; findings merged across ranks and ranked.

    `requested`: rule ids the user asked for by name; a rule with `ON_REQUEST` reports then what it would
    otherwise hold back."""
    rule_ids = select_rules(select, ignore)
    multi = len(profiles) > 1
    report = Report(rules_run=rule_ids)
    per_rank: list[tuple[int, list[Finding]]] = []
    notes: dict[tuple[str, str], Note] = {}
    for user_profile in profiles:
        profile = pattern_view(user_profile)
        found: list[Finding] = []
        for rid in rule_ids:
            try:
                rule = registry.get_rule(rid)
                if getattr(rule, "ON_REQUEST", False):
                    found.extend(rule.detect(profile, requested=rid in requested))
                else:
                    found.extend(rule.detect(profile))
            except NeedsGpuProfile as exc:
                note = _note(notes, rid, str(exc), profile.rank, multi)
                note.needs_gpu, note.hint = True, exc.hint
            except NotApplicable as exc:
                _note(notes, rid, str(exc), profile.rank, multi)
            except Exception as exc:  # noqa: BLE001 - one failing rule must not hide the others
                _note(
                    notes,
                    rid,
                    f"rule failed on this profile ({type(exc).__name__}: {exc})",
                    profile.rank,
                    multi,
                    failed=True,
                )
        for f in found:
            if f.source_status == "ok":
                f.source_status = source_status(profile, f.path)
            describe_library(f, profile)
        per_rank.append((profile.rank, found))
    report.findings = sort_findings(_merge(per_rank, multi), sort)
    link_alternatives(report.findings)
    report.notes = list(notes.values())
    if profiles:
        report.compiled = compiled_regions(profiles[0])
    return report


def link_alternatives(findings: list[Finding]) -> None:
    """Findings whose fixes rewrite the same lines another way (a rule's `ALTERNATIVES`) name each other.

    Each gets its `alternative` (the other's rule and lines, and whether this one is the bigger win) and a
    message tail saying which of the two saves more (by estimated saving; without estimates, the one covering more
    time). Both findings stand: the user applies one.
    """
    by_path: dict[str, list[Finding]] = {}
    for f in findings:
        by_path.setdefault(f.path, []).append(f)
    for f in findings:
        try:
            alternatives = getattr(registry.get_rule(f.rule), "ALTERNATIVES", ())
        except (ImportError, UserError):
            continue
        for g in by_path.get(f.path, ()):
            if g is f or g.rule not in alternatives or g.end_line < f.line or g.line > f.end_line:
                continue
            mine, theirs = f.est_saving_ms_per_step, g.est_saving_ms_per_step
            if mine is None or theirs is None:
                mine, theirs = f.time_ms_per_step or 0.0, g.time_ms_per_step or 0.0
            bigger = mine > theirs
            f.alternative = Alternative(g.rule, g.line, g.end_line, bigger)
            tail = "this is the bigger win" if bigger else f"{g.rule} there is the bigger win"
            f.message += f"; or {g.rule} (lines {g.line}-{g.end_line}): {tail}"


def _note(
    notes: dict[tuple[str, str], Note], rid: str, message: str, rank: int, multi: bool, failed: bool = False
) -> Note:
    note = notes.setdefault((rid, message), Note(rid, message, [] if multi else None, failed=failed))
    if note.ranks is not None and rank not in note.ranks:
        note.ranks.append(rank)
    return note


def run_rules(
    profiles: list[Profile],
    select: list[str] | None = None,
    ignore: list[str] | None = None,
    requested: Sequence[str] = (),
) -> list[Finding]:
    """Findings of the selected rules on all ranks, merged (equal findings get `ranks`), largest first."""
    return analyse(profiles, select, ignore, requested=requested).findings
