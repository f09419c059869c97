"""`opadvisor suggest`, `opadvisor rules`, `opadvisor explain`: findings ranked by measured time.

Rendering only: the analysis is `opadvisor.rules.engine.analyse`, the JSON document is `suggest_document`
(its JSON schema ships as `opadvisor/rules/suggest_schema.py`), SARIF is `sarif_document`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from opadvisor.cli.common import EXIT_FINDINGS, user_errors, warn

MEMORY_HOLDERS = 10  # the largest activation holders listed in the JSON
SARIF_SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
TOOL_URI = "https://github.com/opadvisor/opadvisor"


def register(app: typer.Typer) -> None:
    """Add `suggest`, `rules` and `explain` to the app."""
    app.command("suggest")(suggest)
    app.command("rules")(rules)
    app.command("explain")(explain)


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def display_path(path: str, cwd: Path | None = None) -> str:
    """Relative to the current directory when the file is under it, else absolute (the JSON contract)."""
    base = (cwd or Path.cwd()).resolve()
    try:
        return str(Path(path).resolve().relative_to(base))
    except ValueError:
        return str(Path(path))


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
    from opadvisor.profile.runs import load_run
    from opadvisor.rewrite.check import analyse_checked

    if format not in ("table", "json", "sarif"):
        raise UserError(f"unknown format {format!r}; use table, json or sarif")
    if sort not in ("time", "saving"):
        raise UserError(f"unknown sort {sort!r}; use time or saving")
    run_dir, profiles = load_run(run)
    chosen = _split(select)
    if memory and chosen is not None:
        chosen.append("activation_checkpointing")
    requested = [*(chosen or []), *(["activation_checkpointing"] if memory else [])]
    report = analyse_checked(
        profiles, run_dir, check=check, select=chosen, ignore=_split(ignore), sort=sort, requested=requested
    )
    _warn_sources(report.findings)
    if format == "json":
        print(json.dumps(suggest_document(run_dir, profiles, report), indent=2))
    elif format == "sarif":
        print(json.dumps(sarif_document(report, profiles), indent=2))
    else:
        _render_table(run_dir, profiles, report, run)
    if exit_code and report.findings:
        raise typer.Exit(EXIT_FINDINGS)


def _warn_sources(findings) -> None:
    seen: set[str] = set()
    for f in findings:
        if f.source_status != "ok" and f.path not in seen:
            seen.add(f.path)
            what = "changed" if f.source_status == "changed" else "is gone"
            warn(
                f"{display_path(f.path)} {what} since it was profiled: its findings may point at moved lines; profile again"
            )


# ---- JSON ------------------------------------------------------------------------------------


def finding_entry(f) -> dict[str, Any]:
    """One finding as the JSON contract has it (the first eight keys are DESIGN.md's, in its order)."""
    return {
        "rule": f.rule,
        "path": display_path(f.path),
        "line": f.line,
        "end_line": f.end_line,
        "message": f.message,
        "time_ms_per_step": _round(f.time_ms_per_step),
        "est_saving_ms_per_step": _round(f.est_saving_ms_per_step),
        "fix": f.fix,
        "time_basis": f.evidence.time_basis,
        "profiled_time_ms_per_step": _round(f.evidence.profiled_time_ms_per_step),
        "share_of_step": _round(f.evidence.share_of_step, 4),
        "function": f.function,
        "module": f.module,
        "source_status": f.source_status,
        "ranks": f.ranks,
        "apply": apply_command(f),
        "advice": f.advice,
        "evidence": {
            "ops": f.evidence.ops,
            "kernel_count": f.evidence.kernel_count,
            "shapes": f.evidence.shapes,
            "dtypes": f.evidence.dtypes,
            "occurrences": f.evidence.occurrences,
            "notes": f.evidence.notes,
        },
        "details": f.details,
        "library": _library_entry(f.library),
        "fix_blocked": f.fix_blocked,
    }


def _library_entry(library: dict[str, Any] | None) -> dict[str, Any] | None:
    """The finding's library block with its user-code paths shown as `path` is (relative when under cwd)."""
    if library is None:
        return None
    entry = dict(library)
    for key in ("called_from", "model"):
        if isinstance(entry.get(key), dict) and entry[key].get("path"):
            entry[key] = {**entry[key], "path": display_path(entry[key]["path"])}
    return entry


def where(f) -> str:
    """file:line(-end) as the table shows it: a library file by its path within site-packages."""
    path = f.library["file"] if f.library else display_path(f.path)
    return f"{path}:{f.lines()}"


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def suggest_document(run_dir: Path, profiles, report) -> dict[str, Any]:
    """The `suggest --format json` object (schema: opadvisor/rules/suggest_schema.py)."""
    from opadvisor.rules.overview import breakdown, calibration, median_step_ms

    first = profiles[0]
    env = first.environment
    extra: dict[str, Any] = {}
    if len(profiles) > 1:
        from opadvisor.rules import cross_rank

        extra["cross_rank"] = cross_rank.to_json(cross_rank.analyse(profiles))
    return {
        "schema": 1,
        "run": display_path(str(run_dir)),
        "device": env.gpu_name if env.device == "cuda" and env.gpu_name else env.device,
        "step_ms": _round(median_step_ms(first)),
        "findings": [finding_entry(f) for f in report.findings],
        "notes": [{"rule": n.rule, "message": n.message, "ranks": n.ranks} for n in report.notes],
        "breakdown": breakdown(first),
        "rules_run": report.rules_run,
        "memory": memory_entry(first),
        "recording": recording_entry(profiles),
        "calibration": calibration(first).to_json(),
        "compiled": report.compiled,
        "eager": first.eager,
        **extra,
    }


def recording_entry(profiles) -> dict[str, Any]:
    """Whether the profile recorded its whole window (False: the script ended or failed first), and why
    it stopped (issue 30: `stopped`, `steps_seen`, `warmup_steps` where the run says)."""
    entry: dict[str, Any] = {
        "complete": all(p.complete for p in profiles),
        "steps_recorded": min(len(p.steps) for p in profiles),
        "steps_requested": profiles[0].steps_requested,
    }
    first = profiles[0]
    if not entry["complete"] and first.stopped is not None:
        entry.update(stopped=first.stopped, steps_seen=first.steps_seen, warmup_steps=first.warmup_steps)
    return entry


STOPPED_WORDS = {
    "script_error": "the script raised an exception",
    "script_exit": "the script called sys.exit",
    "interrupted": "the script was interrupted (Ctrl-C)",
    "ended_early": "the script ended",
}


def incomplete_words(profiles) -> str | None:
    """One sentence for a run whose window is incomplete, None for a complete one."""
    rec = recording_entry(profiles)
    if rec["complete"]:
        return None
    how = STOPPED_WORDS.get(rec.get("stopped", ""), "the script stopped")
    seen = f" after {rec['steps_seen']} step(s)" if rec.get("steps_seen") else ""
    if rec["steps_recorded"] == 0:
        lower = max(0, min(rec.get("steps_seen", 1) - 1, rec.get("warmup_steps", 1) - 1))
        return (
            f"incomplete run: {how}{seen}, in the warm-up (--warmup {rec.get('warmup_steps', '?')}): no step "
            f"was recorded, so nothing can be measured; profile again with --warmup {lower}"
        )
    return (
        f"incomplete run: {how}{seen}, before the window was complete ({rec['steps_recorded']} of "
        f"{rec['steps_requested']} steps recorded): times rest on fewer steps"
    )


def memory_entry(profile) -> dict[str, Any] | None:
    """The run's memory (schema: suggest_schema.MEMORY_SCHEMA); None for a run that measured none."""
    from opadvisor.profile.memory import activation_holders, saved_per_step

    allocated, reserved = profile.peak_memory()
    saved = saved_per_step(profile)
    if allocated is None and reserved is None and saved is None:
        return None
    starts = [s.allocated_at_start_bytes for s in profile.steps if s.allocated_at_start_bytes is not None]
    device = profile.environment.gpu_memory_bytes
    return {
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": reserved,
        "device_bytes": device,
        "peak_share_of_device": _round(reserved / device, 4) if reserved is not None and device else None,
        "allocated_at_start_bytes": max(starts) if starts else None,
        "saved_bytes_per_step": None if saved is None else round(saved),
        "holders": [
            {
                "name": h.name,
                "module_class": h.module_class,
                "modules": h.modules,
                "saved_bytes": round(h.saved_bytes),
                "share": _round(h.saved_bytes / saved, 4) if saved else None,
            }
            for h in activation_holders(profile)[:MEMORY_HOLDERS]
        ],
        "notes": list(profile.memory_notes),
    }


def apply_command(f) -> str | None:
    """The command that applies a finding's fix, None when it has no automatic fix."""
    from opadvisor.rewrite.registry import has_codemod

    if f.fix == "none" or not has_codemod(f.rule):
        return None
    return f"opadvisor apply --rule {f.rule}" + (" --unsafe" if f.fix == "unsafe" else "")


# ---- SARIF -----------------------------------------------------------------------------------


def _uri(path: str) -> dict[str, Any]:
    shown = display_path(path)
    if os.path.isabs(shown):
        return {"uri": Path(shown).as_uri()}
    return {"uri": Path(shown).as_posix(), "uriBaseId": "%SRCROOT%"}


def _location(path: str, line: int, end_line: int | None = None, text: str | None = None) -> dict[str, Any]:
    loc: dict[str, Any] = {
        "physicalLocation": {
            "artifactLocation": _uri(path),
            "region": {"startLine": max(1, line), "endLine": max(1, line, end_line or line)},
        }
    }
    if text:
        loc["message"] = {"text": text}
    return loc


def _fingerprint_path(f) -> str:
    """A library finding's fingerprint names the file within site-packages (stable across machines)."""
    return f.library["file"] if f.library else display_path(f.path)


def _related_locations(library: dict[str, Any]) -> list[dict[str, Any]]:
    """A library finding's user-code places: the call into the library, and where the model is built (the
    primary location is the library's line, where the pattern is written)."""
    related = []
    call = library.get("called_from")
    if call and call.get("path") and call.get("line"):
        related.append(_location(call["path"], call["line"], text="called from here"))
    model = library.get("model")
    if model and model.get("path") and model.get("line") and library["fix"]["kind"] != "none":
        related.append(
            _location(model["path"], model["line"], text="the model is built here (the fix goes here)")
        )
    for i, loc in enumerate(related):
        loc["id"] = i
    return related


def sarif_document(report, profiles) -> dict[str, Any]:
    """SARIF 2.1.0: one run, the rules that ran as reportingDescriptors, one result per finding; an
    incomplete run and the rules' notes as tool notifications."""
    from opadvisor import __version__
    from opadvisor.rules import registry

    rule_ids = report.rules_run
    descriptors = []
    for rid in rule_ids:
        mod = registry.get_rule(rid)
        doc = (mod.__doc__ or "").strip()
        descriptors.append(
            {
                "id": rid,
                "name": rid,
                "shortDescription": {"text": mod.TITLE},
                "fullDescription": {"text": doc.splitlines()[0] if doc else mod.TITLE},
                "help": {"text": doc or mod.TITLE},
                "properties": {"fix": mod.FIX},
            }
        )
    index = {rid: i for i, rid in enumerate(rule_ids)}
    results = []
    for f in report.findings:
        share = f.evidence.share_of_step
        level = "warning" if share is not None and share >= 0.05 else "note"
        props: dict[str, Any] = {
            "time_ms_per_step": _round(f.time_ms_per_step),
            "est_saving_ms_per_step": _round(f.est_saving_ms_per_step),
            "fix": f.fix,
            "fix_blocked": f.fix_blocked,  # why the dry run found the fix cannot be made here (or null)
            "source_status": f.source_status,
        }
        if f.evidence.profiled_time_ms_per_step is not None:
            props["profiled_time_ms_per_step"] = _round(f.evidence.profiled_time_ms_per_step)
        if f.ranks is not None:
            props["ranks"] = f.ranks
        text = f.message + (f". Fix: {f.advice}" if f.advice else "")
        result: dict[str, Any] = {
            "ruleId": f.rule,
            "ruleIndex": index.get(f.rule, 0),
            "level": level,
            "message": {"text": text},
            "locations": [_location(f.path, f.line, f.end_line)],
            "partialFingerprints": {"opadvisor/v1": f"{f.rule}:{_fingerprint_path(f)}:{f.line}"},
            "properties": props,
        }
        if f.library is not None:
            props["library"] = _library_entry(f.library)
            related = _related_locations(f.library)
            if related:
                result["relatedLocations"] = related
        results.append(result)
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "opadvisor",
                "version": __version__,
                "informationUri": TOOL_URI,
                "rules": descriptors,
            }
        },
        "results": results,
        "columnKind": "unicodeCodePoints",
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().resolve().as_uri() + "/"}},
    }
    notifications = [{"level": "note", "message": {"text": f"{n.rule}: {n.message}"}} for n in report.notes]
    incomplete = incomplete_words(profiles)
    if incomplete:
        notifications.insert(0, {"level": "warning", "message": {"text": incomplete}})
    if notifications:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notifications}]
    from opadvisor.rules.overview import calibration

    run["properties"] = {"calibration": calibration(profiles[0]).to_json()}
    return {"$schema": SARIF_SCHEMA_URI, "version": "2.1.0", "runs": [run]}


