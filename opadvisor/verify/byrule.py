"""Per applied rule: the time its ops took before the rewrite and after it.

Before: the run's own profile (the one the findings came from). After: a fresh profile of the rewritten
script, taken with `python -m opadvisor profile SCRIPT --steps N --warmup W --out DIR -- ARGS` (the same
steps, warm-up and arguments as the run; `--out` keeps it out of `.opadvisor/latest`).

The sites of a rule are the line ranges of its findings in the original profile (`run_rules`, restricted to
the files apply rewrote); without the rules engine, the lines apply recorded as changed. They are carried
into the rewritten file through a line diff of original and rewritten source (a replaced block maps to its
replacement). A site's time is the time of the outermost ops recorded at its lines, forward and backward
(backward ops carry their forward op's line): GPU time on a CUDA profile, CPU time (inclusive) otherwise,
per step, and as a share of that profile's median step: the two profiles were taken at different times, and
on a busy machine the shares compare better than the times.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.profile.model import Profile
from opadvisor.verify.applied import Applied


@dataclass
class RuleTime:
    rule: str
    files: list[str]
    lines: int  # source lines measured (in the original files)
    before_ms: float | None  # per step
    after_ms: float | None
    basis: str  # "gpu" | "cpu"
    before_share: float | None = None  # of the median step of the run's profile
    after_share: float | None = None  # of the median step of the re-profile

    @property
    def saved_ms(self) -> float | None:
        if self.before_ms is None or self.after_ms is None:
            return None
        return self.before_ms - self.after_ms


Sites = dict[str, set[int]]  # realpath -> lines


def _norm(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(path)


def map_lines(old_text: str, new_text: str, lines: Iterable[int]) -> set[int]:
    """Carry 1-based lines of old_text into new_text: equal lines move, a replaced block maps to its
    replacement (all of it), a deleted line maps to the line now at its place."""
    old, new = old_text.splitlines(), new_text.splitlines()
    wanted = set(lines)
    out: set[int] = set()
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        hit = {ln for ln in wanted if i1 < ln <= i2}
        if not hit:
            continue
        if tag == "equal":
            out.update(ln - i1 + j1 for ln in hit)
        elif j2 > j1:  # replace
            out.update(range(j1 + 1, j2 + 1))
        else:  # delete
            out.add(min(j1 + 1, max(len(new), 1)))
    return out


def site_time_ms(profile: Profile, sites: Sites) -> float | None:
    """Time per step of the outermost ops at the given lines (GPU time on CUDA, inclusive CPU time otherwise)."""
    if not profile.steps:
        return None
    selected = {
        op.id
        for op in profile.ops
        if op.step is not None and op.file and op.line in sites.get(_norm(op.file), ())
    }

    def has_selected_ancestor(op_id: int) -> bool:
        parent = profile.ops[op_id].parent
        while parent is not None:
            if parent in selected:
                return True
            parent = profile.ops[parent].parent
        return False

    total_us = 0.0
    for op_id in selected:
        if has_selected_ancestor(op_id):
            continue
        op = profile.ops[op_id]
        total_us += (op.gpu_time_us or 0.0) if profile.has_gpu else op.duration_us
    return total_us / 1000.0 / len(profile.steps)


def _rule_sites(rule: str, applied: Applied, findings: list[Any] | None) -> Sites:
    """Lines of the original files where the rule applied: its findings, else apply's change lines."""
    files = {_norm(f.path): f for f in applied.files if rule in f.rules}
    sites: Sites = {}
    if findings is not None:
        for finding in findings:
            key = _norm(finding.path)
            if finding.rule == rule and key in files:
                sites.setdefault(key, set()).update(range(finding.line, finding.end_line + 1))
    if not sites:
        for key, f in files.items():
            lines = {c.line for c in f.changes if c.rule == rule}
            if lines:
                sites.setdefault(key, set()).update(lines)
    return sites


def reprofile(profile: Profile, out_dir: Path, *, timeout: float | None) -> tuple[Profile | None, str]:
    """Profile the rewritten script like the run was; (profile, "") or (None, why not)."""
    from opadvisor.profile.model import ProfileFormatError, load_profile

    # A module run (`-m`, from the folder it ran in) is re-profiled the same way; a script by its path
    # (a script inside a package is again run as its module).
    as_module = profile.module is not None and profile.import_root == str(Path(profile.cwd or ".").resolve())
    target = ["-m", profile.module] if as_module else [profile.script]
    cmd = [
        sys.executable,
        "-m",
        "opadvisor",
        "profile",
        *target,
        "--steps",
        str(max(profile.steps_requested, 1)),
        "--warmup",
        str(profile.warmup_steps),
        "--out",
        str(out_dir),
        "--",
        *profile.argv[1:],
    ]
    try:
        proc = subprocess.run(
            cmd,
            cwd=profile.cwd or None,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"re-profiling timed out after {timeout:g} s"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, "re-profiling failed: " + " | ".join(tail)
    candidates = [out_dir / "profile.json", *sorted(out_dir.glob("*/profile.json"))]
    for path in candidates:
        if path.is_file():
            try:
                return load_profile(path), ""
            except ProfileFormatError as exc:
                return None, f"re-profiling wrote an unreadable profile: {exc}"
    return None, f"re-profiling wrote no profile.json under {out_dir}"


def rule_times(
    profile: Profile, applied: Applied, *, timeout: float | None = None, after: Profile | None = None
) -> tuple[list[RuleTime], list[str]]:
    """Before/after time per applied rule, and notes on what could not be measured."""
    notes: list[str] = []
    findings: list[Any] | None
    try:
        from opadvisor.rules.engine import run_rules
        from opadvisor.rules.registry import rule_ids

        # the library fixes' codemods (library_patch, ...) are recorded under their own names: not rules
        findings = list(run_rules([profile], select=[r for r in applied.rules if r in rule_ids()]))
    except (ImportError, UserError) as exc:
        findings = None
        notes.append(f"the rules could not run ({exc}): sites are the lines apply changed")

    if after is None:
        with tempfile.TemporaryDirectory(prefix="opadvisor-reprofile-") as tmp:
            after, why = reprofile(profile, Path(tmp), timeout=timeout)
        if after is None:
            notes.append(why)

    texts = {
        _norm(f.path): (
            f.original.read_text(encoding="utf-8", errors="replace"),
            f.path.read_text(encoding="utf-8", errors="replace"),
        )
        for f in applied.files
    }
    basis = "gpu" if profile.has_gpu else "cpu"
    rows = []
    for rule in applied.rules:
        sites = _rule_sites(rule, applied, findings)
        new_sites = {key: map_lines(*texts[key], lines) for key, lines in sites.items()}
        before_ms = site_time_ms(profile, sites) if sites else None
        after_ms = site_time_ms(after, new_sites) if (after is not None and sites) else None
        rows.append(
            RuleTime(
                rule=rule,
                files=sorted(sites) or sorted(str(f.path) for f in applied.files if rule in f.rules),
                lines=sum(len(v) for v in sites.values()),
                before_ms=before_ms,
                after_ms=after_ms,
                basis=basis,
                before_share=_share(before_ms, profile),
                after_share=_share(after_ms, after),
            )
        )
    return rows, notes


def _share(ms: float | None, profile: Profile | None) -> float | None:
    step = profile.median_step_ms() if profile is not None else None
    return ms / step if (ms is not None and step) else None
