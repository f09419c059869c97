"""Run folders: `.opadvisor/runs/<id>/` with profile.json and trace.json.gz; `.opadvisor/latest` names the newest.

Layout of a run folder (other commands add to it, never rewrite what `profile` wrote):
    profile.json         the Profile (see model.py); for a multi-rank run, profile.rank<N>.json per rank
    trace.json.gz        chrome trace (Perfetto / TensorBoard); trace.rank<N>.json.gz per rank
    applied.json         written by `opadvisor apply`: the rewrites made and where their backups are
    backup/              byte-exact copies of files before `apply` changed them (paths mirror the project)
    sources/<sha256>     the user's source files as profiled, by content (issue 30: `apply --force` places
                         the findings' lines on a file edited since, through a diff against this copy)
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from pathlib import Path

from opadvisor.errors import UserError
from opadvisor.files import atomic_write
from opadvisor.profile.model import Profile, ProfileFormatError, load_profile

STATE_DIR = ".opadvisor"
PROFILE_FILE = "profile.json"
TRACE_FILE = "trace.json.gz"
RANK_PROFILE = re.compile(r"profile\.rank(\d+)\.json")
SOURCES_DIR = "sources"
MAX_KEPT_SOURCE = 2 * 2**20  # a larger "source" is data, not the user's code: not kept


def keep_sources(sources: dict[str, str], run_dir: Path) -> None:
    """Copy each profiled user source file into run_dir/sources/<sha256>, when it still has that hash."""
    import hashlib

    for path, digest in sources.items():
        try:
            data = Path(path).read_bytes()
        except OSError:
            continue
        if len(data) > MAX_KEPT_SOURCE or hashlib.sha256(data).hexdigest() != digest:
            continue
        (run_dir / SOURCES_DIR).mkdir(exist_ok=True)
        (run_dir / SOURCES_DIR / digest).write_bytes(data)


def profiled_source(run_dir: Path, digest: str | None) -> bytes | None:
    """A source file as profiled (kept by `keep_sources`), None when the run keeps no copy of it."""
    if not digest or not re.fullmatch(r"[0-9a-f]{64}", digest):
        return None
    try:
        return (run_dir / SOURCES_DIR / digest).read_bytes()
    except OSError:
        return None


def state_dir(base: Path | None = None) -> Path:
    return (base or Path.cwd()) / STATE_DIR


def new_run_id() -> str:
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond // 1000:03d}-{os.getpid()}"


def mark_latest(run_dir: Path) -> None:
    """Point `.opadvisor/latest` at run_dir (a small text file, atomic replace)."""
    atomic_write(run_dir.parent.parent / "latest", (run_dir.name + "\n").encode("utf-8"))


def resolve_run(run: str | None, base: Path | None = None) -> Path:
    """The run folder a command should read: RUN as given (a folder or a run id), else the latest."""
    root = state_dir(base)
    if run:
        candidate = Path(run)
        if not candidate.is_dir():
            candidate = root / "runs" / run
        if not candidate.is_dir():
            raise UserError(f"no run folder {run!r} (looked for it as a path and under {root / 'runs'})")
        return candidate
    latest = root / "latest"
    if not latest.is_file():
        raise UserError("no run yet: run `opadvisor profile SCRIPT.py` first")
    name = latest.read_text(encoding="utf-8").strip()
    run_dir = root / "runs" / name
    if not run_dir.is_dir():
        raise UserError(f".opadvisor/latest names {name!r}, which no longer exists; profile again")
    return run_dir


def profile_paths(run_dir: Path) -> list[Path]:
    """profile.json, or for a multi-rank run every profile.rank<N>.json in rank order."""
    single = run_dir / PROFILE_FILE
    if single.is_file():
        return [single]
    ranked = {int(m.group(1)): p for p in run_dir.iterdir() if (m := RANK_PROFILE.fullmatch(p.name))}
    if ranked:
        return [ranked[r] for r in sorted(ranked)]
    raise UserError(f"{run_dir} has no profile.json (the profile did not finish?); profile again")


def load_run(run: str | None, base: Path | None = None) -> tuple[Path, list[Profile]]:
    """Resolve and load a run: (run folder, profiles in rank order). Errors are UserError, one line."""
    run_dir = resolve_run(run, base)
    try:
        return run_dir, [load_profile(p) for p in profile_paths(run_dir)]
    except ProfileFormatError as exc:
        raise UserError(str(exc)) from None
