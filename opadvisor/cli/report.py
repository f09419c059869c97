"""`opadvisor report [RUN] [-o FILE]`: the run as one self-contained HTML page.

Rendering only: the analysis is `opadvisor.rules` (the Report `suggest` renders), the page is built by
`opadvisor.report.html`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opadvisor.cli.common import user_errors
from opadvisor.report.findings import apply_command, display_path


def register(app: typer.Typer) -> None:
    app.command("report")(report)


@user_errors
def report(
    run: Annotated[str | None, typer.Argument(help="Run folder or run id (default: the latest run).")] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="The HTML file to write (default: report.html in the run folder)."
        ),
    ] = None,
) -> None:
    """Write the run as one HTML page that opens anywhere, offline: the step breakdown, the findings
    ranked with their source lines, evidence and apply command, one step's timeline, and step time per
    rank for multi-rank runs.

    Example:  opadvisor report -o report.html
    """
    from opadvisor.errors import UserError
    from opadvisor.files import atomic_write
    from opadvisor.profile.runs import load_run
    from opadvisor.report.html import build_html
    from opadvisor.rewrite.check import analyse_checked

    run_dir, profiles = load_run(run)
    target = output if output is not None else run_dir / "report.html"
    if target.is_dir():
        raise UserError(f"{target} is a folder; name the HTML file to write")
    shown_run = display_path(str(run_dir))

    def command(f) -> str | None:  # the command names this run: the report outlives "latest"
        cmd = apply_command(f)
        return f"{cmd} {shown_run}" if cmd else None

    findings = analyse_checked(profiles, run_dir)  # the fix verdicts suggest and apply show (issue 30)
    page = build_html(run_dir, profiles, findings, display=display_path, apply_command=command)
    try:  # whole or not at all: written beside the target, then renamed over it
        atomic_write(target, page.encode("utf-8"))
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None
    print(f"report written to {display_path(str(target))} (open it in a browser)")
