"""`verify` end to end: original vs rewritten program, loss parity, step-time speedup, time per applied rule.

1. Read the run (its profile gives the script, argv and working directory) and applied.json (the backups
   that rebuild the original program; see `applied.py`).
2. Parity phase: the original and the rewrite each run `steps` steps in a fresh process under the harness
   with the same seed, dropout neutralised and deterministic algorithms on (`harness.py`); their per-step
   losses and step-1 gradient norms are compared within a dtype-aware tolerance (`compare.py`).
3. Timing phase (skipped when parity fails, or with timing=False): every program runs `warmup + steps`
   steps with normal settings, `repeats` times, in rounds (forwards, then backwards: a slow spell of the
   machine hits every program alike). The programs: the original, then (with per_rule and two or more
   rules applied) the original with the first 1, 2, ... applied rules (`Applied.program`, from apply's
   snapshots), then the rewrite. The whole step is original vs rewrite; each rule's time is the step
   before it was added vs after, the same measurement, so the rules' savings add up to the whole step's.
   Each comparison has a 95% interval and a verdict (faster / slower / no measurable difference: see
   `compare.py`); a slower rewrite is said so (and `fail_slower` makes it a failure). On CUDA also the
   original's and the rewrite's peak memory (the largest per-step peak of allocated and reserved bytes
   over the timed steps).
4. Optionally (reprofile=True): the rewritten script is profiled again and the GPU time at each rule's
   sites compared before/after (`byrule.py`): kernel time under the profiler, not step time.

The original failing under the harness is a user error (nothing to compare with); the rewrite failing, or
its losses leaving the tolerance, is a parity failure, named by its first diverging step.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.profile.model import Profile
from opadvisor.verify.applied import Applied, load_applied
from opadvisor.verify.byrule import RuleTime, rule_times
from opadvisor.verify.compare import (
    CONFIDENCE,
    INCONCLUSIVE,
    SLOWER,
    Difference,
    Parity,
    PeakMemory,
    Speedup,
    StepTimes,
    add_gradients,
    compare_parity,
    compare_times,
    judge_noise,
    machine_noise,
    peak_memory,
    step_durations_ms,
    summarise_runs,
)
from opadvisor.verify.grads import compare_gradients
from opadvisor.verify.implementations import FusedCalls, fused_calls
from opadvisor.verify.runner import ChildResult, ChildSpec, run_child

REPORT_SCHEMA = 1
DROPOUT_NOTE = (
    "dropout was disabled in the parity phase: dropout is random, so equal losses are only "
    "expected without it (the timing phase runs with it)"
)


@dataclass
class VerifyOptions:
    steps: int = 10
    warmup: int = 3
    seed: int = 0
    rtol: float | None = None
    atol: float | None = None
    timing: bool = True
    reprofile: bool = False
    repeats: int = 3  # timing runs of each program, in alternating rounds
    per_rule: bool = True  # time the program one applied rule at a time
    fail_slower: bool = False  # a rewrite measurably slower than the original fails verify
    timeout: float | None = None  # per child process, seconds
    # issue 31: the timing phase runs both programs compiled (torch.compile with this backend); None: eager
    compile_backend: str | None = None
    # issue 30: the timing phase stops once it has run this many times the parity phase's wall time (each
    # program ran once there), after a round whose interval is tight, or one too noisy to ever be read
    timing_budget: float = 2.0


@dataclass
class Program:
    """One program of the timing phase: the original with `rules` applied, and its timing runs."""

    label: str  # "original", "+fused_softmax", "rewrite"
    rules: list[str]
    sources: dict[str, str]  # the harness's file -> source to run instead ({} is the rewrite)
    runs: list[list[float]] = field(default_factory=list)  # step durations (ms) of each timing run
    results: list[dict[str, Any]] = field(default_factory=list)  # the harness's result of each run
    dispatch: dict[str, Any] | None = None  # the harness's dispatch record of its first run


@dataclass
class RuleStepTime:
    """One applied rule: the step before it was added (the rules before it applied) and after."""

    rule: str
    before: StepTimes
    after: StepTimes
    difference: Difference


@dataclass
class Timing:
    device: str
    warmup: int
    repeats: int
    before: StepTimes
    after: StepTimes
    speedup: Speedup
    memory_before: PeakMemory | None = None  # CUDA only: the largest per-step peaks of the timed steps
    memory_after: PeakMemory | None = None
    difference: Difference | None = None  # original vs rewrite, with its interval and verdict
    rules: list[RuleStepTime] | None = None  # per applied rule, in the order added
    rules_note: str | None = None  # why there are no per-rule times
    stopped: str | None = None  # issue 30: why timing stopped before --repeats rounds (None: it did not)
    # with --compile: what each program's harness compiled ({"original": {...}, "rewrite": {...}})
    compiled: dict[str, Any] | None = None

    @property
    def slower(self) -> bool:
        return self.difference is not None and self.difference.verdict == SLOWER


@dataclass
class VerifyReport:
    run: str
    script: str
    applied_rules: list[str]
    parity: Parity
    timing: Timing | None = None
    rules: list[RuleTime] | None = None
    notes: list[str] = field(default_factory=list)
    rewrite_error: str | None = None  # the rewritten script's error, when it failed

    fail_slower: bool = False  # the option: a measurably slower rewrite fails
    fused_calls: list[FusedCalls] = field(default_factory=list)  # which implementation each fused call ran
    warnings: list[str] = field(default_factory=list)  # e.g. a rewrite whose kernel never ran

    @property
    def ok(self) -> bool:
        """Parity passed (and, with fail_slower, the rewrite is not measurably slower)."""
        return self.parity.ok and not (self.fail_slower and self.slower)

    @property
    def slower(self) -> bool:
        return self.timing is not None and self.timing.slower

    def to_dict(self) -> dict[str, Any]:
        p = self.parity
        data: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "run": self.run,
            "script": self.script,
            "ok": self.ok,
            "slower": self.slower,
            "applied_rules": self.applied_rules,
            "parity": {
                "ok": p.ok,
                "message": p.message,
                "precision": p.precision,
                "rtol": p.rtol,
                "atol": p.atol,
                "first_diverging_step": p.first_bad_step,
                "dropout_disabled": True,
                "grad_norm": {
                    "before": p.grad_norm_before,
                    "after": p.grad_norm_after,
                    "rtol": p.grad_norm_rtol,
                    "ok": p.grad_norm_ok,
                },
                "steps": [asdict(s) for s in p.steps],
                "rewrite_error": self.rewrite_error,
                "tolerances": p.tolerances.to_json() if p.tolerances is not None else None,
                "gradients": p.gradients.to_json() if p.gradients is not None else None,
            },
            "fused_calls": [c.to_json() for c in self.fused_calls],
            "warnings": self.warnings,
            "timing": None,
            "rules": None,
            "notes": self.notes,
        }
        if self.timing is not None:
            data["timing"] = _timing_dict(self.timing)
        if self.rules is not None:
            data["rules"] = [
                {
                    "rule": r.rule,
                    "files": [display_path(f) for f in r.files],
                    "lines": r.lines,
                    "before_ms_per_step": r.before_ms,
                    "after_ms_per_step": r.after_ms,
                    "saved_ms_per_step": r.saved_ms,
                    "basis": r.basis,
                    "before_share_of_step": r.before_share,
                    "after_share_of_step": r.after_share,
                }
                for r in self.rules
            ]
        return _finite(data)


def _peaks(before: PeakMemory | None, after: PeakMemory | None) -> dict[str, Any] | None:
    """{"before": {...}, "after": {...}, "allocated_change": after/before - 1}; None without CUDA peaks."""
    if before is None or after is None:
        return None
    return {
        "before": asdict(before),
        "after": asdict(after),
        "allocated_change": after.allocated_bytes / before.allocated_bytes - 1
        if before.allocated_bytes
        else None,
    }


def _times(t: StepTimes) -> dict[str, Any]:
    return {
        "median_ms": t.median_ms,
        "p25_ms": t.p25_ms,
        "p75_ms": t.p75_ms,
        "steps": t.n,
        "run_medians_ms": t.run_medians_ms,
    }


def _difference(d: Difference) -> dict[str, Any]:
    return {
        "saved_ms": d.saved_ms,
        "saved_low_ms": d.saved_low_ms,
        "saved_high_ms": d.saved_high_ms,
        "speedup": d.speedup.factor,
        "speedup_low": d.speedup.low,
        "speedup_high": d.speedup.high,
        "verdict": d.verdict,
        "noise": d.noise,  # the machine's noise, a fraction of the step (issue 30)
    }


def _timing_dict(t: Timing) -> dict[str, Any]:
    data: dict[str, Any] = {
        "device": t.device,
        "warmup": t.warmup,
        "repeats": t.repeats,
        "confidence": CONFIDENCE,
        "before": _times(t.before),
        "after": _times(t.after),
        "speedup": t.speedup.factor,
        "speedup_low": t.speedup.low,
        "speedup_high": t.speedup.high,
        "peak_memory": _peaks(t.memory_before, t.memory_after),
    }
    if t.difference is not None:
        data.update(_difference(t.difference))
    data["rules"] = (
        None
        if t.rules is None
        else [
            {
                "rule": r.rule,
                "before": _times(r.before),
                "after": _times(r.after),
                **_difference(r.difference),
            }
            for r in t.rules
        ]
    )
    data["rules_note"] = t.rules_note
    data["stopped"] = t.stopped
    data["compiled"] = t.compiled
    return data


def _finite(value: Any) -> Any:
    """NaN and infinities become null: the JSON stays strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def display_path(path: str | os.PathLike[str]) -> str:
    """Relative to the current directory when under it, else absolute (the suggest contract)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "failed"


def verify(
    run_dir: Path,
    profile: Profile,
    opts: VerifyOptions,
    progress: Callable[[str], None] = lambda message: None,
) -> VerifyReport:
    applied = load_applied(run_dir)
    script = profile.script
    if not script or not Path(script).is_file():
        raise UserError(f"the profiled script {script!r} no longer exists")
    if opts.steps < 1 or opts.repeats < 1 or opts.warmup < 0:
        raise UserError("--steps and --repeats must be at least 1, --warmup at least 0")
    nproc, ranks_note = verify_ranks(profile)  # a multi-rank run: on as many ranks, through torchrun
    spec = _child_specs(profile, opts, nproc)
    notes = _applied_notes(applied, ranks_note)
    parity_started = time.monotonic()
    before, after, parity = _parity_phase(spec, applied, opts, progress)
    budget_s = opts.timing_budget * (time.monotonic() - parity_started)  # each program ran once there
    report = VerifyReport(
        run=display_path(run_dir),
        script=display_path(script),
        applied_rules=applied.rules,
        parity=parity,
        notes=notes,
        fail_slower=opts.fail_slower,
    )
    if after.error is not None:
        _rewrite_failed(report, after.error)
        return report
    notes += _parity_run_notes(applied, before, opts)
    dispatch, run = (after.result or {}).get("dispatch"), "parity"
    if parity.ok and opts.timing:
        device = (before.result or {}).get("device", "cpu")
        plain = profile.plain_step_ms()
        report.timing, timed_dispatch = _timing(spec, applied, opts, progress, device, budget_s, plain)
        notes.extend(_timing_notes(report.timing, profile, opts))
        if timed_dispatch is not None:
            dispatch, run = timed_dispatch, "timing"
    report.fused_calls, warnings = fused_calls(applied.rules, dispatch, run, applied.names_added)
    report.warnings.extend(warnings)
    if parity.ok and opts.reprofile:
        progress("re-profiling the rewritten script")
        report.rules, rule_notes = rule_times(profile, applied, timeout=opts.timeout)
        notes.extend(rule_notes)
    return report


def _child_specs(profile: Profile, opts: VerifyOptions, nproc: int) -> Callable[..., ChildSpec]:
    """spec(mode, sources, grads_dir=None): how to run the script in a child process, for each phase."""
    script = profile.script
    argv = profile.argv or [script]
    cwd = profile.cwd or str(Path(script).parent)

    def spec(mode: str, sources: dict[str, str], grads_dir: Path | None = None) -> ChildSpec:
        return ChildSpec(
            script=script,
            argv=argv,
            cwd=cwd,
            steps=opts.steps,
            mode=mode,
            warmup=opts.warmup if mode == "timing" else 0,
            seed=opts.seed,
            sources=sources,
            module=profile.module,
            import_root=profile.import_root,
            grads_dir=str(grads_dir) if grads_dir is not None else None,
            nproc=nproc,
            compile_backend=opts.compile_backend if mode == "timing" else None,
        )

    return spec


def _applied_notes(applied: Applied, ranks_note: str | None) -> list[str]:
    """What the report says before any run: dropout, hand-written dropout in the parity original, files
    edited after apply, the ranks."""
    notes = [DROPOUT_NOTE]
    notes += [
        f"{display_path(f.path)}: for the parity phase the original's dropout written by hand ran as "
        "opadvisor.kernels.dropout too (disabled like the rest); its distribution is the kernel tests' business"
        for f in applied.files
        if f.parity_original is not None
    ]
    notes += [
        f"{display_path(f.path)} was edited after apply: verifying the file as it is now"
        for f in applied.files
        if f.edited_since
    ]
    if ranks_note:
        notes.append(ranks_note)
    return notes


def _parity_run_notes(applied: Applied, before: ChildResult, opts: VerifyOptions) -> list[str]:
    """Rewritten files the script never imported, and a script that ended before --steps."""
    served = set((before.result or {}).get("served", []))
    notes = [
        f"{display_path(f.path)} was never imported by the script: its rewrite was not exercised"
        for f in applied.files
        if os.path.realpath(f.path) not in served
    ]
    recorded = len((before.result or {}).get("steps", []))
    if recorded < opts.steps:
        notes.append(f"the script ended after {recorded} steps (asked for {opts.steps})")
    return notes


def _parity_phase(
    spec: Callable[..., ChildSpec], applied: Applied, opts: VerifyOptions, progress: Callable[[str], None]
) -> tuple[ChildResult, ChildResult, Parity]:
    """Both programs in parity mode; their losses, gradient norms and every gradient at step 1 compared."""
    with tempfile.TemporaryDirectory(prefix="opadvisor-grads-") as tmp:
        grads = {"before": Path(tmp) / "before", "after": Path(tmp) / "after"}
        progress(f"parity: original, {opts.steps} steps")
        before = run_child(spec("parity", applied.parity_sources(), grads["before"]), timeout=opts.timeout)
        if before.error is not None:
            raise UserError(f"the original script failed under verify: {_last_line(before.error)}")
        progress(f"parity: rewrite, {opts.steps} steps")
        after = run_child(spec("parity", {}, grads["after"]), timeout=opts.timeout)
        parity = compare_parity(
            before.result or {}, after.result or {}, steps=opts.steps, rtol=opts.rtol, atol=opts.atol
        )
        _other_ranks(parity, before, after, opts)
        saved = all((r.result or {}).get("gradients") for r in (before, after))
        if saved and after.error is None and parity.tolerances is not None:
            progress("parity: comparing every gradient at step 1")
            add_gradients(
                parity, compare_gradients(grads["before"], grads["after"], parity.tolerances.grad_rtol)
            )
    return before, after, parity


def verify_ranks(profile: Profile) -> tuple[int, str | None]:
    """How many ranks verify runs the programs on (a multi-rank run: as many as it was profiled with, on this
    machine, where it has the GPUs), and a note saying so."""
    world = profile.world_size
    if world <= 1:
        return 1, None
    if profile.has_gpu:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world:
            return 1, f"a {world}-rank run, {gpus} GPU(s) here: verify runs the script as a single process"
    return world, (
        f"a {world}-rank run: verify runs both programs on {world} ranks through torchrun (this machine) and "
        "compares every rank's losses; step times are rank 0's"
    )


def _other_ranks(parity: Parity, before: ChildResult, after: ChildResult, opts: VerifyOptions) -> None:
    """Rank 1, 2, ...'s losses (a multi-rank verify): the first rank that diverges fails the parity."""
    for rank in sorted(set(before.rank_results) | set(after.rank_results)):
        other = compare_parity(
            before.rank_results.get(rank, {}),
            after.rank_results.get(rank, {}),
            steps=opts.steps,
            rtol=opts.rtol,
            atol=opts.atol,
        )
        if not other.ok and parity.ok:
            parity.ok = False
            parity.first_bad_step = other.first_bad_step
            parity.message = f"rank {rank}: {other.message}"


