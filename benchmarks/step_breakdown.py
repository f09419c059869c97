"""Where one training step's time goes on the GPU: a light torch.profiler pass over a few steps.

    python benchmarks/step_breakdown.py SCRIPT [--steps 5 --warmup 5 --top 25] -- SCRIPT_ARGS

Unlike `opadvisor profile` (which records Python stacks and shapes, and so inflates the host time of each op),
this records only ops and kernels, so it tells whether a step is bound by the GPU or by the host:

- per step: wall time (between optimizer steps), GPU busy time (union of kernel intervals) and the rest
  (GPU idle: the host did not keep the queue full, or a sync waited);
- the ops that took the most GPU time (self device time of each op name), and the kernels.

The script runs in this process (runpy, its own argv); each `optimizer.step()` ends a step, and the script is
stopped after the recorded ones. A diagnostic for benchmarks/RESULTS.md, not part of opadvisor.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile


class _Stop(BaseException):
    """Raised from the step hook once the recorded steps are done (BaseException: scripts catch Exception)."""


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1000.0


def _device_time(avg) -> float:
    return getattr(avg, "self_device_time_total", None) or getattr(avg, "self_cuda_time_total", 0.0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("script", type=Path)
    ap.add_argument("--steps", type=int, default=5, help="steps to record")
    ap.add_argument("--warmup", type=int, default=5, help="steps before recording")
    ap.add_argument("--top", type=int, default=25, help="ops and kernels listed")
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    ap.add_argument(
        "--mode",
        choices=["profile", "time", "host"],
        default="profile",
        help="profile: GPU ops and kernels (torch.profiler); time: step times only, nothing recorded; "
        "host: where the host's time goes (cProfile of the recorded steps)",
    )
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = ap.parse_args(argv[:cut])
    script_args = argv[cut + 1 :]

    if opts.mode == "profile":
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    elif opts.mode == "host":
        prof = cProfile.Profile()
        prof.start, prof.stop = prof.enable, prof.disable
    else:
        prof = None
    marks: list[float] = []  # perf_counter at the start of the window and the end of each recorded step
    count = 0

    def after_step(opt, args, kwargs) -> None:
        nonlocal count
        count += 1
        if count == opts.warmup:
            _sync()
            if prof is not None:
                prof.start()
            marks.append(time.perf_counter())
        elif count > opts.warmup:
            _sync()
            marks.append(time.perf_counter())
            if count == opts.warmup + opts.steps:
                if prof is not None:
                    prof.stop()
                raise _Stop

    register_optimizer_step_post_hook(after_step)
    sys.argv = [str(opts.script), *script_args]
    sys.path.insert(0, str(opts.script.parent.resolve()))
    try:
        runpy.run_path(str(opts.script), run_name="__main__")
    except _Stop:
        pass
    if len(marks) < 2:
        print(
            f"the script ended after {count} optimizer steps; need {opts.warmup + opts.steps}",
            file=sys.stderr,
        )
        return 2

    walls = [(b - a) * 1000 for a, b in zip(marks, marks[1:], strict=False)]
    wall = statistics.median(walls)
    head = [
        f"### {opts.script.name} {' '.join(script_args)} ({opts.mode})",
        "",
        f"- device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}, "
        f"torch {torch.__version__}",
        f"- steps recorded: {len(walls)} (after {opts.warmup}); wall per step (synchronised): median "
        f"{wall:.2f} ms, min {min(walls):.2f}, max {max(walls):.2f}",
    ]
    if opts.mode == "time":
        return _emit(head, opts.out)
    if opts.mode == "host":
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(opts.top)
        return _emit([*head, "", "```", buf.getvalue().strip(), "```"], opts.out)
    return _emit([*head, *gpu_tables(prof, walls, opts.top)], opts.out)


def _emit(lines: list[str], out: Path | None) -> int:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text, encoding="utf-8")
    return 0


def gpu_tables(prof, walls: list[float], top: int) -> list[str]:
    """GPU busy share, then the ops and the kernels that took the most GPU time per step."""
    wall = statistics.median(walls)
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not (getattr(e, "is_user_annotation", False) or "#" in e.name)  # annotations: not kernels
    ]
    busy = _union_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / len(walls)
    total = sum(e.time_range.elapsed_us() for e in kernels) / 1000 / len(walls)
    lines = [
        f"- GPU busy per step (union of kernels): {busy:.2f} ms = {100 * busy / wall:.0f}% of the wall time "
        f"(light profiler on: ops and kernels, no stacks); kernel durations summed: {total:.2f} ms",
        f"- kernels per step: {len(kernels) / len(walls):.0f}",
        "",
        "| op (self GPU time) | calls/step | GPU ms/step | share of busy |",
        "|---|---:|---:|---:|",
    ]
    ops = [
        a
        for a in prof.key_averages()
        if _device_time(a) > 0 and a.device_type != torch.autograd.DeviceType.CUDA
    ]
    ops.sort(key=_device_time, reverse=True)
    for a in ops[:top]:
        ms = _device_time(a) / 1000 / len(walls)
        lines.append(f"| `{a.key}` | {a.count / len(walls):.0f} | {ms:.3f} | {100 * ms / busy:.1f}% |")
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.time_range.elapsed_us())
    lines += ["", "| kernel | launches/step | GPU ms/step | share of busy |", "|---|---:|---:|---:|"]
    for name, durs in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]:
        ms = sum(durs) / 1000 / len(walls)
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{short}` | {len(durs) / len(walls):.0f} | {ms:.3f} | {100 * ms / busy:.1f}% |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
