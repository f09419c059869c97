"""`verify` end to end: original vs rewritten program, loss parity, step-time speedup, time per applied rule.

1. Read the run (its profile gives the script, argv and working directory) and applied.json (the backups
   that rebuild the original program; see `applied.py`).
2. Parity phase: the original and the rewrite each run `steps` steps in a fresh process under the harness
   with the same seed, dropout neutralised and deterministic algorithms on (`harness.py`); their per-step
   losses and step-1 gradient norms are compared within a dtype-aware tolerance (`compare.py`).
3. Timing phase (skipped when parity fails, or with timing=False): each runs `warmup + steps` steps with
   normal settings, `repeats` times, original and rewrite alternating; the median step time after the
   warm-up, with its quartiles, and the speedup; on CUDA also each program's peak memory (the largest
   per-step peak of allocated and reserved bytes over the timed steps).
4. Per applied rule (skipped when parity fails, or with reprofile=False): the rewritten script is
   profiled again and the time of each rule's sites compared before/after (`byrule.py`).

The original failing under the harness is a user error (nothing to compare with); the rewrite failing, or
its losses leaving the tolerance, is a parity failure, named by its first diverging step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.profile.model import Profile
from opadvisor.verify.applied import load_applied
from opadvisor.verify.byrule import RuleTime, rule_times
from opadvisor.verify.compare import (
    Parity,
    PeakMemory,
    Speedup,
    StepTimes,
    compare_parity,
    peak_memory,
    speedup,
    step_durations_ms,
    summarise,
)
from opadvisor.verify.runner import ChildSpec, run_child

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
    reprofile: bool = True
    repeats: int = 1  # timing runs of each program, alternated
    timeout: float | None = None  # per child process, seconds


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

    @property
    def ok(self) -> bool:
        return self.parity.ok

    def to_dict(self) -> dict[str, Any]:
        p = self.parity
        data: dict[str, Any] = {
            "schema": REPORT_SCHEMA,
            "run": self.run,
            "script": self.script,
            "ok": self.ok,
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
            },
            "timing": None,
            "rules": None,
            "notes": self.notes,
        }
        if self.timing is not None:
            t = self.timing
            data["timing"] = {
                "device": t.device,
                "warmup": t.warmup,
                "repeats": t.repeats,
                "before": _times(t.before),
                "after": _times(t.after),
                "speedup": t.speedup.factor,
                "speedup_low": t.speedup.low,
                "speedup_high": t.speedup.high,
                "peak_memory": _peaks(t.memory_before, t.memory_after),
            }
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
    return {"median_ms": t.median_ms, "p25_ms": t.p25_ms, "p75_ms": t.p75_ms, "steps": t.n}


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
    argv = profile.argv or [script]
    cwd = profile.cwd or str(Path(script).parent)
    sources = applied.sources()

    def spec(mode: str, original: bool) -> ChildSpec:
        return ChildSpec(
            script=script,
            argv=argv,
            cwd=cwd,
            steps=opts.steps,
            mode=mode,
            warmup=opts.warmup if mode == "timing" else 0,
            seed=opts.seed,
            sources=(applied.parity_sources() if mode == "parity" else sources) if original else {},
            module=profile.module,
            import_root=profile.import_root,
        )

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
    if profile.world_size > 1:
        notes.append("a multi-rank run: verify runs the script as a single process")

    progress(f"parity: original, {opts.steps} steps")
    before = run_child(spec("parity", original=True), timeout=opts.timeout)
    if before.error is not None:
        raise UserError(f"the original script failed under verify: {_last_line(before.error)}")
    progress(f"parity: rewrite, {opts.steps} steps")
    after = run_child(spec("parity", original=False), timeout=opts.timeout)
    parity = compare_parity(
        before.result or {}, after.result or {}, steps=opts.steps, rtol=opts.rtol, atol=opts.atol
    )
    report = VerifyReport(
        run=display_path(run_dir),
        script=display_path(script),
        applied_rules=applied.rules,
        parity=parity,
        notes=notes,
    )
    if after.error is not None:
        report.rewrite_error = after.error
        parity.ok = False
        if parity.first_bad_step is None:
            parity.first_bad_step = len(parity.steps) + 1
        parity.message = (
            f"the rewritten script failed at step {parity.first_bad_step}: {_last_line(after.error)}"
        )
        return report
    served = set((before.result or {}).get("served", []))
    notes += [
        f"{display_path(f.path)} was never imported by the script: its rewrite was not exercised"
        for f in applied.files
        if os.path.realpath(f.path) not in served
    ]
    recorded = len((before.result or {}).get("steps", []))
    if recorded < opts.steps:
        notes.append(f"the script ended after {recorded} steps (asked for {opts.steps})")
    if not parity.ok:
        return report

    if opts.timing:
        report.timing = _timing(spec, opts, progress, device=(before.result or {}).get("device", "cpu"))
        if report.timing is None:
            notes.append("timing skipped: fewer than one step after the warm-up; lower --warmup")
    if opts.reprofile:
        progress("re-profiling the rewritten script")
        report.rules, rule_notes = rule_times(profile, applied, timeout=opts.timeout)
        notes.extend(rule_notes)
    return report


def _timing(
    spec: Callable[[str, bool], ChildSpec], opts: VerifyOptions, progress: Callable[[str], None], device: str
) -> Timing | None:
    """Original and rewrite alternately, `repeats` times each (so a slow spell of the machine hits both)."""
    durations: dict[bool, list[float]] = {True: [], False: []}
    results: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for r in range(opts.repeats):
        for original in (True, False):
            which = "original" if original else "rewrite"
            round_ = f", run {r + 1}/{opts.repeats}" if opts.repeats > 1 else ""
            progress(f"timing: {which}, {opts.warmup} warm-up + {opts.steps} steps{round_}")
            res = run_child(spec("timing", original), timeout=opts.timeout)
            if res.error is not None:
                raise UserError(f"the {which} failed in the timing phase: {_last_line(res.error)}")
            durations[original] += step_durations_ms(res.result or {}, opts.warmup)
            results[original].append(res.result or {})
    before, after = summarise(durations[True]), summarise(durations[False])
    if before is None or after is None:
        return None
    return Timing(
        device=device,
        warmup=opts.warmup,
        repeats=opts.repeats,
        before=before,
        after=after,
        speedup=speedup(before, after),
        memory_before=peak_memory(results[True], opts.warmup),
        memory_after=peak_memory(results[False], opts.warmup),
    )