def _rewrite_failed(report: VerifyReport, error: str) -> None:
    parity = report.parity
    report.rewrite_error = error
    parity.ok = False
    if parity.first_bad_step is None:
        parity.first_bad_step = len(parity.steps) + 1
    parity.message = f"the rewritten script failed at step {parity.first_bad_step}: {_last_line(error)}"


def _compiled(original: Program, rewrite: Program) -> dict[str, Any]:
    """What the harness compiled in each program's first timing run (--compile)."""
    return {p.label: (p.results[0].get("compiled") if p.results else None) for p in (original, rewrite)}


def _compile_notes(timing: Timing, opts: VerifyOptions) -> list[str]:
    """--compile: which module each program ran compiled (or why it did not), and the warm-up's room."""
    notes = []
    for label, what in (timing.compiled or {}).items():
        if not what:
            notes.append(f"--compile: the {label} called no module with trainable parameters: it ran eagerly")
        elif what.get("skipped"):
            notes.append(f"--compile: the {label} was not compiled again: {what['skipped']}")
        else:
            notes.append(
                f"--compile: the {label} ran {what['module']} compiled (torch.compile, backend "
                f"{what['backend']}) from its second call; the parity phase ran eagerly"
            )
    if opts.warmup < 2:
        notes.append("--compile with --warmup below 2: the compilation falls into the timed steps")
    return notes


