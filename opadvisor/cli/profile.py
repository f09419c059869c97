"""`opadvisor profile`: measure a training script without editing it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from opadvisor.profile.target import Target

from opadvisor.cli.common import EXIT_USER_ERROR, fail, note, user_errors, warn
from opadvisor.errors import UserError


def register(app: typer.Typer) -> None:
    app.command(
        "profile",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    )(profile)


ScriptArgument = Annotated[
    str | None,
    typer.Argument(
        metavar="SCRIPT",
        help="The training script to run (its own arguments go after --).",
        show_default=False,
    ),
]
ModuleOption = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--module",
        help="Run a module as `python -m` does (package.train: from this folder, with its package), "
        "instead of SCRIPT; its arguments go after --.",
    ),
]
StepsOption = Annotated[int, typer.Option(help="Training steps to record.", min=1)]
WarmupOption = Annotated[
    int, typer.Option(help="Steps to run before recording (compilation, autotuning, caches).", min=0)
]
CalibrateOption = Annotated[
    int,
    typer.Option(
        help="Warm-up steps to time without the profiler (the last ones, never the first), so that "
        "suggest can tell the profiler's own cost from the step's; 0 skips it.",
        min=0,
    ),
]
OutOption = Annotated[
    Path | None,
    typer.Option(help="Write the run to this folder (new or empty) instead of .opadvisor/runs/<id>."),
]
RunToEndOption = Annotated[
    bool,
    typer.Option("--run-to-end", help="Let the script finish instead of stopping it after the window."),
]
WindowAfterOption = Annotated[
    float,
    typer.Option(help="Scripts that never step: start a time window after this many seconds.", min=0),
]
WindowOption = Annotated[float, typer.Option(help="Scripts that never step: seconds to record.", min=0.1)]
MemoryOption = Annotated[
    bool,
    typer.Option(
        "--memory",
        help="Ask for memory advice: suggest reports the modules holding the most activation memory, "
        "with the checkpointing fix, whatever the step's peak.",
    ),
]
ActivationsOption = Annotated[
    bool,
    typer.Option(
        "--activations/--no-activations",
        help="Measure the activation memory each module saves for backward (saved-tensor hooks).",
    ),
]
EagerOption = Annotated[
    bool,
    typer.Option(
        "--eager",
        help="Switch torch.compile off for the run, so the code it compiles runs op by op and its "
        "patterns can be found and fixed (step times are then eager times).",
    ),
]
# issue 9: multi-process runs through torchrun (opadvisor/profile/distributed.py, opadvisor/cli/_distributed.py)
NprocPerNodeOption = Annotated[
    int | None, typer.Option(help="Launch N processes (ranks) through torchrun and profile each.", min=1)
]
NnodesOption = Annotated[
    int, typer.Option(help="Nodes of a multi-node run (start opadvisor on each).", min=1)
]
NodeRankOption = Annotated[int, typer.Option(help="This node's index, 0 to --nnodes - 1.", min=0)]
MasterAddrOption = Annotated[str | None, typer.Option(help="Multi-node: address of node 0.")]
MasterPortOption = Annotated[
    int | None, typer.Option(help="Multi-node: port on node 0 (torchrun's default 29500).")
]


@user_errors
def profile(
    ctx: typer.Context,
    script: ScriptArgument = None,
    module: ModuleOption = None,
    steps: StepsOption = 5,
    warmup: WarmupOption = 3,
    calibrate: CalibrateOption = 3,
    out: OutOption = None,
    run_to_end: RunToEndOption = False,
    window_after: WindowAfterOption = 5.0,
    window: WindowOption = 2.0,
    memory: MemoryOption = False,
    activations: ActivationsOption = True,
    eager: EagerOption = False,
    nproc_per_node: NprocPerNodeOption = None,
    nnodes: NnodesOption = 1,
    node_rank: NodeRankOption = 0,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
) -> None:
    """Run SCRIPT (or -m MODULE) under torch.profiler for a few steps, write the run, and stop the script.

    Steps are found by themselves: each optimizer.step() ends one (call opadvisor.step() in loops without
    a torch optimizer). The last --calibrate warm-up steps are timed without the profiler (the plain step
    time, which suggest shows beside the profiled one). After --warmup steps, --steps steps are recorded
    with shapes, exact source lines and (on CUDA) the kernels each op launched; then the run is written
    to .opadvisor/runs/<id>/
    (profile.json and trace.json.gz, which opens in Perfetto) and the script is stopped. A script inside
    a package that imports relatively runs as `python -m package.script` would.

    A model under torch.compile runs its ops inside compiled graphs, which the rules cannot see into
    (`opadvisor suggest` says how much of the step that was): --eager switches torch.compile off for the
    run, so the same code is recorded op by op and `opadvisor apply` can fix it.

    Examples:

    \b
      opadvisor profile train.py --steps 5 -- --batch-size 32
      opadvisor profile -m mypackage.train -- --batch-size 32
    """
    target, args = _target(script, module, list(ctx.args))
    settings = {
        "warmup": warmup,
        "steps": steps,
        "run_to_end": run_to_end,
        "calibrate": calibrate,
        "activations": activations,
    }
    if nproc_per_node is not None or nnodes > 1:  # issue 9: every rank of a torchrun launch
        launch = (nproc_per_node or 1, nnodes, node_rank, master_addr, master_port)
        _profile_ranks(target, args, launch, eager=eager, out=out, memory=memory, **settings)
        return
    _profile_one(
        target, args, out, window_after=window_after, window=window, memory=memory, eager=eager, **settings
    )


def _profile_ranks(
    target: Target, args: list[str], launch: tuple, *, eager: bool, out: Path | None, memory: bool, **settings
) -> None:
    """Every rank of a torchrun launch (`opadvisor.cli._distributed`); `launch` is LaunchSpec's fields."""
    if eager:
        raise UserError("--eager is not supported with --nproc-per-node/--nnodes yet; profile one process")
    from opadvisor.cli._distributed import profile_ranks
    from opadvisor.profile.distributed import LaunchSpec

    profile_ranks(target, args, LaunchSpec(*launch), out=out, memory=memory, **settings)