# ---- table -----------------------------------------------------------------------------------


def _render_table(run_dir: Path, profiles, report, run_arg: str | None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    from opadvisor.profile.summary import memory_text
    from opadvisor.rules.overview import breakdown, fmt_ms, fmt_share, step_words

    # a terminal gets its own width; a pipe or a CI log gets 120 columns, so commands are not folded
    console = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 120)
    first = profiles[0]
    env = first.environment
    device = env.gpu_name if env.device == "cuda" and env.gpu_name else "CPU (no GPU times)"
    ranks = f", {len(profiles)} ranks" if len(profiles) > 1 else ""
    bd = breakdown(first)
    console.print(
        f"[bold]{display_path(str(run_dir))}[/bold]  {display_path(first.script)}  on {device}{ranks}: "
        f"{len(first.steps)} steps, {step_words(first)}"
    )
    incomplete = incomplete_words(profiles)
    if incomplete:
        console.print(f"[bold yellow]{incomplete[0].upper()}{incomplete[1:]}[/bold yellow]")
    if not first.steps:
        return  # issue 30: stopped in the warm-up; the sentence above says what to do
    basis = "GPU" if bd["basis"] == "gpu" else "CPU, what ran at each instant"
    if bd["calibrated"]:
        basis += ", idle scaled to the plain step"
    basis += f"; shares of {bd['of']}, {fmt_ms(bd['total_ms'])}"
    parts = "  ".join(
        f"{p['name']} {fmt_ms(p['ms'])} ({fmt_share(p['share'])})" for p in bd["parts"] if p["ms"]
    )
    console.print(f"Step ({basis}): {parts}")
    memory = memory_text(first)
    if memory is not None:
        console.print(memory)
    if not report.findings:
        console.print("No findings." + (" (rules run: " + ", ".join(report.rules_run) + ")"))
    else:
        table = Table(show_lines=True, header_style="bold")
        table.add_column("#", justify="right")
        table.add_column("time/step", justify="right")
        table.add_column("saving", justify="right")
        table.add_column("where / rule", overflow="fold")
        table.add_column("what it found / fix", overflow="fold", ratio=1)
        suffix = f" {run_arg}" if run_arg else ""
        for i, f in enumerate(report.findings, 1):
            at = where(f)
            if f.source_status != "ok":
                at += f"\n({'file changed' if f.source_status == 'changed' else 'file gone'})"
            if len(profiles) > 1 and f.ranks:
                at += f"\n{'rank' if len(f.ranks) == 1 else 'ranks'} {', '.join(map(str, f.ranks))}"
            cmd = apply_command(f)
            fix = (cmd + suffix) if cmd else ("display only: " + f.advice if f.advice else "display only")
            if f.fix_blocked:
                fix = f.verdict()
            if cmd and f.advice and f.est_saving_ms_per_step == 0:
                fix += f" (no saving claimed: {f.advice})"  # why a fix is offered that saves nothing here
            time = fmt_ms(f.time_ms_per_step) + (" cpu" if f.evidence.time_basis == "cpu" else "")
            table.add_row(
                str(i),
                time,
                fmt_ms(f.est_saving_ms_per_step),
                f"{at}\n{f.rule}",
                f"{f.message}\nfix: {fix}",
            )
        console.print(table)
    if len(profiles) > 1:
        from opadvisor.rules import cross_rank

        console.print(cross_rank.render(cross_rank.analyse(profiles)))
    for line in note_lines(report.notes):
        console.print(line, soft_wrap=True)  # one line, folded by the terminal only
    if report.compiled:
        console.print(compiled_words(report.compiled))
    if first.eager:
        console.print("Profiled with --eager: torch.compile was switched off, so times are eager times.")
    if first.environment.device != "cuda":
        console.print("CPU profile: times are CPU op times; savings need kernel times: profile on a GPU.")