def _timing_notes(timing: Timing | None, profile: Profile, opts: VerifyOptions) -> list[str]:
    if timing is None:
        return ["timing skipped: fewer than one step after the warm-up; lower --warmup"]
    notes = _compile_notes(timing, opts) if opts.compile_backend else []
    if opts.repeats == 1:
        notes.append(
            "one timing run per program: the 95% intervals cover step-to-step variation only; "
            "--repeats 3 also measures run-to-run variation"
        )
    plain = profile.plain_step_ms()
    if plain is not None and not 0.8 <= timing.before.median_ms / plain <= 1.25:
        notes.append(
            f"profile timed the original's plain step at {plain:.3g} ms, verify at "
            f"{timing.before.median_ms:.3g} ms: the machine (or the script's settings) changed in between"
        )
    return notes


def timing_programs(applied: Applied, per_rule: bool) -> tuple[list[Program], str | None]:
    """The programs to time: original, the original with the first 1..n-1 rules, rewrite; and, when the
    rules cannot be timed one at a time, why not."""
    programs = [Program("original", [], applied.sources())]
    order, why = applied.rule_order() if per_rule and len(applied.rules) > 1 else (applied.rules, None)
    if not per_rule and len(applied.rules) > 1:
        why = "per-rule times not asked for (--no-per-rule)"
    if why is None:
        programs += [
            Program(f"+{order[k - 1]}", order[:k], applied.program(order[:k])) for k in range(1, len(order))
        ]
    programs.append(Program("rewrite", list(order or applied.rules), {}))
    return programs, why


