"""What `opadvisor profile --nproc-per-node N` says: the launch, each rank's outcome, the cross-rank summary.

The rendering half of multi-process profiling; `opadvisor/profile/distributed.py` does the work.
"""

from __future__ import annotations

import sys
from pathlib import Path

from opadvisor.cli.common import fail, warn
from opadvisor.profile.distributed import DistOutcome, LaunchSpec, describe_failure, launch
from opadvisor.profile.target import Target


def profile_ranks(
    target: Target,
    args: list[str],
    spec: LaunchSpec,
    *,
    warmup: int,
    steps: int,
    run_to_end: bool,
    out: Path | None,
    memory: bool = False,
    activations: bool = True,
    calibrate: int = 3,
) -> None:
    """Launch, wait, report: exit 0 with a summary, or one `opadvisor: error:` line naming the rank and exit 2."""
    world = spec.nproc_per_node * spec.nnodes
    node = f" (node {spec.node_rank} of {spec.nnodes})" if spec.nnodes > 1 else ""
    print(f"opadvisor: launching {world} rank(s){node} through torchrun", file=sys.stderr, flush=True)
    outcome = launch(
        target,
        args,
        spec,
        warmup=warmup,
        steps=steps,
        run_to_end=run_to_end,
        out=out,
        memory=memory,
        activations=activations,
        calibrate=calibrate,
    )
    if not outcome.ok:
        trace, message = describe_failure(outcome, target.shown)
        if trace:
            sys.stderr.write(trace if trace.endswith("\n") else trace + "\n")
        raise fail(message)
    _report_success(outcome, target.shown, warmup, steps)


def _report_success(outcome: DistOutcome, script: str, warmup: int, steps: int) -> None:
    if not outcome.profiles:
        never = [r for r in outcome.ranks if r.status == "no_steps"]
        if never:
            raise fail(
                f"no steps detected in {script} on rank(s) {', '.join(str(r.rank) for r in never)}: it never "
                "called optimizer.step() (nor opadvisor.step()); multi-rank runs record steps only"
            )
        seen = max((r.steps_seen for r in outcome.ranks), default=0)
        raise fail(
            f"{script} ended after {seen} step(s), before the window started (--warmup {warmup}): "
            "lower --warmup or let the script run longer"
        )
    missing = [r.rank for r in outcome.ranks if not r.wrote_profile]
    if missing:
        warn(f"rank(s) {', '.join(map(str, missing))} recorded no whole step; their profiles are missing")
    short = [p for p in outcome.profiles if len(p.steps) < steps]
    if short:  # an incomplete run exits 2, as in a single process (the run is kept, marked incomplete)
        raise fail(
            f"{script} ended early: recorded {min(len(p.steps) for p in short)} of {steps} step(s) "
            f"(--warmup {warmup} --steps {steps}); the run was kept in {outcome.run_dir}, marked incomplete"
        )
    _print_summary(outcome)


def _print_summary(outcome: DistOutcome) -> None:
    from rich.console import Console, Group
    from rich.text import Text

    from opadvisor.profile.summary import summarize
    from opadvisor.ranks import cross_rank

    report = cross_rank.analyse(outcome.profiles)
    first = outcome.profiles[0]
    latest = outcome.marked_latest
    tail = f"Run written to {outcome.run_dir}{'' if latest else ' (not marked latest)'}"
    tail += f"\nNext: opadvisor suggest{'' if latest else ' ' + str(outcome.run_dir)}"
    Console(highlight=False).print(
        Group(
            cross_rank.render(report, brief=True),
            Text(f"\nRank {first.rank}:", style="bold"),
            summarize(first).render(None),
            Text(tail),
        )
    )