def _profile_one(
    target: Target,
    args: list[str],
    out: Path | None,
    *,
    window_after: float,
    window: float,
    memory: bool,
    eager: bool,
    **settings,
) -> None:
    """One process: run the script under the profiler with a progress bar, then report the outcome."""
    from opadvisor.profile.runner import run_script
    from opadvisor.profile.session import SessionConfig

    config = SessionConfig(
        window_after_seconds=window_after,
        window_seconds=window,
        memory_requested=memory,
        eager=eager,
        **settings,
    )
    with _Progress(config.steps) as progress:
        outcome = run_script(target, args, config, out=out, on_progress=progress.update)
    for message in outcome.warnings:
        warn(message)
    _report(outcome, config, target.shown)


def _target(script: str | None, module: str | None, args: list[str]) -> tuple[Target, list[str]]:
    """(what to run, its arguments), checked before torch is imported. With -m, a positional argument
    is the module's first argument, as `python -m module args` has it."""
    from opadvisor.errors import UserError
    from opadvisor.profile.target import module_target, script_target

    if module is not None:
        return module_target(module), ([script] if script is not None else []) + args
    if script is None:
        raise UserError("name the script to profile (opadvisor profile train.py), or a module with -m")
    target = script_target(Path(script))
    if target.module is not None:
        note(
            f"{script} is in package {target.module.rpartition('.')[0]} and imports relatively: "
            f"running it as `python -m {target.module}` from {target.import_root}"
        )
    return target, args


def _report(outcome, config, script: str) -> None:
    if outcome.status == "complete":
        _print_summary(outcome)
        return
    if outcome.status == "no_steps":
        raise fail(
            f"no steps detected in {script}: it never called optimizer.step() (nor opadvisor.step()), "
            "and no time window was recorded"
        )
    if outcome.status == "script_error":
        sys.stderr.write(outcome.script_traceback or "")
    what = {
        "script_error": "raised an exception",
        "script_exit": f"called sys.exit({outcome.exit_code})",
        "interrupted": "was interrupted (Ctrl-C)",
    }.get(outcome.status, "ended")
    raise fail(f"{script} {what} after {outcome.steps_seen} step(s){_kept(outcome, config)}")


def _kept(outcome, config) -> str:
    """What the run kept of an incomplete window, and the --warmup that records more (issue 30)."""
    recorded = len(outcome.profile.steps) if outcome.profile else 0
    seen, warmup = outcome.steps_seen, config.warmup
    if recorded:
        return (
            f", before the window was complete: recorded {recorded} of {config.steps} (--warmup {warmup} --steps {config.steps}); the "
            f"{recorded} recorded step(s) were kept in {outcome.run_dir}, marked incomplete"
        )
    if seen == 0:
        return ", in its first step: nothing to record; fix the script, then profile again"
    # record the steps it did run, the first (initialisation) left out where there are two or more
    lower = max(0, min(seen - 1, warmup - 1))
    kept = f"; the run was kept in {outcome.run_dir}, marked incomplete" if outcome.run_dir else ""
    return (
        f", in the warm-up (--warmup {warmup}): no step was recorded{kept}; profile again with "
        f"--warmup {lower} to record {seen - lower} step(s)"
    )


def _print_summary(outcome) -> None:
    from opadvisor.profile.summary import summarize

    summary = summarize(outcome.profile)
    from rich.console import Console

    console = Console(stderr=False, highlight=False)
    console.print(summary.render(outcome.run_dir))


class _Progress:
    """A rich progress bar on stderr: steps recorded / total (the script's output scrolls above it)."""

    def __init__(self, total: int):
        self.total = total
        self._progress = None
        self._task = None

    def __enter__(self) -> _Progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]opadvisor[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task("waiting for the first steps", total=self.total)
        self._progress.start()
        return self

    def update(self, recorded: int, total: int) -> None:
        self._progress.update(self._task, completed=recorded, description="recording steps")

    def __exit__(self, *exc) -> None:
        self._progress.stop()


__all__ = ["register", "EXIT_USER_ERROR"]
