"""`opadvisor profile`: run a training script in-process under the session, then write its run folder.

The script runs with its own argv and `__name__ == "__main__"`, from its own directory on sys.path, as
`python script.py args` would; a module (`-m`) as `python -m module args` would. Outcomes:
- the window was recorded: the run is written and the script is stopped (unless `run_to_end`);
- the script ended, failed or called sys.exit before the window completed: what was recorded (at least
  one whole step) is still written, marked incomplete, and the outcome says how far it got.
A run folder appears whole or not at all: it is written beside its final place and renamed into it.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import os
import platform
import runpy
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opadvisor.errors import UserError
from opadvisor.files import current_umask, file_sha256
from opadvisor.profile import runs
from opadvisor.profile.events import TreeReader, assign_steps, profiler_step_ranges
from opadvisor.profile.memory import attach_memory
from opadvisor.profile.model import Environment, Profile, save_profile
from opadvisor.profile.session import Recording, Session, SessionConfig, WindowComplete
from opadvisor.profile.target import Target
from opadvisor.profile.userframes import LibraryFile, resolve_user_file, set_search_path

NO_SCRIPT = "<interactive>"  # the script of a run recorded in a notebook or `python -c` (a Trainer callback)


@dataclass
class RunOutcome:
    run_dir: Path | None  # None when nothing was recorded
    profile: Profile | None
    status: str  # "complete" | "ended_early" | "script_error" | "script_exit" | "interrupted" | "no_steps"
    steps_seen: int = 0
    exit_code: int | None = None  # the script's sys.exit code, when it called sys.exit
    script_traceback: str | None = None
    warnings: list[str] = field(default_factory=list)


def check_output_parent(out: Path | None, cwd: Path) -> Path:
    """The folder the run will be created in; UserError now (before running anything) if not writable."""
    parent = out.parent if out is not None else runs.state_dir(cwd) / "runs"
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".probe-"):
            pass
    except OSError as exc:
        raise UserError(f"cannot write the run under {parent}: {exc.strerror or exc}") from None
    return parent


def environment(cuda: bool) -> Environment:
    import torch

    env = Environment(
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device="cuda" if cuda else "cpu",
        cpu_count=os.cpu_count(),
    )
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.gpu_name = props.name
        env.sm_count = props.multi_processor_count
        env.capability = [props.major, props.minor]
        env.gpu_memory_bytes = props.total_memory
        env.copy_bandwidth_gbps = copy_bandwidth_gbps()
    return env


COPY_BYTES = 256 * 2**20  # large enough to stream from memory (the L2 of an H200 holds 50 MB)


def copy_bandwidth_gbps(repeats: int = 5) -> float | None:
    """GB/s (bytes read + written) of the fastest of `repeats` device-to-device copies of COPY_BYTES on
    the current CUDA device, after one warm-up copy; None when the memory for it is not free."""
    import torch

    try:
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
    except torch.cuda.OutOfMemoryError:
        return None
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del src, dst
    return round(2 * COPY_BYTES / (best / 1e3) / 1e9, 1) if best > 0 else None


def build_profile(
    recording: Recording, session: Session, target: Target | None, argv: list[str], cuda: bool
) -> Profile:
    """The Profile of a stopped recording (its profiler has exported nothing yet)."""
    results = recording.profiler.profiler.kineto_results
    roots = results.experimental_event_tree()
    marks_ns = [(m.start_ns, m.end_ns) for m in recording.steps]
    origin_ns = _profiler_origin(roots, marks_ns)
    reader = TreeReader(origin_ns, session.module_paths, cuda, session.module_types, session.tensor_kinds())
    extracted = reader.read(roots)
    marks_us = [
        ((s - origin_ns) / 1000.0, (e - origin_ns) / 1000.0) for s, e in _step_marks_in_tree(roots, marks_ns)
    ]
    assign_steps(extracted, marks_us, cuda)
    module_calls = session.module_calls.results()
    attach_memory(extracted.steps, module_calls, session.step_memory)
    profile = session_profile(session, target, argv, cuda, set(extracted.user_files), module_calls)
    profile.complete = recording.complete and len(recording.steps) >= session.config.steps
    profile.steps, profile.ops = extracted.steps, extracted.ops
    profile.annotations, profile.syncs, profile.memcpys = (
        extracted.annotations,
        extracted.syncs,
        extracted.memcpys,
    )
    profile.libraries = _libraries(extracted.library_files.values())
    profile.library_sources = {
        lib.rel: h for lib in extracted.library_files.values() if (h := file_sha256(lib.path)) is not None
    }
    return profile


def session_profile(
    session: Session,
    target: Target | None,
    argv: list[str],
    cuda: bool,
    user_files: set[str] | None = None,
    module_calls: list | None = None,
) -> Profile:
    """What the session knows without a recorded window: the script, environment, construction sites,
    calibration; no steps or ops (issue 30: the partial run of a script that stopped in its warm-up)."""
    module_calls = module_calls if module_calls is not None else []
    # no target: recorded from a notebook or an interactive session (a Trainer callback there)
    files = set(user_files or ()) | ({str(target.path)} if target else set())
    files |= {c.file for c in session.constructions if c.file}
    files |= {c.file for c in module_calls if c.file}
    frames = session.compiles.frames
    files |= {f for frame in frames for f in (frame.file, frame.break_file) if f and resolve_user_file(f)}
    return Profile(
        run_id="",
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        script=str(target.path) if target else NO_SCRIPT,
        module=target.module if target else None,
        import_root=str(target.import_root) if target and target.module else None,
        argv=argv,
        cwd=os.getcwd(),
        environment=environment(cuda),
        sources={f: h for f in sorted(files) if (h := file_sha256(f)) is not None},
        step_detection=session.detection,
        warmup_steps=session.config.warmup,
        steps_requested=session.config.steps,
        complete=False,
        eager=session.config.eager,
        constructions=session.constructions,
        module_calls=module_calls,
        memory_notes=list(session.memory.notes),
        memory_requested=session.config.memory_requested,
        modules=dict(session.modules),
        calibration=session.calibration(),
        steps_seen=session.steps_seen,
        compiled_frames=list(frames),
    )


def _libraries(files: Iterable[LibraryFile]) -> dict[str, dict[str, Any]]:
    """{package: {"version", "root"}} of the installed packages these library files belong to."""
    out: dict[str, dict[str, Any]] = {}
    for lib in files:
        if lib.package in out:
            continue
        root = lib.path[: len(lib.path) - len(lib.rel)].rstrip("/\\")
        out[lib.package] = {"version": _package_version(lib.package), "root": root}
    return dict(sorted(out.items()))


def _package_version(package: str) -> str | None:
    from importlib import metadata

    try:
        dists = metadata.packages_distributions().get(package) or [package]
        return metadata.version(dists[0])
    except (metadata.PackageNotFoundError, ValueError):
        module = sys.modules.get(package)
        version = getattr(module, "__version__", None)
        return str(version) if version is not None else None


def _step_marks_in_tree(roots: list, marks_ns: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Step intervals on the profiler's clock: the `ProfilerStep#i` ranges the session opened.

    The session also took perf_counter marks; the profiler's own clock is what ops are stamped with, so
    prefer the ranges it recorded and fall back to the marks only if a range is missing.
    """
    found = profiler_step_ranges(roots)
    ordered = [found[i] for i in sorted(found) if i < len(marks_ns)]
    if len(ordered) != len(marks_ns):
        return marks_ns
    # A step ends where the next begins: the range closes inside the hook, a little before the next opens.
    return [(s, ordered[i + 1][0] if i + 1 < len(ordered) else e) for i, (s, e) in enumerate(ordered)]