def _timing(
    spec: Callable[[str, dict[str, str]], ChildSpec],
    applied: Applied,
    opts: VerifyOptions,
    progress: Callable[[str], None],
    device: str,
    budget_s: float | None = None,
    plain_ms: float | None = None,
) -> tuple[Timing | None, dict[str, Any] | None]:
    """Every program up to `repeats` times, in rounds that go forwards and backwards through the list (a
    slow spell of the machine hits them alike); then whole-step and per-rule comparisons. Rounds stop
    early (issue 30) once the interval is tight, once the noise makes it hopeless, or past `budget_s`
    seconds. Also returns the rewrite's dispatch record from its first timing run."""
    programs, rules_note = timing_programs(applied, opts.per_rule)
    started, rounds, stopped = time.monotonic(), 0, None
    for r in range(opts.repeats):
        rules_note = _timing_round(r, programs, spec, opts, progress, rules_note)
        rounds += 1
        if rounds < opts.repeats:
            stopped = stop_reason(programs[0].runs, programs[-1].runs, rounds, opts.repeats, plain_ms)
            if stopped is None and budget_s is not None and time.monotonic() - started >= budget_s:
                stopped = (
                    f"timing stopped after {rounds} of {opts.repeats} rounds, to keep verify in proportion "
                    f"to the programs' own run time (--repeats {opts.repeats} asked for more)"
                )
            if stopped is not None:
                break
    original, rewrite = programs[0], programs[-1]
    before, after = summarise_runs(original.runs), summarise_runs(rewrite.runs)
    if before is None or after is None:
        return None, rewrite.dispatch
    noise = machine_noise(original.runs, plain_ms)
    difference = judge_noise(compare_times(original.runs, rewrite.runs), noise)
    timing = Timing(
        device=device,
        warmup=opts.warmup,
        repeats=rounds,
        before=before,
        after=after,
        speedup=difference.speedup,
        difference=difference,
        rules_note=rules_note,
        memory_before=peak_memory(original.results, opts.warmup),
        memory_after=peak_memory(rewrite.results, opts.warmup),
        stopped=stopped,
        compiled=_compiled(original, rewrite) if opts.compile_backend else None,
    )
    if rules_note is None:
        timing.rules = _rule_steps(programs, noise)
    return timing, rewrite.dispatch


