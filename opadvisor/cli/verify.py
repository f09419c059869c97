"""`opadvisor verify`: run the original and the rewritten script, compare losses step by step, time both."""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from opadvisor.cli.common import EXIT_FINDINGS, EXIT_OK, user_errors

if TYPE_CHECKING:
    from opadvisor.verify.core import VerifyReport


class Format(str, Enum):
    table = "table"
    json = "json"


def _fmt(x: float | None, spec: str = ".6f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _peak_words(before, after) -> str:
    """ "peak memory per step (CUDA): allocated 12.3 GiB -> 8.1 GiB (-34%), reserved 13.0 GiB -> 9.0 GiB"."""
    from opadvisor.profile.memory import fmt_bytes

    change = after.allocated_bytes / before.allocated_bytes - 1 if before.allocated_bytes else 0.0
    return (
        f"peak memory per step (CUDA): allocated {fmt_bytes(before.allocated_bytes)} -> "
        f"{fmt_bytes(after.allocated_bytes)} ({change:+.0%}), reserved {fmt_bytes(before.reserved_bytes)} -> "
        f"{fmt_bytes(after.reserved_bytes)}"
    )


def render(report: VerifyReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    p = report.parity
    table = Table(title=f"loss parity ({p.precision}, |diff| <= {p.atol:g} + {p.rtol:g}*|before|)")
    table.add_column("step", justify="right")
    table.add_column("loss before", justify="right")
    table.add_column("loss after", justify="right")
    table.add_column("difference", justify="right")
    table.add_column("", justify="left")
    for s in p.steps:
        mark = "[green]ok[/]" if s.ok else f"[red]DIFFERS[/] {s.note}".rstrip()
        table.add_row(str(s.step), _fmt(s.loss_before), _fmt(s.loss_after), _fmt(s.diff, ".2e"), mark)
    console.print(table)
    if p.grad_norm_before is not None or p.grad_norm_after is not None:
        state = {True: "[green]ok[/]", False: "[red]DIFFERS[/]", None: ""}[p.grad_norm_ok]
        console.print(
            f"gradient norm at step 1: {_fmt(p.grad_norm_before, '.6g')} before, "
            f"{_fmt(p.grad_norm_after, '.6g')} after {state}"
        )
    if report.rewrite_error:
        console.print("[red]the rewritten script failed:[/]")
        console.print(report.rewrite_error.rstrip(), markup=False, highlight=False)

    if report.timing is not None:
        t = report.timing
        timing = Table(
            title=f"step time ({t.device}, {t.warmup} warm-up steps excluded, {t.repeats} run(s) each)"
        )
        for col in ("", "median ms", "p25 ms", "p75 ms", "steps"):
            timing.add_column(col, justify="right")
        for name, st in (("before", t.before), ("after", t.after)):
            timing.add_row(name, f"{st.median_ms:.2f}", f"{st.p25_ms:.2f}", f"{st.p75_ms:.2f}", str(st.n))
        console.print(timing)
        if t.memory_before is not None and t.memory_after is not None:
            console.print(_peak_words(t.memory_before, t.memory_after))
        console.print(
            f"speedup: [bold]{t.speedup.factor:.2f}x[/] (spread {t.speedup.low:.2f}x .. "
            f"{t.speedup.high:.2f}x)"
        )

    if report.rules:
        rules = Table(title="time per step at each applied rule's sites (forward + backward)")
        for col in ("rule", "before ms", "after ms", "saved ms", "before %", "after %", "basis"):
            rules.add_column(col, justify="left" if col in ("rule", "basis") else "right")
        for r in report.rules:
            rules.add_row(
                r.rule,
                _fmt(r.before_ms, ".3f"),
                _fmt(r.after_ms, ".3f"),
                _fmt(r.saved_ms, ".3f"),
                _pct(r.before_share),
                _pct(r.after_share),
                r.basis,
            )
        console.print(rules)

    for note in report.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if p.ok:
        console.print(f"[green]parity passed[/]: {p.message}")
    else:
        console.print(f"[red]parity FAILED[/]: {p.message}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the app."""

    @app.command()
    @user_errors
    def verify(
        run: Annotated[
            str | None, typer.Argument(help="Run folder or run id (default: the latest run).")
        ] = None,
        steps: Annotated[
            int, typer.Option(help="Steps to compare (and to time, after the warm-up).", min=1)
        ] = 10,
        warmup: Annotated[
            int, typer.Option(help="Steps run before timing starts (compilation, caches).", min=0)
        ] = 3,
        seed: Annotated[
            int, typer.Option(help="Seed for random, numpy and torch before the script runs.")
        ] = 0,
        rtol: Annotated[
            float | None,
            typer.Option(
                help="Relative loss tolerance (default by precision: fp32 1e-4, tf32 1e-3, bf16/fp16 2e-2)."
            ),
        ] = None,
        atol: Annotated[
            float | None,
            typer.Option(
                help="Absolute loss tolerance (default by precision: fp32 1e-5, tf32 1e-4, bf16/fp16 1e-3)."
            ),
        ] = None,
        timing: Annotated[bool, typer.Option("--timing/--no-timing", help="Time both programs.")] = True,
        reprofile: Annotated[
            bool,
            typer.Option(
                "--reprofile/--no-reprofile", help="Profile the rewrite again for the time per rule."
            ),
        ] = True,
        repeats: Annotated[
            int, typer.Option(help="Timing runs of each program, alternating original and rewrite.", min=1)
        ] = 1,
        timeout: Annotated[
            float | None, typer.Option(help="Seconds each child process may run (default: no limit).")
        ] = None,
        format: Annotated[Format, typer.Option("--format", help="table, or json for CI.")] = Format.table,
    ) -> None:
        """Run the original and the rewritten script with the same seeds: same losses? how much faster?

        The original is rebuilt from the backups `opadvisor apply` kept. Exit 0 when the losses match,
        1 when they do not (the first diverging step is named), 2 on a user error.
        """
        from rich.console import Console

        from opadvisor.profile.runs import load_run
        from opadvisor.verify.core import VerifyOptions
        from opadvisor.verify.core import verify as run_verify

        run_dir, profiles = load_run(run)
        opts = VerifyOptions(
            steps=steps,
            warmup=warmup,
            seed=seed,
            rtol=rtol,
            atol=atol,
            timing=timing,
            reprofile=reprofile,
            repeats=repeats,
            timeout=timeout,
        )
        if format is Format.json:
            report = run_verify(run_dir, profiles[0], opts)
            print(json.dumps(report.to_dict(), indent=2))
        else:
            with Console(stderr=True).status("verifying") as status:
                report = run_verify(
                    run_dir, profiles[0], opts, progress=lambda message: status.update(f"verify: {message}")
                )
            render(report)
        raise typer.Exit(EXIT_OK if report.ok else EXIT_FINDINGS)
