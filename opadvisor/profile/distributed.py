"""`opadvisor profile --nproc-per-node N`: profile every rank of a multi-process (torchrun) training run.

Two halves, one per process kind:

- `launch` runs in the `opadvisor profile` process. It checks the script, makes the run folder, and runs

      python -m opadvisor.profile._dist_launch FAILURES.json --nproc-per-node N --max-restarts 0
             (--standalone | --nnodes K --node-rank R --master-addr A [--master-port P])
             -m opadvisor.profile.distributed RUN_DIR --warmup W --steps S SCRIPT -- ARGS...

  (torchrun itself, its failure summary kept as data) in a session of its own: Ctrl-C reaches torchrun
  as one SIGTERM, which it passes on to every rank. When torchrun has ended it reads what each rank
  reported and returns a `DistOutcome`; the run is marked latest only when every rank of this node
  wrote its profile (and never for `--out`, as for a single process).
- `rank_main` is that `-m opadvisor.profile.distributed` entry, once per rank: the runner's
  `run_script` runs the script in-process and writes rank-named files into the shared run folder.

Run folder of a multi-rank run (beside what `runs.py` describes):
    profile.rank<N>.json, trace.rank<N>.json.gz   written by rank N (`rank`/`world_size` in the profile)
    status.rank<N>.json   how rank N ended: {"rank", "local_rank", "node_rank", "world_size", "host",
                          "pid", "status" ("running" until it ends, then the runner's status,
                          "terminated" or "opadvisor_error"), "steps_seen", "steps_recorded",
                          "exit_code", "error" (last line of the traceback), "traceback", "ended_at"}

Lockstep: every rank stops at the same step boundary, the post hook of its `warmup + steps`-th
optimizer step. Under DDP the gradients of that step were all-reduced during backward on every rank,
so no rank stops while a peer still waits in a collective of the window, and no collective runs after
it (the process group is destroyed on each rank once its script has stopped cleanly). The single-process
time-window fallback (for scripts that never step) is off here: ranks would close their windows at
different moments, in the middle of different collectives.

A failing rank: its `run_script` catches the script's exception and writes the steps it recorded; the
rank then exits non-zero and torchrun (`--max-restarts 0`) stops the other ranks with SIGTERM (SIGKILL
after its grace period, 30 s). A rank inside its script turns SIGTERM into an exception, so it too keeps
the steps it recorded; one that is handling its script's end or writing its files finishes first. Peers
waiting in a gloo collective get "connection closed" as soon as the failed process exits. A rank blocked
in C (a NCCL peer in a CUDA wait, a recv nobody answers) cannot run Python handlers: a watchdog thread
reports it terminated and ends it `_BLOCKED_S` after the SIGTERM. No rank hangs.

What a failed run keeps: whatever profiles the ranks wrote (each file whole). The folder is marked
latest only if every rank of this node wrote its profile (as a single-process run that failed after
recording is); if no rank wrote one, the folder is removed. The error names the root cause first: a
rank that failed by itself (its exception, sys.exit, or death by a signal torchrun did not send), not
one whose error only says that a peer went away nor one torchrun stopped; then the others; then
torchrun's exit code. The root cause's traceback is printed above the error line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from opadvisor.errors import UserError
from opadvisor.profile import runs
from opadvisor.profile.model import Profile, ProfileFormatError, load_profile
from opadvisor.profile.target import Target, known_target

STATUS_PREFIX = "status.rank"
_MODULE = "opadvisor.profile.distributed"
# Seconds the launcher waits for torchrun to stop its ranks after Ctrl-C before it kills torchrun itself
# (torchrun's own grace period for a rank that ignores SIGTERM is 30 s).
_INTERRUPT_GRACE_S = 45.0


def status_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"{STATUS_PREFIX}{rank}.json"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    tmp.replace(path)


# ---- the rank side: `python -m opadvisor.profile.distributed` under torchrun ------------------------


class RankTerminated(BaseException):  # noqa: N818 - a control-flow signal, like WindowComplete
    """SIGTERM from torchrun (another rank failed, or Ctrl-C) while this rank's script was running."""


_REDELIVER_S = 0.5  # a SIGTERM that came while the runner was writing is looked at again this often
_BLOCKED_S = 5.0  # a rank whose script is still running this long after SIGTERM is blocked in C: end it