def _timing_round(
    r: int,
    programs: list[Program],
    spec: Callable[[str, dict[str, str]], ChildSpec],
    opts: VerifyOptions,
    progress: Callable[[str], None],
    rules_note: str | None,
) -> str | None:
    """Round r: each program once (backwards on odd rounds), its step times kept; returns the rules note,
    set when an intermediate program fails (the original or the rewrite failing is a UserError)."""
    for program in programs if r % 2 == 0 else programs[::-1]:
        if program.label not in ("original", "rewrite") and rules_note is not None:
            continue  # an intermediate program failed earlier
        round_ = f", run {r + 1}/{opts.repeats}" if opts.repeats > 1 else ""
        progress(f"timing: {program.label}, {opts.warmup} warm-up + {opts.steps} steps{round_}")
        res = run_child(spec("timing", program.sources), timeout=opts.timeout)
        if res.error is not None and program.label in ("original", "rewrite"):
            raise UserError(f"the {program.label} failed in the timing phase: {_last_line(res.error)}")
        if res.error is not None:
            rules_note = (
                f"the program with only {', '.join(program.rules)} applied failed: {_last_line(res.error)}"
            )
            continue
        program.runs.append(step_durations_ms(res.result or {}, opts.warmup))
        program.results.append(res.result or {})
        if program.dispatch is None:
            program.dispatch = (res.result or {}).get("dispatch")
    return rules_note


