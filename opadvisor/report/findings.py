"""The findings report that `opadvisor suggest` prints, built here: the CLI parses options and renders it.

    from opadvisor.report.findings import suggest_document, suggest_report, table_row
    run_dir, profiles, report = suggest_report(None, select=None, ignore=None, sort="time")
    suggest_document(run_dir, profiles, report)   # `--format json`: the contract (rules/suggest_schema.py)
    table_row(1, report.findings[0], profiles)    # one row of the table, its cells as text

`--format sarif` is `opadvisor.report.sarif`. Paths are shown as the JSON contract has them
(`display_path`): relative to the current directory when the file is under it, else absolute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MEMORY_HOLDERS = 10  # the largest activation holders listed in the JSON
MEMORY_RULE = "activation_checkpointing"  # the rule `suggest --memory` asks


def suggest_report(
    run: str | None,
    *,
    select: list[str] | None,
    ignore: list[str] | None,
    sort: str,
    memory: bool = False,
    check: bool = True,
) -> tuple[Path, list[Any], Any]:
    """(run folder, profiles, the checked Report) for `suggest`: the run's findings ranked by `sort`, with
    their fix verdicts (`check`: a dry run per fix); `memory` asks the memory rule whatever the peak."""
    from opadvisor.profile.runs import load_run
    from opadvisor.rewrite.check import analyse_checked

    run_dir, profiles = load_run(run)
    chosen = None if select is None else [*select, *([MEMORY_RULE] if memory else [])]
    requested = [*(chosen or []), *([MEMORY_RULE] if memory else [])]
    report = analyse_checked(
        profiles, run_dir, check=check, select=chosen, ignore=ignore, sort=sort, requested=requested
    )
    return run_dir, profiles, report


def source_warnings(findings: list[Any]) -> list[str]:
    """One warning per file that changed (or is gone) since it was profiled."""
    lines, seen = [], set()
    for f in findings:
        if f.source_status != "ok" and f.path not in seen:
            seen.add(f.path)
            what = "changed" if f.source_status == "changed" else "is gone"
            lines.append(
                f"{display_path(f.path)} {what} since it was profiled: its findings may point at moved lines; profile again"
            )
    return lines


def display_path(path: str, cwd: Path | None = None) -> str:
    """Relative to the current directory when the file is under it, else absolute (the JSON contract)."""
    base = (cwd or Path.cwd()).resolve()
    try:
        return str(Path(path).resolve().relative_to(base))
    except ValueError:
        return str(Path(path))


def finding_entry(f) -> dict[str, Any]:
    """One finding as the JSON contract has it (the first eight keys are DESIGN.md's, in its order)."""
    return {
        "rule": f.rule,
        "path": display_path(f.path),
        "line": f.line,
        "end_line": f.end_line,
        "message": f.message,
        "time_ms_per_step": rounded(f.time_ms_per_step),
        "est_saving_ms_per_step": rounded(f.est_saving_ms_per_step),
        "fix": f.fix,
        "time_basis": f.evidence.time_basis,
        "profiled_time_ms_per_step": rounded(f.evidence.profiled_time_ms_per_step),
        "share_of_step": rounded(f.evidence.share_of_step, 4),
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
        "details": f.details_json(),
        "library": library_entry(f.library),
        "fix_blocked": f.fix_blocked,
    }


def library_entry(library: dict[str, Any] | None) -> dict[str, Any] | None:
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


def rounded(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def suggest_document(run_dir: Path, profiles, report) -> dict[str, Any]:
    """The `suggest --format json` object (schema: opadvisor/rules/suggest_schema.py)."""
    from opadvisor.rules.overview import breakdown, calibration, median_step_ms

    first = profiles[0]
    env = first.environment
    extra: dict[str, Any] = {}
    if len(profiles) > 1:
        from opadvisor.ranks import cross_rank

        extra["cross_rank"] = cross_rank.to_json(cross_rank.analyse(profiles))
    return {
        "schema": 1,
        "run": display_path(str(run_dir)),
        "device": env.gpu_name if env.device == "cuda" and env.gpu_name else env.device,
        "step_ms": rounded(median_step_ms(first)),
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
        "peak_share_of_device": rounded(reserved / device, 4) if reserved is not None and device else None,
        "allocated_at_start_bytes": max(starts) if starts else None,
        "saved_bytes_per_step": None if saved is None else round(saved),
        "holders": [
            {
                "name": h.name,
                "module_class": h.module_class,
                "modules": h.modules,
                "saved_bytes": round(h.saved_bytes),
                "share": rounded(h.saved_bytes / saved, 4) if saved else None,
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


# ---- the table's text -------------------------------------------------------------------------------


def header_words(run_dir: Path, profiles) -> tuple[str, str]:
    """(the run as shown, the rest of the table's first line: script, device, ranks, steps, step time)."""
    from opadvisor.rules.overview import step_words

    first = profiles[0]
    env = first.environment
    device = env.gpu_name if env.device == "cuda" and env.gpu_name else "CPU (no GPU times)"
    ranks = f", {len(profiles)} ranks" if len(profiles) > 1 else ""
    return (
        display_path(str(run_dir)),
        f"{display_path(first.script)}  on {device}{ranks}: {len(first.steps)} steps, {step_words(first)}",
    )


def step_line(profile) -> str:
    """Where the median step's time goes, as the line under the table's header."""
    from opadvisor.rules.overview import breakdown, fmt_ms, fmt_share

    bd = breakdown(profile)
    basis = "GPU" if bd["basis"] == "gpu" else "CPU, what ran at each instant"
    if bd["calibrated"]:
        basis += ", idle scaled to the plain step"
    basis += f"; shares of {bd['of']}, {fmt_ms(bd['total_ms'])}"
    parts = "  ".join(
        f"{p['name']} {fmt_ms(p['ms'])} ({fmt_share(p['share'])})" for p in bd["parts"] if p["ms"]
    )
    return f"Step ({basis}): {parts}"


def table_row(i: int, f, profiles, run_arg: str | None = None) -> tuple[str, str, str, str, str]:
    """The table's cells for finding number `i`: #, time/step, saving, where / rule, what it found / fix
    (the apply command names `run_arg` when the user named a run)."""
    from opadvisor.rules.overview import fmt_ms

    at = where(f)
    if f.source_status != "ok":
        at += f"\n({'file changed' if f.source_status == 'changed' else 'file gone'})"
    if len(profiles) > 1 and f.ranks:
        at += f"\n{'rank' if len(f.ranks) == 1 else 'ranks'} {', '.join(map(str, f.ranks))}"
    time = fmt_ms(f.time_ms_per_step) + (" cpu" if f.evidence.time_basis == "cpu" else "")
    return (
        str(i),
        time,
        fmt_ms(f.est_saving_ms_per_step),
        f"{at}\n{f.rule}",
        f"{f.message}\nfix: {fix_words(f, run_arg)}",
    )


def fix_words(f, run_arg: str | None = None) -> str:
    """The table's fix for a finding: its apply command, why it cannot be applied, or display only."""
    suffix = f" {run_arg}" if run_arg else ""
    cmd = apply_command(f)
    fix = (cmd + suffix) if cmd else ("display only: " + f.advice if f.advice else "display only")
    if f.fix_blocked:
        fix = f.verdict()
    if cmd and f.advice and f.est_saving_ms_per_step == 0:
        fix += f" (no saving claimed: {f.advice})"  # why a fix is offered that saves nothing here
    return fix