class _TermGuard:
    """How a rank answers torchrun's SIGTERM (another rank failed, or the launcher's Ctrl-C).

    The Python handler stops the script where it is (RankTerminated, which the runner handles like the
    script's own exception, so the recorded steps are still written), never the writing itself. A main
    thread blocked in C (a collective whose peer is gone, a CUDA wait) cannot run Python handlers: a
    watchdog thread, woken through the signal wakeup fd, then reports the rank as terminated and ends
    the process, instead of leaving it to torchrun's SIGKILL 30 s later.
    """

    def __init__(self, status: dict, status_file: Path):
        self.status, self.status_file = status, status_file
        self.script_path: str | None = None  # the script as runpy runs it (its frames' co_filename)
        self.done = False  # run_script has returned: the script and this rank's files are finished

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self.on_sigterm)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="opadvisor-sigterm", daemon=True).start()

    def _in_script(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename == self.script_path and frame.f_code.co_name == "<module>":
                return True
            frame = frame.f_back
        return False

    def on_sigterm(self, signum, frame) -> None:
        """Inside the script or before run_script: raise. Inside run_script but not in the script (about
        to start it, or handling its end and writing the files): look again shortly. After: ignore."""
        from opadvisor.profile.runner import run_script

        if self.done:
            return
        if self._in_script(frame):
            raise RankTerminated("stopped by the launcher (SIGTERM)")
        in_runner = False
        while frame is not None and not in_runner:
            in_runner, frame = frame.f_code is run_script.__code__, frame.f_back
        if not in_runner:
            raise RankTerminated("stopped by the launcher (SIGTERM)")
        timer = threading.Timer(_REDELIVER_S, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGTERM.value not in data:
                continue
            time.sleep(_BLOCKED_S)
            main = sys._current_frames().get(threading.main_thread().ident)
            if self.done or not self._in_script(main):
                continue  # the handler stopped the script, or the rank is writing / finished
            self.status.update(
                status="terminated",
                error="stopped by the launcher while blocked in the script (in a collective or a device wait)",
                ended_at=time.time(),
            )
            _write_json(self.status_file, self.status)
            os._exit(128 + signal.SIGTERM.value)


def rank_main(argv: list[str] | None = None) -> int:
    """One rank: run the script under the profiler, write rank-named files, report how it ended."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--calibrate", type=int, default=3)
    parser.add_argument("--run-to-end", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--no-activations", action="store_true")
    parser.add_argument("--module", help="run SCRIPT's module as `python -m MODULE` (the launcher found it)")
    parser.add_argument("--import-root", type=Path, help="sys.path[0] for --module")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    status = {
        "rank": rank,
        "local_rank": local_rank,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "world_size": world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "status": "running",
        "steps_seen": 0,
        "steps_recorded": 0,
        "exit_code": None,
        "error": None,
        "traceback": None,
        "ended_at": None,
    }
    path = status_path(ns.run_dir, rank)
    _write_json(path, status)
    guard = _TermGuard(status, path)
    guard.install()
    code = 1
    try:
        code = _run_rank(ns, args, rank, world_size, local_rank, status, guard)
    except BaseException as exc:  # opadvisor's own failure (or a SIGTERM while writing): report it
        status["status"] = "terminated" if isinstance(exc, RankTerminated) else "opadvisor_error"
        status["error"] = f"{type(exc).__name__}: {exc}"
        status["traceback"] = traceback.format_exc()
    finally:
        status["ended_at"] = time.time()
        _write_json(path, status)
    return code


def _run_rank(
    ns, args: list[str], rank: int, world_size: int, local_rank: int, status: dict, guard: _TermGuard
) -> int:
    import torch

    from opadvisor.profile.runner import run_script
    from opadvisor.profile.session import SessionConfig

    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        # The profiler synchronises the current device: make it this rank's GPU (as scripts do) so that
        # rank N does not also open a context on GPU 0.
        torch.cuda.set_device(local_rank)
    config = SessionConfig(
        warmup=ns.warmup,
        steps=ns.steps,
        run_to_end=ns.run_to_end,
        calibrate=ns.calibrate,
        window_after_seconds=float("inf"),  # no time-window fallback across ranks (see the module doc)
        activations=not ns.no_activations,
        memory_requested=ns.memory,
    )
    target = known_target(str(ns.script), ns.module, ns.import_root)  # as the launcher found it
    guard.script_path = target.filename
    outcome = run_script(target, args, config, out=ns.run_dir, rank=(rank, world_size))
    guard.done = True
    status.update(
        status=outcome.status,
        steps_seen=outcome.steps_seen,
        steps_recorded=len(outcome.profile.steps) if outcome.profile else 0,
        exit_code=outcome.exit_code,
        traceback=outcome.script_traceback,
        error=_last_line(outcome.script_traceback),
    )
    if RankTerminated.__name__ in (status["error"] or ""):
        status["status"] = "terminated"
    if outcome.status == "complete":
        _destroy_process_group()
    if outcome.status == "script_error":
        return 1
    if outcome.status == "script_exit":
        return outcome.exit_code or 1
    return 0


def _destroy_process_group() -> None:
    """The window ended cleanly on every rank at the same step: release the group (NCCL warns otherwise),
    and collect what still refers to it while the interpreter is whole. A gloo group left for the
    interpreter's exit aborts the process now and then ("terminate called without an active exception":
    its worker thread needs the GIL during finalization and is killed; torch 2.13 on the CPU, about one run
    in four under load, with or without opadvisor)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the profile is written; a failing teardown changes nothing
            pass
    gc.collect()


def _last_line(text: str | None) -> str | None:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


# ---- the launcher side: inside `opadvisor profile --nproc-per-node N` --------------------------------

# Errors a rank raises because a peer went away: consequences of another rank's failure, not causes.
_PEER_FAILURE_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL communicator was aborted",
    "remote process exited",
)
_STOPPED = ("terminated", "running", "missing")  # no failure of its own reported


