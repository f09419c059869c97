"""opadvisor's window, recorded inside a process that something else drives (a Trainer, through a callback).

    rec = WindowRecorder(warmup=3, steps=5)   # out=None: .opadvisor/runs/<id>/ under the current folder
    rec.start()          # before training; does nothing (see `idle_reason`) under opadvisor profile/verify
    rec.step()           # at the end of every training step; True at the step that completes the window
    rec.stop()           # when training ends: writes what was recorded if the window did not complete
    rec.outcome          # the RunOutcome once a run was written (run_dir, profile, status)

The same session and run-writing code as `opadvisor profile` (session.py, runner.record_run), with
`step_source="callback"`: the framework's own step events end steps, never an exception, so training
goes on after the window (the callback may ask its framework to stop). The run folder is the one
`opadvisor profile` writes, so suggest, apply, verify, report and diff read it alike; its script is the
process's `__main__` file (a notebook has none: it is recorded as "<interactive>", and verify has
nothing to rerun).

Multi-process runs (torch.distributed initialised, world size > 1): every rank records the same window;
rank 0 names the run folder and tells the others (a broadcast), each writes profile.rank<N>.json and
trace.rank<N>.json.gz into it, as `opadvisor profile --nproc-per-node` does, and rank 0 marks it latest
once all have written (a barrier).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from opadvisor.profile import runs
from opadvisor.profile.runner import NO_SCRIPT, RunOutcome, check_output_parent, record_run
from opadvisor.profile.session import Session, SessionConfig, active
from opadvisor.profile.target import known_target
from opadvisor.profile.userframes import resolve_user_file, set_search_path

__all__ = ["WindowRecorder"]


def _say(message: str) -> None:
    print(f"opadvisor: {message}", file=sys.stderr, flush=True)


def _main_script() -> Path | None:
    """The user's script this process runs, None for a notebook, `python -c` or a tool's own main."""
    main = sys.modules.get("__main__")
    file = getattr(main, "__file__", None)
    user = resolve_user_file(file) if file else None  # ipykernel's or pytest's main is not the user's
    return Path(user) if user else None


def _distributed() -> tuple[int, int] | None:
    """(rank, world size) in a multi-process run, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


class WindowRecorder:
    def __init__(self, warmup: int = 3, steps: int = 5, out: str | Path | None = None):
        if warmup < 0 or steps < 1:
            raise ValueError(f"warmup must be >= 0 and steps >= 1 (got warmup={warmup}, steps={steps})")
        self.warmup, self.steps = warmup, steps
        self.out = Path(out) if out is not None else None
        self.cwd = Path.cwd()
        self.session: Session | None = None
        self.outcome: RunOutcome | None = None
        self.idle_reason: str | None = None
        self._done = False

    @property
    def recording(self) -> bool:
        return self.session is not None and not self._done

    def start(self) -> None:
        """Install the session (hooks, construction sites); the window opens after `warmup` steps."""
        if self.session is not None or self._done:
            return
        self.idle_reason = self._why_idle()
        if self.idle_reason is not None:
            self._done = True
            _say(f"the callback records nothing: {self.idle_reason}")
            return
        import torch

        if _distributed() is None:
            check_output_parent(self.out, self.cwd)  # fail now, before training, if it cannot be written
        config = SessionConfig(warmup=self.warmup, steps=self.steps, run_to_end=True, step_source="callback")
        config.cuda = torch.cuda.is_available()
        set_search_path(sys.path)
        self.session = Session(config)
        self.session.install()
        atexit.register(self._at_exit)

    @staticmethod
    def _why_idle() -> str | None:
        from opadvisor.verify.harness import CONFIG_ENV

        if active() is not None:
            return "`opadvisor profile` is recording this process already"
        if os.environ.get(CONFIG_ENV):
            return "the script runs under `opadvisor verify`"
        return None

    def step(self) -> bool:
        """A training step ended. True when this step completed the window (and the run was written)."""
        if not self.recording:
            return False
        assert self.session is not None
        self.session.callback_step()
        recording = self.session.recording
        if recording is not None and recording.complete:
            self._write("complete")
            return True
        return False

    def stop(self) -> RunOutcome | None:
        """Training ended: write what the window recorded (marked incomplete) and remove the hooks."""
        if self.recording:
            assert self.session is not None
            seen = self.session.steps_seen
            self._write("ended_early")
            if self.outcome is not None and self.outcome.run_dir is None and _is_rank0():
                _say(
                    f"training ended after {seen} step(s), before the window was recorded "
                    f"(warmup {self.warmup}, steps {self.steps}): nothing written"
                )
        return self.outcome

    def _at_exit(self) -> None:
        # training raised and never reached its end: keep what was recorded, as `opadvisor profile` does
        # (not in a multi-process run: the other ranks may be gone, and writing there needs them)
        if self.recording and _distributed() is None:
            self.stop()
        elif self.recording:
            assert self.session is not None
            self.session.finish()
            self.session.uninstall()
            self._done = True

    def _write(self, status: str) -> None:
        assert self.session is not None
        session, self._done = self.session, True
        recording = session.finish()
        session.uninstall()
        script = _main_script()
        argv = [str(script) if script else NO_SCRIPT, *sys.argv[1:]]
        target = known_target(str(script)) if script else None
        dist = _distributed()
        if dist is None:
            self.outcome = record_run(session, recording, status, target, argv, self.out, self.cwd)
        else:
            self.outcome = self._write_rank(session, recording, status, target, argv, dist)
        run_dir = self.outcome.run_dir
        if run_dir is not None and _is_rank0():
            recorded = len(self.outcome.profile.steps) if self.outcome.profile else 0
            shown = os.path.relpath(run_dir, self.cwd) if run_dir.is_relative_to(self.cwd) else str(run_dir)
            _say(
                f"recorded {recorded} step(s) after {self.warmup} warm-up into {shown}; next: opadvisor suggest"
            )

    def _write_rank(self, session, recording, status, target, argv, dist) -> RunOutcome:
        import torch.distributed as tdist

        rank, world = dist
        folder = [str(self._run_dir()) if rank == 0 else None]
        tdist.broadcast_object_list(folder, src=0)
        run_dir = Path(folder[0])
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (recording is not None and recording.steps):
            recording = None  # every rank still joins the barrier below
        outcome = record_run(session, recording, status, target, argv, run_dir, self.cwd, (rank, world))
        tdist.barrier()
        if outcome.run_dir is None:
            return outcome
        if rank == 0 and self.out is None:
            runs.mark_latest(run_dir)
        return outcome

    def _run_dir(self) -> Path:
        if self.out is not None:
            return self.out.resolve()
        return (runs.state_dir(self.cwd) / "runs" / runs.new_run_id()).resolve()


def _is_rank0() -> bool:
    dist = _distributed()
    return dist is None or dist[0] == 0