def _profiler_origin(roots: list, marks_ns: list[tuple[int, int]]) -> int:
    starts = [r.start_time_ns for r in roots if r.start_time_ns > 0]
    return min(starts) if starts else (marks_ns[0][0] if marks_ns else 0)


def _export_trace(recording: Recording, dest: Path) -> None:
    raw = dest.with_suffix("")  # trace.json
    recording.profiler.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(dest, "wb", compresslevel=5) as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
    raw.unlink()


def write_run(
    recording: Recording | None,
    session: Session,
    target: Target | None,
    argv: list[str],
    cuda: bool,
    out: Path | None,
    cwd: Path,
    rank: tuple[int, int] | None = None,  # issue 9
    stopped: str | None = None,  # why the window is incomplete (Profile.stopped)
) -> tuple[Path, Profile]:
    """Write profile.json and trace.json.gz into a fresh folder, renamed into place when both are whole.

    `recording` None (issue 30): the script stopped before the window opened; the run keeps what the session
    knows (`session_profile`: no steps, no trace), so the next command says what happened."""
    if rank is not None:  # issue 9: one rank of a multi-process run
        assert recording is not None
        return _write_rank_files(recording, session, target, argv, cuda, out, rank)
    final = out if out is not None else runs.state_dir(cwd) / "runs" / runs.new_run_id()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        if recording is not None:
            profile = build_profile(recording, session, target, argv, cuda)
        else:
            profile = session_profile(session, target, argv, cuda)
        profile.run_id, profile.stopped = final.name, stopped
        save_profile(profile, staging / runs.PROFILE_FILE)
        runs.keep_sources(profile.sources, staging)  # issue 30: apply --force diffs against these
        if recording is not None:
            _export_trace(recording, staging / runs.TRACE_FILE)
        staging.chmod(0o777 & ~current_umask())  # mkdtemp makes it private; a run folder is ordinary
        if final.exists():
            final.rmdir()  # an empty --out folder (checked before the run)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out is None:
        runs.mark_latest(final)
    return final, profile