@dataclass
class RankReport:
    """How one rank ended: its status file, and torchrun's exit code for it."""

    rank: int
    status: str  # a runner status, "terminated", "opadvisor_error", "running" (died), "missing" (no report)
    local_rank: int | None = None
    host: str | None = None
    steps_seen: int = 0
    exit_code: int | None = None  # the script's sys.exit code
    error: str | None = None  # last line of the traceback
    traceback: str | None = None
    ended_at: float | None = None
    launcher_exit: int | None = None  # what torchrun saw (negative: the signal that ended it)
    launcher_signal: str | None = None
    wrote_profile: bool = False

    @property
    def failed(self) -> bool:
        return self.status not in ("complete", "ended_early", "no_steps")

    @property
    def peer_failure(self) -> bool:
        """Its error says a peer went away: it follows from another rank's failure."""
        return any(w in (self.error or "") for w in _PEER_FAILURE_WORDS)

    def where(self) -> str:
        host = f" on {self.host}" if self.host else ""
        local = f" (local rank {self.local_rank}{host})" if self.local_rank is not None else ""
        return f"rank {self.rank}{local}"


@dataclass
class DistOutcome:
    run_dir: Path | None  # None when no rank wrote a profile (the folder was removed)
    launcher_code: int  # torchrun's exit code (negative: it was killed by that signal)
    ranks: list[RankReport] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)  # this node's profiles, rank order
    marked_latest: bool = False
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return self.launcher_code == 0 and not self.interrupted and not any(r.failed for r in self.ranks)

    def root_cause(self) -> RankReport | None:
        """The rank whose failure caused the others'.

        First a rank that failed by itself (its own exception or exit, or death by a signal torchrun did not
        send), not one whose error only says a peer went away, nor one the launcher stopped; the earliest
        to end among those. Failing that, the earliest failed rank.
        """
        failed = [r for r in self.ranks if r.failed]
        own = [r for r in failed if r.status not in _STOPPED and not r.peer_failure]
        died = [
            r
            for r in failed
            if r.status in ("running", "missing") and r.launcher_signal not in (None, "SIGTERM")
        ]
        pool = own or died or failed
        return min(pool, key=lambda r: (r.ended_at is None, r.ended_at or 0.0, r.rank)) if pool else None


@dataclass
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node), "--max-restarts", "0"]
        if self.nnodes == 1:
            return [*args, "--standalone"]  # a free local port: parallel runs do not collide
        args += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank)]
        args += ["--master-addr", self.master_addr or "127.0.0.1"]
        if self.master_port is not None:
            args += ["--master-port", str(self.master_port)]
        return args

    def node_ranks(self) -> range:
        """Global ranks of this node (static rendezvous numbers ranks node by node)."""
        return range(self.node_rank * self.nproc_per_node, (self.node_rank + 1) * self.nproc_per_node)


