"""`opadvisor verify`: run the original and the rewritten script, compare losses step by step, time both."""

from __future__ import annotations

import json
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from opadvisor.cli.common import EXIT_FINDINGS, EXIT_OK, user_errors
from opadvisor.verify.compare import FASTER, INCONCLUSIVE, SLOWER

if TYPE_CHECKING:
    from opadvisor.verify.compare import Difference
    from opadvisor.verify.core import Timing, VerifyReport
    from opadvisor.verify.implementations import FusedCalls


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
    import sys

    from rich.console import Console
    from rich.markup import escape

    # a terminal gets its own width; a pipe or a CI log gets 120 columns, so rule names are not folded
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
    p = report.parity
    _render_parity(console, p)
    if report.rewrite_error:
        console.print("[red]the rewritten script failed:[/]")
        console.print(report.rewrite_error.rstrip(), markup=False, highlight=False)

    if report.timing is not None:
        _render_timing(console, report.timing)
    if report.fused_calls:
        _render_fused_calls(console, report.fused_calls)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")

    if report.rules:
        _render_site_times(console, report.rules)

    for note in report.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if p.ok:
        console.print(f"[green]parity passed[/]: {p.message}")
    else:
        console.print(f"[red]parity FAILED[/]: {p.message}")
    if report.slower and report.fail_slower:
        console.print("[red]FAILED[/]: the rewrite is slower than the original (--fail-slower)")


def _render_parity(console, p) -> None:  # noqa: ANN001 - a rich Console, a Parity
    """The losses step by step, the gradient norm and the gradients compared, the tolerances."""
    from rich.markup import escape
    from rich.table import Table

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
    if p.gradients is not None:
        g = p.gradients
        state = "[green]ok[/]" if g.ok else f"[red]DIFFER[/] ({len(g.failing)} over the tolerance)"
        console.print(f"{escape(g.words())} {state}")
        for note in g.notes:
            console.print(f"note: {note}", markup=False, highlight=False)
    if p.tolerances is not None:
        console.print(p.tolerances.words(), markup=False, highlight=False)


def _render_site_times(console, site_rules) -> None:  # noqa: ANN001 - a rich Console, RuleSites
    """GPU time at each applied rule's sites under the profiler (--reprofile)."""
    from rich.table import Table

    rules = Table(
        title="GPU time at each applied rule's sites, under the profiler (kernel time at those lines, "
        "not step time: --reprofile)"
    )
    for col in ("rule", "before ms", "after ms", "saved ms", "before %", "after %", "basis"):
        rules.add_column(col, justify="left" if col in ("rule", "basis") else "right")
    for r in site_rules:
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


def _render_fused_calls(console, calls: list[FusedCalls]) -> None:
    from rich.table import Table

    table = Table(title=f"which implementation the rewrite's fused calls ran ({calls[0].run} run)")
    for col in ("op", "for rule", "kernel", "chain", "reference"):
        table.add_column(col, justify="left" if col in ("op", "for rule") else "right")
    for c in calls:
        counts = [str(c.counts.get(path, 0)) for path in ("kernel", "chain", "reference")]
        table.add_row(c.op, ", ".join(c.rules) or "-", *counts)
    console.print(table)


def verdict_words(d: Difference, what: str = "the rewrite") -> str:
    """One line: faster / SLOWER / no measurable difference, with the medians and the 95% interval."""
    s = d.speedup
    interval = f"95% interval {s.low:.2f}x .. {s.high:.2f}x"
    times = f"{d.before_ms:.2f} -> {d.after_ms:.2f} ms/step"
    if d.verdict == FASTER:
        return f"{what} is faster: {s.factor:.2f}x ({interval}), {times}"
    if d.verdict == SLOWER:
        return f"{what} is SLOWER: {s.factor:.2f}x ({interval}), {times}"
    if d.verdict == INCONCLUSIVE:  # issue 30: no ratio whose interval spans the machine's noise
        return f"timing inconclusive on this machine: {d.noise or 0:.0%} noise, {times}"
    return f"no measurable difference: {s.factor:.2f}x ({interval} includes 1x), {times}"


