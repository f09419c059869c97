"""Dry runs: can the codemod rewrite the site a finding names? `suggest` offers only fixes that pass.

    from opadvisor.rewrite.check import check_fixes, rank_applicable
    check_fixes(findings)               # a finding whose fix cannot be made gets fix "none" and fix_blocked
    findings = rank_applicable(findings)

Each (file, rule) is rewritten once in memory with every finding of that rule in the file as a target,
exactly as `opadvisor apply` would (each finding's facts included), and nothing is
written. A finding passes when the rewrite changed lines inside its range. Otherwise its `fix` becomes
"none" and `fix_blocked` says why: the codemod's own reason (the scale is a tensor, the weights are
returned ...), or that it found no code it can rewrite there. Findings whose file changed since the
profile are left as they are (apply refuses the file anyway and `suggest` warns about it).

Two findings that are alternatives (sdpa_attention and fused_softmax on the same lines) are ranked so
that the one that can be applied comes first: a blocked one sorts right after its applicable alternative.

Profile mode of `opadvisor apply` is built on these verdicts: `apply_run(rule, run)` analyses the run the
same way (`analyse_checked`), selects the findings of `rule` and hands them to the engine
(`engine.apply_findings`). It lives here rather than in engine.py, which the dry runs are made of, or in
a module of its own, which tests/rewrite/test_registry.py would take for a fix out of its family package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.rewrite import registry
from opadvisor.rewrite.base import finding_target
from opadvisor.rewrite.engine import (
    ApplyResult,
    apply_findings,
    dry_run,
    load_applied,
    say_withheld,
    selected_rules,
    sha256,
)

__all__ = ["analyse_checked", "apply_run", "check_fixes", "rank_applicable"]


def analyse_checked(
    profiles: Sequence[Any], run_dir: Path | None = None, *, check: bool = True, **options: Any
) -> Any:
    """The run's findings with their fix verdicts, computed once the same way for suggest, report and
    apply (issue 30): `rules.engine.analyse(profiles, **options)`, each fix dry-run on its file as
    profiled (`check_fixes` with `as_profiled(run_dir, ...)`, unless `check` is False) and alternatives
    ranked (`rank_applicable`)."""
    from opadvisor.rules.engine import analyse

    report = analyse(profiles, **options)
    if check:
        sources = {path: digest for p in profiles for path, digest in p.sources.items()}
        check_fixes(report.findings, as_profiled(run_dir, sources) if run_dir is not None else None)
        report.findings = rank_applicable(report.findings)
    return report


def apply_run(
    rule: str,
    run: str | None = None,
    *,
    allow_unsafe: bool = False,
    force: bool = False,
    write: bool = True,
) -> ApplyResult:
    """Profile mode: apply the fixes for the findings of `rule` (or "all") in a run."""
    from opadvisor.profile.runs import load_run

    messages: list[str] = []
    rules, withheld = selected_rules(rule, allow_unsafe, messages)
    run_dir, profiles = load_run(run)
    # a rule named by --rule is asked for: one that reports only on request (the memory rule) reports
    asked = [] if rule == "all" else rules
    selected = rules + withheld
    # the fix verdicts suggest and report show (a dry run per finding), computed the same single way
    report = analyse_checked(profiles, run_dir, select=selected, requested=asked) if selected else None
    findings = report.findings if report is not None else []
    say_withheld(withheld, {f.rule for f in findings}, messages)
    findings = [f for f in findings if f.rule not in withheld]
    for note in report.notes if report is not None else []:
        if note.rule in withheld:
            continue
        if note.failed and rule != "all":
            raise UserError(
                f"the {note.rule} rule crashed on this profile, so nothing was applied: "
                f"{note.message.removeprefix('rule failed on this profile ')} (a bug in opadvisor: please report it)"
            )
        if note.failed:
            messages.append(
                f"{note.rule}: error: the rule crashed on this profile, its fixes were not applied: "
                f"{note.message.removeprefix('rule failed on this profile ')} (a bug in opadvisor: please report it)"
            )
        else:
            messages.append(f"{note.rule}: not checked on this profile: {note.message}")
    sources: dict[str, str] = {}
    for profile in profiles:
        sources.update(profile.sources)
    return apply_findings(
        findings,
        rules,
        run_dir,
        sources,
        allow_unsafe=allow_unsafe,
        force=force,
        write=write,
        messages=messages,
        explicit_rule=None if rule == "all" else rule,
    )


def as_profiled(run_dir: Path, sources: dict[str, str]) -> Callable[[str], bytes | None]:
    """path -> the file as profiled: the copy the run keeps, else the backup an earlier apply of this run
    made, else the file itself while it still has the profiled hash; None when none of these is at hand."""
    from opadvisor.profile.runs import profiled_source

    applied = load_applied(run_dir)["applied"]

    def source_of(path: str) -> bytes | None:
        digest = sources.get(path)
        kept = profiled_source(run_dir, digest)
        if kept is not None:
            return kept
        backups = [e["backup"] for e in applied if isinstance(e, dict) and e.get("path") == path]
        try:
            if backups:
                return (run_dir / backups[0]).read_bytes()
            now = Path(path).read_bytes()
        except OSError:
            return None
        return now if digest is None or sha256(now) == digest else None

    return source_of


def check_fixes(findings: Sequence[Any], source_of: Callable[[str], bytes | None] | None = None) -> None:
    """Dry-run the fix of every finding that has one; block those the codemod cannot make (see module doc).

    `source_of` (path -> the file as profiled, None when unknown: `as_profiled`) judges each site where the
    finding's lines are, whatever was done to the file since; without it the file itself is read, and a
    file changed since the profile is left unjudged."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for f in findings:
        if f.fix == "none" or not registry.has_codemod(f.rule):
            continue
        if source_of is None and f.source_status != "ok":
            continue
        if getattr(f, "library", None) is not None:
            continue  # in library code: its fix goes into the user's script another way (rewrite/library.py)
        groups.setdefault((f.path, f.rule), []).append(f)
    for (path, rule), group in groups.items():
        source = source_of(path) if source_of is not None else None
        if source_of is not None and source is None:
            continue  # the file as profiled is not at hand: apply judges it (or refuses it)
        facts_type = registry.get_codemod(rule).FACTS
        targets = [finding_target(f, facts_type) for f in group]
        for f, reason in zip(group, dry_run(Path(path), rule, targets, source), strict=True):
            if reason is not None:
                block(f, reason)
    for f in findings:  # an alternative's message no longer offers a blocked fix as the better one
        for g in findings:
            if getattr(g, "fix_blocked", None) and g.path == f.path and _names(f, g):
                f.message = f.message.replace(
                    f"{g.rule} there is the bigger win",
                    f"{g.rule} there would save more but cannot be applied",
                )


def _names(f: Any, g: Any) -> bool:
    """Whether finding f names g as its alternative."""
    alternative = getattr(f, "alternative", None)
    return alternative is not None and alternative.names(g)


def block(finding: Any, reason: str) -> None:
    """Mark a finding's fix as one that cannot be applied, with the reason."""
    finding.fix = "none"
    finding.fix_blocked = reason


def rank_applicable(findings: list[Any]) -> list[Any]:
    """`findings` in their order, except that a blocked finding with an applicable alternative on the same
    lines comes right after that alternative (suggest never ranks first a fix it cannot apply)."""
    out = [f for f in findings if not _displaced(f, findings)]
    for f in findings:
        partner = _displaced(f, findings)
        if partner is not None:
            out.insert(out.index(partner) + 1, f)
    return out


def _displaced(f: Any, findings: list[Any]) -> Any:
    alternative = getattr(f, "alternative", None)
    if not getattr(f, "fix_blocked", None) or alternative is None:
        return None
    for g in findings:
        if g is not f and alternative.names(g) and g.path == f.path and g.fix != "none":
            return g
    return None