def stop_reason(
    before: list[list[float]], after: list[list[float]], rounds: int, repeats: int, plain_ms: float | None
) -> str | None:
    """Why timing can stop after `rounds` rounds (issue 30), None to go on: the interval is tight (after
    two rounds at least: one says nothing of run-to-run variation), or the noise is such that more runs
    would not settle it."""
    runs_b, runs_a = [r for r in before if r], [r for r in after if r]
    if not runs_b or not runs_a:
        return None
    noise = machine_noise(runs_b, plain_ms)
    d = judge_noise(compare_times(runs_b, runs_a), noise)
    if rounds >= 2 and d.tight:
        return f"timing stopped after {rounds} of {repeats} rounds: the interval is tight"
    if d.verdict == INCONCLUSIVE:
        return f"timing stopped after {rounds} of {repeats} rounds: {noise:.0%} noise, more runs would not settle it"
    return None


def _rule_steps(programs: list[Program], noise: float = 0.0) -> list[RuleStepTime] | None:
    """Each rule: the program before it was added vs after (consecutive programs)."""
    rows = []
    for prev, cur in zip(programs, programs[1:], strict=False):
        before, after = summarise_runs(prev.runs), summarise_runs(cur.runs)
        if before is None or after is None:
            return None
        added = [r for r in cur.rules if r not in prev.rules]
        difference = judge_noise(compare_times(prev.runs, cur.runs), noise)
        rows.append(RuleStepTime(", ".join(added), before, after, difference))
    return rows