def _render_timing(console, t: Timing) -> None:
    from rich.table import Table

    timing = Table(title=f"step time ({t.device})")
    for col in ("", "median ms", "p25 ms", "p75 ms", "steps"):
        timing.add_column(col, justify="right")
    for name, st in (("before", t.before), ("after", t.after)):
        timing.add_row(name, f"{st.median_ms:.2f}", f"{st.p25_ms:.2f}", f"{st.p75_ms:.2f}", str(st.n))
    console.print(timing)
    console.print(
        f"{t.repeats} timing run(s) of each program in alternating rounds, {t.warmup} warm-up step(s) of each "
        "dropped; every step CUDA-synchronised at its end"
        if t.device == "cuda"
        else f"{t.repeats} timing run(s) of each program in alternating rounds, {t.warmup} warm-up step(s) of "
        "each dropped"
    )
    if t.stopped:
        console.print(t.stopped)
    if t.memory_before is not None and t.memory_after is not None:
        console.print(_peak_words(t.memory_before, t.memory_after))
    if t.difference is not None:
        style = {FASTER: "bold green", SLOWER: "bold red"}.get(t.difference.verdict, "bold")
        console.print(f"[{style}]{verdict_words(t.difference)}[/]")
    if t.rules and len(t.rules) > 1:
        rules = Table(
            title="step time as each rule is added (the same measurement: the savings add up to the "
            "whole step's)"
        )
        for col in ("rule", "before ms", "after ms", "saved ms", "95% interval ms", "verdict"):
            rules.add_column(col, justify="left" if col in ("rule", "verdict") else "right")
        for r in t.rules:
            d = r.difference
            rules.add_row(
                r.rule,
                f"{d.before_ms:.3f}",
                f"{d.after_ms:.3f}",
                f"{d.saved_ms:.3f}",
                f"{d.saved_low_ms:.3f} .. {d.saved_high_ms:.3f}",
                d.verdict,
            )
        total = t.difference
        if total is not None:
            rules.add_row(
                "all", f"{total.before_ms:.3f}", f"{total.after_ms:.3f}", f"{total.saved_ms:.3f}", "", ""
            )
        console.print(rules)
    elif t.rules_note:
        console.print(f"per-rule times: none ({t.rules_note})", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the app."""

    app.command("verify")(verify)


RunArgument = Annotated[str | None, typer.Argument(help="Run folder or run id (default: the latest run).")]
StepsOption = Annotated[int, typer.Option(help="Steps to compare (and to time, after the warm-up).", min=1)]
WarmupOption = Annotated[
    int, typer.Option(help="Steps run before timing starts (compilation, caches).", min=0)
]
SeedOption = Annotated[int, typer.Option(help="Seed for random, numpy and torch before the script runs.")]
RtolOption = Annotated[
    float | None,
    typer.Option(
        help="Relative loss tolerance (default by precision: fp32 1e-4, tf32 1e-3, bf16/fp16 2e-2)."
    ),
]
AtolOption = Annotated[
    float | None,
    typer.Option(
        help="Absolute loss tolerance (default by precision: fp32 1e-5, tf32 1e-4, bf16/fp16 1e-3)."
    ),
]
TimingOption = Annotated[bool, typer.Option("--timing/--no-timing", help="Time both programs.")]
QuickOption = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Parity only (losses and gradients), no timing: the check that fits a busy or small "
        "machine, where step times say little.",
    ),
]
PerRuleOption = Annotated[
    bool,
    typer.Option(
        "--per-rule/--no-per-rule",
        help="With several rules applied, also time the original with the first 1, 2, ... rules "
        "applied: what each rule saved, measured like the whole step.",
    ),
]
FailSlowerOption = Annotated[
    bool,
    typer.Option(
        "--fail-slower", help="Exit 1 when the rewrite is measurably slower than the original (CI)."
    ),
]
ReprofileOption = Annotated[
    bool,
    typer.Option(
        "--reprofile/--no-reprofile",
        help="Also profile the rewrite again: GPU time at each rule's sites under the profiler.",
    ),
]
RepeatsOption = Annotated[
    int,
    typer.Option(
        help="Timing runs of each program, in alternating rounds; their spread decides whether "
        "a difference is real.",
        min=1,
    ),
]
TimeoutOption = Annotated[
    float | None, typer.Option(help="Seconds each child process may run (default: no limit).")
]
CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile",
        help="Time both programs compiled: torch.compile of the first module with trainable "
        "parameters each one calls (its model), in place, from its second call on; the parity "
        "phase stays eager. Give --warmup room for the compilation.",
    ),
]
CompileBackendOption = Annotated[
    str, typer.Option(help="torch.compile's backend with --compile (aot_eager: no C++ compiler).")
]
FormatOption = Annotated[Format, typer.Option("--format", help="table, or json for CI.")]


@user_errors
def verify(
    run: RunArgument = None,
    steps: StepsOption = 10,
    warmup: WarmupOption = 3,
    seed: SeedOption = 0,
    rtol: RtolOption = None,
    atol: AtolOption = None,
    timing: TimingOption = True,
    quick: QuickOption = False,
    per_rule: PerRuleOption = True,
    fail_slower: FailSlowerOption = False,
    reprofile: ReprofileOption = False,
    repeats: RepeatsOption = 3,
    timeout: TimeoutOption = None,
    compile: CompileOption = False,
    compile_backend: CompileBackendOption = "inductor",
    format: FormatOption = Format.table,
) -> None:
    """Run the original and the rewritten script with the same seeds: same losses? how much faster?

    The original is rebuilt from the backups `opadvisor apply` kept. Step times come from --repeats
    runs of each program; a 95% interval says whether the difference is real ("no measurable
    difference" otherwise), and with several rules applied each rule's saving is measured the same
    way. Exit 0 when the losses match, 1 when they do not (the first diverging step is named) or, with
    --fail-slower, when the rewrite is measurably slower; 2 on a user error.
    """
    from opadvisor.verify.core import VerifyOptions

    options = VerifyOptions(
        steps=steps,
        warmup=warmup,
        seed=seed,
        rtol=rtol,
        atol=atol,
        timing=timing and not quick,
        reprofile=reprofile,
        repeats=repeats,
        per_rule=per_rule,
        fail_slower=fail_slower,
        timeout=timeout,
        compile_backend=compile_backend if compile else None,
    )
    _verify(run, options, format)


def _verify(run: str | None, opts, format: Format) -> None:  # noqa: ANN001 - a VerifyOptions
    """Load the run, verify it (a spinner on stderr for the table), print the report, exit by its verdict."""
    from rich.console import Console

    from opadvisor.profile.runs import load_run
    from opadvisor.verify.core import verify as run_verify

    run_dir, profiles = load_run(run)
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
