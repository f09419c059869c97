"""`opadvisor suggest`, `opadvisor rules`, `opadvisor explain`: findings ranked by measured time.

Parsing and rendering only: the report is built by `opadvisor.report.findings` (`suggest_report`, the JSON
document `suggest_document`, whose JSON schema ships as `opadvisor/rules/suggest_schema.py`, the table's
text), SARIF by `opadvisor.report.sarif`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from opadvisor.cli.common import EXIT_FINDINGS, user_errors, warn


def register(app: typer.Typer) -> None:
    """Add `suggest`, `rules` and `explain` to the app."""
    app.command("suggest")(suggest)
    app.command("rules")(rules)
    app.command("explain")(explain)


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@user_errors
def suggest(
    run: Annotated[str | None, typer.Argument(help="Run folder or run id (default: the latest run).")] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table, json or sarif.")] = "table",
    sort: Annotated[
        str, typer.Option(help="Rank by 'time' (measured per step) or 'saving' (estimated).")
    ] = "time",
    select: Annotated[
        list[str] | None, typer.Option(help="Only these rule ids (repeat or comma-separate).")
    ] = None,
    ignore: Annotated[
        list[str] | None, typer.Option(help="Skip these rule ids (repeat or comma-separate).")
    ] = None,
    exit_code: Annotated[
        bool, typer.Option("--exit-code", help="Exit 1 when there are findings (for CI).")
    ] = False,
    memory: Annotated[
        bool,
        typer.Option(
            "--memory",
            help="Report the modules holding the most activation memory, with the checkpointing fix, "
            "whatever the step's peak (rules named by --select are asked the same way).",
        ),
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Dry-run each fix on its file and offer only those the rewrite can make (the default).",
        ),
    ] = True,
) -> None:
    """Explain where the run loses time: a breakdown of the step, then findings ranked by time per step.

    Each finding gives file:line, the rule, the evidence (kernels, time per step, share of the step), the
    estimated saving and the command that fixes it. `--format json` prints the documented contract,
    `--format sarif` SARIF 2.1.0 for code-scanning tools.
    """
    from opadvisor.errors import UserError
    from opadvisor.report.findings import source_warnings, suggest_document, suggest_report

    if format not in ("table", "json", "sarif"):
        raise UserError(f"unknown format {format!r}; use table, json or sarif")
    if sort not in ("time", "saving"):
        raise UserError(f"unknown sort {sort!r}; use time or saving")
    run_dir, profiles, report = suggest_report(
        run, select=_split(select), ignore=_split(ignore), sort=sort, memory=memory, check=check
    )
    for line in source_warnings(report.findings):
        warn(line)
    if format == "json":
        print(json.dumps(suggest_document(run_dir, profiles, report), indent=2))
    elif format == "sarif":
        from opadvisor.report.sarif import sarif_document

        print(json.dumps(sarif_document(report, profiles), indent=2))
    else:
        _render_table(run_dir, profiles, report, run)
    if exit_code and report.findings:
        raise typer.Exit(EXIT_FINDINGS)


# ---- table -----------------------------------------------------------------------------------


def _render_table(run_dir: Path, profiles, report, run_arg: str | None) -> None:
    import sys

    from rich.console import Console

    from opadvisor.profile.summary import memory_text
    from opadvisor.report.findings import header_words, incomplete_words, step_line

    # a terminal gets its own width; a pipe or a CI log gets 120 columns, so commands are not folded
    console = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)
    first = profiles[0]
    step = step_line(first)
    shown_run, words = header_words(run_dir, profiles)
    console.print(f"[bold]{shown_run}[/bold]  {words}")
    incomplete = incomplete_words(profiles)
    if incomplete:
        console.print(f"[bold yellow]{incomplete[0].upper()}{incomplete[1:]}[/bold yellow]")
    if not first.steps:
        return  # issue 30: stopped in the warm-up; the sentence above says what to do
    console.print(step)
    memory = memory_text(first)
    if memory is not None:
        console.print(memory)
    if not report.findings:
        console.print("No findings." + (" (rules run: " + ", ".join(report.rules_run) + ")"))
    else:
        console.print(_findings_table(report, profiles, run_arg))
    _render_notes(console, profiles, report)


def _findings_table(report, profiles, run_arg: str | None):  # noqa: ANN202 - a rich Table
    from rich.table import Table

    from opadvisor.report.findings import table_row

    table = Table(show_lines=True, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("time/step", justify="right")
    table.add_column("saving", justify="right")
    table.add_column("where / rule", overflow="fold")
    table.add_column("what it found / fix", overflow="fold", ratio=1)
    for i, f in enumerate(report.findings, 1):
        table.add_row(*table_row(i, f, profiles, run_arg))
    return table


def _render_notes(console, profiles, report) -> None:  # noqa: ANN001 - a rich Console
    from opadvisor.report.findings import compiled_words, note_lines

    first = profiles[0]
    if len(profiles) > 1:
        from opadvisor.ranks import cross_rank

        console.print(cross_rank.render(cross_rank.analyse(profiles)))
    for line in note_lines(report.notes):
        console.print(line, soft_wrap=True)  # one line, folded by the terminal only
    if report.compiled:
        console.print(compiled_words(report.compiled))
    if first.eager:
        console.print("Profiled with --eager: torch.compile was switched off, so times are eager times.")
    if first.environment.device != "cuda":
        console.print("CPU profile: times are CPU op times; savings need kernel times: profile on a GPU.")


# ---- rules / explain -------------------------------------------------------------------------


@user_errors
def rules() -> None:
    """List the rules: id, fix safety and what each finds."""
    from opadvisor.rewrite.registry import has_codemod
    from opadvisor.rules import registry

    width = max(len(r) for r in registry.rule_ids())
    for rid in registry.rule_ids():
        try:
            mod = registry.get_rule(rid)
        except ImportError:
            print(f"{rid:<{width}}  (not available in this build)")
            continue
        fix = registry.fix_safety(mod)
        if not has_codemod(rid) and mod.FIX != "none":
            fix += ", no codemod yet"
        print(f"{rid:<{width}}  {mod.TITLE} [fix: {fix}]")
    print("\n`opadvisor explain RULE` says what a rule finds, why it is slow, and how it is fixed.")


@user_errors
def explain(rule: Annotated[str, typer.Argument(help="A rule id (see `opadvisor rules`).")]) -> None:
    """Print a rule's documentation: what it finds, why it is slow, an example, the fix and its safety."""
    from opadvisor.rules import registry

    mod = registry.get_rule(rule)
    print(f"{mod.ID}: {mod.TITLE} (fix: {registry.fix_safety(mod)})\n")
    print(_dedent_doc(mod.__doc__ or ""))


def _dedent_doc(doc: str) -> str:
    import inspect

    return inspect.cleandoc(doc)
