"""`opadvisor diff RUN_A RUN_B`: what changed between two runs, largest change first; a CI gate.

Rendering only: the comparison is `opadvisor.report.diff.compare`, its JSON `opadvisor.report.diff.to_json`.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from opadvisor.cli.common import EXIT_FINDINGS, user_errors
from opadvisor.report.findings import display_path


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)


@user_errors
def diff(
    run_a: Annotated[str, typer.Argument(help="The run to compare from (folder or run id): 'before'.")],
    run_b: Annotated[
        str | None, typer.Argument(help="The run to compare to (default: the latest run): 'after'.")
    ] = None,
    format: Annotated[str, typer.Option("--format", "-f", help="table or json.")] = "table",
    fail_above: Annotated[
        float | None,
        typer.Option(
            help="Exit 1 when B's step is slower than A's by more than this many percent (a CI gate).",
            min=0,
        ),
    ] = None,
    top: Annotated[int, typer.Option(help="Ops to list in the table (json lists all).", min=1)] = 15,
) -> None:
    """Compare two runs: the step time, its breakdown, the findings (fixed, new, changed) and the time of
    each op, every change as B minus A in ms per step, ranked by its size.

    Example (before and after a fix):  opadvisor diff RUN_BEFORE RUN_AFTER --fail-above 5
    """
    from opadvisor.errors import UserError
    from opadvisor.profile.runs import load_run
    from opadvisor.report.diff import Side, compare, to_json
    from opadvisor.rules.engine import analyse

    if format not in ("table", "json"):
        raise UserError(f"unknown format {format!r}; use table or json")
    sides = []
    for run in (run_a, run_b):
        run_dir, profiles = load_run(run)
        sides.append(Side(run_dir, profiles, analyse(profiles)))
    if sides[0].run_dir.resolve() == sides[1].run_dir.resolve():
        raise UserError(f"both sides are the same run ({display_path(str(sides[0].run_dir))}): name two runs")
    d = compare(sides[0], sides[1])
    if format == "json":
        print(json.dumps(to_json(d, display_path, fail_above), indent=2))
    else:
        _render(d, top, fail_above)
    if fail_above is not None and d.slower_by_more_than(fail_above):
        raise typer.Exit(EXIT_FINDINGS)


def _signed(ms: float | None) -> str:
    from opadvisor.rules.overview import fmt_ms

    if ms is None:
        return "n/a"
    return ("+" if ms > 0 else "-" if ms < 0 else "") + fmt_ms(abs(ms))


def _pct(pct: float | None) -> str:
    return "" if pct is None else f"{pct:+.1f}%"


def _render(d, top: int, fail_above: float | None) -> None:
    from rich.console import Console

    from opadvisor.rules.overview import fmt_ms

    console = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)
    for label, side in (("A", d.a), ("B", d.b)):
        p = side.profiles[0]
        ranks = f", {len(side.profiles)} ranks" if len(side.profiles) > 1 else ""
        device = p.environment.gpu_name if p.has_gpu and p.environment.gpu_name else "CPU"
        console.print(
            f"{label}: {display_path(str(side.run_dir))}  {display_path(p.script)}  on {device}{ranks}, "
            f"{len(side.report.findings)} findings"
        )
    s = d.step
    speed = ""
    if s.a_ms and s.b_ms:
        ratio = s.a_ms / s.b_ms
        speed = f", {ratio:.2f}x faster" if ratio >= 1 else f", {1 / ratio:.2f}x slower"
    basis = {"gpu": "", "cpu": " (CPU times)", "mixed": " (mixed devices)"}[d.basis]
    console.print(
        f"[bold]Step{basis}: {fmt_ms(s.a_ms)} -> {fmt_ms(s.b_ms)} ({_signed(s.delta_ms)}, {_pct(s.pct)}{speed})[/bold]"
    )
    for note in d.notes:
        console.print(f"note: {note}")
    console.print(_changes_table("Step breakdown", d.breakdown, len(d.breakdown)))
    if d.ranks:
        console.print(_changes_table("Step time per rank", d.ranks, len(d.ranks)))
    console.print(_findings_table(d.findings))
    shown = min(top, len(d.ops))
    title = f"Ops by change in time per step (top {shown} of {len(d.ops)} that changed)"
    console.print(_changes_table(title, d.ops, top, calls=True))
    if fail_above is not None:
        verdict = "FAIL" if d.slower_by_more_than(fail_above) else "ok"
        console.print(f"--fail-above {fail_above:g}%: {verdict} (step {_pct(s.pct) or 'n/a'})")


def _changes_table(title: str, changes, limit: int, calls: bool = False):
    from rich.table import Table

    from opadvisor.rules.overview import fmt_ms

    table = Table(title=title, title_justify="left", header_style="bold", box=None)
    table.add_column("name", overflow="fold")
    if calls:
        table.add_column("calls/step A -> B", justify="right")
    for col in ("A", "B", "change", "%"):
        table.add_column(col, justify="right")
    for c in changes[:limit]:
        row = [c.name]
        if calls:
            row.append(f"{c.a_calls or 0:.0f} -> {c.b_calls or 0:.0f}")
        row += [fmt_ms(c.a_ms), fmt_ms(c.b_ms), _signed(c.delta_ms), _pct(c.pct)]
        table.add_row(*row)
    return table


def _findings_table(findings):
    from rich.table import Table

    from opadvisor.rules.overview import fmt_ms

    table = Table(title="Findings", title_justify="left", header_style="bold", box=None)
    for col, justify in (("status", "left"), ("rule", "left"), ("where", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for col in ("A", "B", "change"):
        table.add_column(col, justify="right")
    table.add_column("what", overflow="fold", ratio=1)
    for f in findings:
        lines = f"{f.a_line or '-'} -> {f.b_line or '-'}" if f.a_line != f.b_line else str(f.a_line)
        table.add_row(
            f.status,
            f.rule,
            f"{display_path(f.path)}:{lines}",
            fmt_ms(f.a_ms),
            fmt_ms(f.b_ms),
            _signed(f.delta_ms),
            f.message,
        )
    if not findings:
        table.add_row("-", "no findings in either run", "", "", "", "", "")
    return table