def note_lines(notes) -> list[str]:
    """The notes as the table shows them: one line per note, except that the rules which need a GPU
    profile fold into one line (with what each noticed here, such as the .item() reads host_sync saw)."""
    lines, gpu_only = [], []
    for n in notes:
        ranks = f" (ranks {', '.join(map(str, n.ranks))})" if n.ranks else ""
        if n.needs_gpu:
            gpu_only.append(n.rule + (f" ({n.hint})" if n.hint else "") + ranks)
        else:
            lines.append(f"note: {n.rule}: {n.message}{ranks}")
    if gpu_only:
        lines.insert(
            0,
            f"note: {len(gpu_only)} rule{'s' if len(gpu_only) > 1 else ''} need{'' if len(gpu_only) > 1 else 's'}"
            f" a CUDA profile to judge this run: {', '.join(gpu_only)} (`opadvisor explain RULE` says why)",
        )
    return lines


def compiled_words(compiled: dict[str, Any]) -> str:
    """The note for time spent inside torch.compile graphs (see opadvisor/rules/_compiled.py)."""
    from opadvisor.rules.overview import fmt_ms, fmt_share

    basis = "" if compiled["basis"] == "gpu" else " of CPU time"
    share = (
        f" ({fmt_share(compiled['share_of_step'])} of the step)"
        if compiled["share_of_step"] is not None
        else ""
    )
    graphs = compiled["graphs"]
    total, first = compiled.get("compile_s"), compiled.get("compile_s_first_step")
    compiling = ""
    if total:
        later = total - (first or 0.0)
        compiling = f" Compiling took {total:.1f} s" + (
            f" ({first:.1f} s in the first step, {later:.1f} s recompiling later)." if later >= 0.05 else "."
        )
    return (
        f"note: {fmt_ms(compiled['ms_per_step'])}/step{basis}{share} ran inside {graphs} torch.compile "
        f"graph{'s' if graphs != 1 else ''}.{compiling} Graph breaks and recompiles are reported above "
        "(graph_break, recompile); the ops inside the graphs are not analysed: to find and fix patterns "
        "in that code, profile it with torch.compile switched off: `opadvisor profile --eager SCRIPT`."
    )


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