def rank_file_names(rank: int) -> tuple[str, str]:
    """(issue 9) The profile and trace file names of one rank, as `runs.profile_paths` reads them."""
    return f"profile.rank{rank}.json", f"trace.rank{rank}.json.gz"


def _write_rank_files(
    recording: Recording,
    session: Session,
    target: Target | None,
    argv: list[str],
    cuda: bool,
    out: Path | None,
    rank: tuple[int, int],
) -> tuple[Path, Profile]:
    """(issue 9, opadvisor/profile/distributed.py) `rank` = (rank, world_size): `out` is the run folder the
    launcher made and every rank shares; this rank adds profile.rank<N>.json and trace.rank<N>.json.gz,
    each renamed into place whole, the trace first (a profile file means both are there). The launcher
    marks the run latest once every rank has written.
    """
    assert out is not None and out.is_dir()
    staging = Path(tempfile.mkdtemp(prefix=f".rank{rank[0]}.partial-", dir=out))
    try:
        profile = build_profile(recording, session, target, argv, cuda)
        profile.run_id, (profile.rank, profile.world_size) = out.name, rank
        profile_name, trace_name = rank_file_names(rank[0])
        save_profile(profile, staging / profile_name)
        _export_trace(recording, staging / trace_name)
        for name in (trace_name, profile_name):
            (staging / name).chmod(0o666 & ~current_umask())
            (staging / name).rename(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, profile


def _user_traceback(exc: BaseException, script: Path) -> str:
    """The script's traceback without opadvisor's and runpy's frames above it."""
    tb = exc.__traceback__
    script_name = str(script)
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()) != script_name:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_script(
    target: Target,
    args: list[str],
    config: SessionConfig,
    out: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    rank: tuple[int, int] | None = None,
) -> RunOutcome:
    """Run the target (a script, or a module as `python -m` runs it) with `args` under a profiling session
    and write what it recorded. The target was checked (`opadvisor.profile.target`) before torch loaded.

    `rank` (issue 9): (rank, world_size) when this process is one rank of `opadvisor profile
    --nproc-per-node`; `out` is then the run folder shared by all ranks (see `_write_rank_files`).
    """
    cwd = Path.cwd()
    if rank is None:  # issue 9: a rank's shared folder was checked and made by its launcher
        check_output_parent(out, cwd)
    import torch

    config.cuda = torch.cuda.is_available()
    argv = [target.filename, *args]
    session = Session(config, on_progress)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = argv
    sys.path.insert(0, str(target.import_root))
    set_search_path(sys.path, [str(target.import_root)])
    status, exit_code, script_tb = "ended_early", None, None
    session.install()
    try:
        if target.module is not None:  # as `python -m`: the package imported first, its context kept
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target.filename, run_name="__main__")
    except WindowComplete:
        status = "complete"
    except SystemExit as exc:
        code = exc.code
        exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        status = "ended_early" if exit_code == 0 else "script_exit"
    except KeyboardInterrupt:  # Ctrl-C (SIGINT) or the script's own: keep what was recorded (issue 30)
        status = "interrupted"
    except BaseException as exc:  # the user's own failure: report it, keep what was recorded
        status, script_tb = "script_error", _user_traceback(exc, target.path)
    finally:
        try:
            recording = session.finish()  # first: a window still open stops with the script's sys.path
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            os.chdir(cwd)  # a script that changed folder: the run is written, and verify reruns it, from here
            session.uninstall()
    return record_run(session, recording, status, target, argv, out, cwd, rank, exit_code, script_tb, True)