def check_spec(spec: LaunchSpec, out: Path | None) -> None:
    if spec.nproc_per_node < 1 or spec.nnodes < 1:
        raise UserError("--nproc-per-node and --nnodes must be at least 1")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise UserError(f"--node-rank {spec.node_rank} is not a node of --nnodes {spec.nnodes}")
    if spec.nnodes > 1 and (out is None or spec.master_addr is None):
        raise UserError(
            "--nnodes > 1 needs --master-addr (node 0's address) and --out DIR, the same folder on every "
            "node (shared storage, or gather the rank files into one folder afterwards)"
        )


def prepare_run_dir(spec: LaunchSpec, out: Path | None, cwd: Path) -> Path:
    """The run folder the ranks will share, made before torchrun starts (UserError if it cannot be)."""
    from opadvisor.profile.runner import check_output_parent, rank_file_names

    if spec.nnodes > 1 and out is not None and out.is_dir():
        # Every node writes into the same folder: refuse only what would overwrite this node's ranks.
        taken = [r for r in spec.node_ranks() if (out / rank_file_names(r)[0]).exists()]
        if taken:
            raise UserError(f"--out {out} already holds the profiles of rank(s) {_list(taken)}")
        return out
    check_output_parent(out, cwd)
    run_dir = out if out is not None else runs.state_dir(cwd) / "runs" / runs.new_run_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def launch(
    target: Target,
    args: list[str],
    spec: LaunchSpec,
    *,
    warmup: int,
    steps: int,
    run_to_end: bool = False,
    out: Path | None = None,
    memory: bool = False,
    activations: bool = True,
    calibrate: int = 3,
) -> DistOutcome:
    """Profile the target (checked by `opadvisor.profile.target`) with `args` on every rank through
    torchrun; how each rank ended, and their profiles."""
    check_spec(spec, out)
    run_dir = prepare_run_dir(spec, out, Path.cwd())
    failures = run_dir / f".launch.node{spec.node_rank}.json"
    command = [sys.executable, "-m", "opadvisor.profile._dist_launch", str(failures), *spec.torchrun_args()]
    command += ["-m", _MODULE, str(run_dir), "--warmup", str(warmup), "--steps", str(steps)]
    command += ["--calibrate", str(calibrate)]
    command += [*(["--run-to-end"] if run_to_end else []), *(["--memory"] if memory else [])]
    command += [] if activations else ["--no-activations"]
    if target.module is not None:
        command += ["--module", target.module, "--import-root", str(target.import_root)]
    command += [target.filename, "--", *args]
    code, interrupted = _run_launcher(command)
    outcome = collect(run_dir, spec, code, _read_json(failures) or {})
    failures.unlink(missing_ok=True)
    outcome.interrupted = interrupted
    if not outcome.profiles and not _other_nodes_in(run_dir, spec):
        _remove_run_dir(run_dir, spec)
        outcome.run_dir = None
    elif out is None and all(r.wrote_profile for r in outcome.ranks):
        runs.mark_latest(run_dir)
        outcome.marked_latest = True
    return outcome


def _run_launcher(command: list[str]) -> tuple[int, bool]:
    """Run torchrun to its end. Ctrl-C: one SIGTERM to torchrun (it stops the ranks), then wait for it."""
    proc = subprocess.Popen(command, start_new_session=True)
    interrupted = False
    while True:
        try:
            return proc.wait(timeout=_INTERRUPT_GRACE_S if interrupted else None), interrupted
        except KeyboardInterrupt:
            if interrupted:  # a second Ctrl-C: stop waiting for a clean end
                proc.kill()
            else:
                interrupted = True
                proc.send_signal(signal.SIGTERM)
        except subprocess.TimeoutExpired:
            proc.kill()


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def collect(run_dir: Path, spec: LaunchSpec, launcher_code: int, failures: dict) -> DistOutcome:
    """What this node's ranks reported in the run folder, torchrun's failures, and the profiles written."""
    from opadvisor.profile.runner import rank_file_names

    outcome = DistOutcome(run_dir, launcher_code)
    reported = {}
    for path in run_dir.glob(f"{STATUS_PREFIX}*.json"):
        data = _read_json(path)
        if data and isinstance(data.get("rank"), int) and data.get("node_rank") == spec.node_rank:
            reported[data["rank"]] = data
    # Ranks are numbered node by node: a rank that never wrote its status is still one of this node's.
    ranks = sorted(set(reported) | {int(r) for r in failures if r.isdigit()} | set(spec.node_ranks()))
    for rank in ranks:
        data = reported.get(rank, {})
        failure = failures.get(str(rank), {})
        report = RankReport(
            rank,
            status=data.get("status", "missing"),
            local_rank=data.get("local_rank", failure.get("local_rank")),
            host=data.get("host"),
            steps_seen=data.get("steps_seen") or 0,
            exit_code=data.get("exit_code"),
            error=data.get("error"),
            traceback=data.get("traceback"),
            ended_at=data.get("ended_at"),
            launcher_exit=failure.get("exit_code"),
            launcher_signal=failure.get("signal"),
        )
        profile_file = run_dir / rank_file_names(rank)[0]
        if profile_file.is_file():
            try:
                outcome.profiles.append(load_profile(profile_file))
                report.wrote_profile = True
            except ProfileFormatError:
                pass
        outcome.ranks.append(report)
    return outcome


