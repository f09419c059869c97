"""Profile mode of `opadvisor apply`: the fixes of a run's findings, with the verdicts suggest shows.

    from opadvisor.rewrite.apply import apply_run
    result = apply_run("fused_softmax", run=None, write=False)   # an engine.ApplyResult

The run's findings are analysed with their fix verdicts (`check.analyse_checked`, the same single way as
`suggest` and `report`), the rules `--rule` names are selected, and the engine applies them
(`engine.apply_findings`: refusals, line mapping, checks, diff, backup; see engine.py).
"""

from __future__ import annotations

from opadvisor.errors import UserError
from opadvisor.rewrite.check import analyse_checked
from opadvisor.rewrite.engine import ApplyResult, apply_findings, say_withheld, selected_rules

__all__ = ["apply_run"]


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