def record_run(
    session: Session,
    recording: Recording | None,
    status: str,
    target: Target | None,  # None: no script (a notebook, `python -c`: a Trainer callback there)
    argv: list[str],
    out: Path | None,
    cwd: Path,
    rank: tuple[int, int] | None = None,
    exit_code: int | None = None,
    script_tb: str | None = None,
    keep_warmup_stop: bool = False,
) -> RunOutcome:
    """The outcome of a finished session (`finish()`ed and uninstalled), its run written when it recorded
    at least one whole step, or with `keep_warmup_stop` (`opadvisor profile`, issue 30) when the script
    stopped in its warm-up after a step or more (a run without steps that says so). Shared by `run_script` and the in-process `WindowRecorder` (recorder.py)."""
    if recording is not None and recording.complete and status in ("ended_early", "complete"):
        status = "complete"  # --run-to-end, or a time window the script outlived
    outcome = RunOutcome(None, None, status, session.steps_seen, exit_code, script_tb, list(session.warnings))
    stopped = None if status == "complete" else status
    if recording is not None and recording.steps:
        outcome.run_dir, outcome.profile = write_run(
            recording, session, target, argv, session.config.cuda, out, cwd, rank, stopped
        )
    elif keep_warmup_stop and session.steps_seen and status != "complete" and rank is None:
        # issue 30: stopped in the warm-up; a run without steps says how far the script got
        outcome.run_dir, outcome.profile = write_run(
            None, session, target, argv, session.config.cuda, out, cwd, None, stopped
        )
    elif session.steps_seen == 0 and status not in ("script_error", "script_exit"):
        outcome.status = "no_steps"
    session.keep_alive.clear()
    return outcome


def profile_steps(
    step: Callable[[], object], source: Path, *, steps: int = 1, warmup: int = 1, cuda: bool = False
) -> Profile:
    """Profile `step()` in this process, each call one training step (`warmup` unrecorded, then `steps`).

    What `opadvisor profile` records for a script, for code already loaded in this process (tests, and
    tools that build a model in-process): `source` is the file the profile names as its script.
    """
    session = Session(SessionConfig(warmup=warmup, steps=steps, run_to_end=True, cuda=cuda))
    set_search_path(sys.path)  # torch names files relative to the sys.path entry they were found under
    session.install()
    try:
        for _ in range(warmup + steps):
            step()
            session.on_step(explicit=True)
    finally:
        recording = session.finish()
        session.uninstall()
    if recording is None or not recording.steps:
        raise RuntimeError("no step was recorded")
    from opadvisor.profile.target import known_target

    return build_profile(recording, session, known_target(str(source)), [str(source)], cuda)