def _other_nodes_in(run_dir: Path, spec: LaunchSpec) -> bool:
    """Does the folder hold other nodes' profiles (a shared multi-node --out)?"""
    from opadvisor.profile.runner import rank_file_names

    mine = {rank_file_names(r)[0] for r in spec.node_ranks()}
    return any(p.name not in mine for p in run_dir.glob("profile.rank*.json"))


def _remove_run_dir(run_dir: Path, spec: LaunchSpec) -> None:
    """Nothing was recorded: remove this node's status files and then the folder, if nothing else is in it."""
    for rank in spec.node_ranks():
        status_path(run_dir, rank).unlink(missing_ok=True)
    for leftover in run_dir.glob(".rank*.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        run_dir.rmdir()
    except OSError:
        pass  # other nodes' files, or a user's own


def _list(values) -> str:
    return ", ".join(str(v) for v in values)


# ---- words for the CLI --------------------------------------------------------------------------------


def describe_failure(outcome: DistOutcome, script: str) -> tuple[str | None, str]:
    """(the root-cause rank's traceback or None, one line naming the rank) for a failed multi-rank run."""
    kept = (
        f"; the steps recorded by rank(s) {_list(p.rank for p in outcome.profiles)} were kept in {outcome.run_dir}"
        if outcome.profiles
        else "; no rank wrote a profile"
    )
    launcher = f" (torchrun exited with {_code_words(outcome.launcher_code)})"
    if outcome.interrupted:
        return None, f"interrupted: the launcher stopped every rank{kept}{launcher}"
    cause = outcome.root_cause()
    if cause is None:
        return None, f"torchrun failed (see its output above){kept}{launcher}"
    others = [r for r in outcome.ranks if r.failed and r is not cause]
    then = f"; then {'; '.join(f'rank {r.rank} {_short_words(r)}' for r in others)}" if others else ""
    return cause.traceback, f"{_rank_words(cause, script)}{then}{kept}{launcher}"


def _rank_words(r: RankReport, script: str) -> str:
    after = f" after {r.steps_seen} step(s)"
    if r.status == "script_error":
        return f"{r.where()} raised {r.error or 'an exception'}{after} in {script}"
    if r.status == "script_exit":
        return f"{r.where()}: {script} called sys.exit({r.exit_code}){after}"
    if r.status == "opadvisor_error":
        return f"{r.where()}: opadvisor failed on this rank: {r.error}"
    if r.status == "terminated":
        return f"{r.where()} was stopped by the launcher{after}"
    how = f"killed by {r.launcher_signal}" if r.launcher_signal else f"exit code {r.launcher_exit}"
    if r.status == "running":
        return f"{r.where()} died ({how}){after if r.steps_seen else ''} without reporting"
    if r.launcher_exit is not None:
        return f"{r.where()} ended ({how}) before it could start the script"
    return f"{r.where()} never started (see torchrun's output above)"


def _short_words(r: RankReport) -> str:
    if r.status == "script_error":
        error = r.error or "an exception"
        if r.peer_failure:
            return f"failed because a peer went away ({error.split(':', 1)[0]})"
        return f"raised {error if len(error) <= 120 else error[:117] + '...'}"
    if r.status == "script_exit":
        return f"called sys.exit({r.exit_code})"
    if r.status == "terminated":
        return "was stopped by the launcher" + (
            " (it was blocked in C)" if "blocked" in (r.error or "") else ""
        )
    if r.status == "running":
        return f"died ({'killed by ' + r.launcher_signal if r.launcher_signal else 'no report'})"
    if r.status == "missing":
        return "never reported"
    return r.error or r.status


def _code_words(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


if __name__ == "__main__":
    # Run the imported module's rank_main, not this `__main__` copy: one RankTerminated class, one flag.
    from opadvisor.profile.distributed import rank_main as _rank_main

    sys.exit(_rank_main())
