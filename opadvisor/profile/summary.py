"""The short summary `opadvisor profile` prints at the end: device, steps, step time, GPU busy, top ops,
and memory (the step's CUDA peak against the device, and who holds the activations saved for backward)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from opadvisor.profile.memory import Holder, activation_holders, fmt_bytes, saved_per_step
from opadvisor.profile.model import Profile


@dataclass
class OpTotal:
    name: str
    calls_per_step: float
    ms_per_step: float


@dataclass
class Summary:
    device: str
    steps: int
    detection: str
    median_step_ms: float | None
    plain_step_ms: float | None  # the same step timed without the profiler (calibration)
    gpu_busy_share: float | None
    top_ops: list[OpTotal]
    time_basis: str  # "GPU" or "CPU"
    memory: str | None = None  # the memory line (`memory_text`), None when nothing was measured

    def render(self, run_dir: Path | None):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        head = Text()
        head.append("Profiled ", style="bold")
        head.append(f"{self.steps} step(s) on {self.device}")
        if self.detection != "optimizer_hook":
            head.append(f" (steps: {self.detection.replace('_', ' ')})")
        if self.median_step_ms is not None:
            head.append(f", median step {self.median_step_ms:.1f} ms")
            if self.plain_step_ms is not None:
                head.append(f" ({self.plain_step_ms:.1f} ms without the profiler)")
        if self.gpu_busy_share is not None:
            head.append(f", GPU busy {self.gpu_busy_share:.0%}")
        table = Table(title=f"Top ops by {self.time_basis} time", title_justify="left", box=None)
        table.add_column("op")
        table.add_column("calls/step", justify="right")
        table.add_column("ms/step", justify="right")
        for op in self.top_ops:
            table.add_row(op.name, f"{op.calls_per_step:.0f}", f"{op.ms_per_step:.2f}")
        tail = Text(f"Run written to {run_dir}\nNext: opadvisor suggest" if run_dir else "")
        if self.memory is None:
            return Group(head, table, tail)
        return Group(head, table, Text(self.memory), tail)


def memory_text(profile: Profile, holders: int = 3) -> str | None:
    """ "Memory: peak 10.2 GiB allocated, 11.0 GiB reserved of 80 GiB (14%); saved for backward
    2.6 GiB/step, most by blocks.0-11 (Block x12) 2.4 GiB, ..." (None when nothing was measured)."""
    allocated, reserved = profile.peak_memory()
    device = profile.environment.gpu_memory_bytes
    parts = []
    if allocated is not None:
        peak = f"peak {fmt_bytes(allocated)} allocated"
        if reserved is not None:
            peak += f", {fmt_bytes(reserved)} reserved"
            if device:
                peak += f" of {fmt_bytes(device)} ({reserved / device:.0%})"
        parts.append(peak)
    saved = saved_per_step(profile)
    if saved is not None:
        text = f"saved for backward {fmt_bytes(saved)}/step"
        top = activation_holders(profile)[:holders]
        if top:
            text += ", most by " + ", ".join(_holder_words(h) for h in top)
        parts.append(text)
    return "Memory: " + "; ".join(parts) if parts else None


def _holder_words(h: Holder) -> str:
    cls = (h.module_class or "").rpartition(".")[2]
    what = f"{cls} x{len(h.modules)}" if h.repeated else cls
    return f"{h.name}{f' ({what})' if what else ''} {fmt_bytes(h.saved_bytes)}"


def summarize(profile: Profile, top: int = 8) -> Summary:
    steps = max(len(profile.steps), 1)
    gpu = profile.has_gpu
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for op in profile.ops:
        if op.parent is not None or op.step is None:
            continue
        name = op.name.split(": ", 1)[-1] if op.is_backward else op.name
        totals[name] += (op.gpu_time_us or 0.0) if gpu else op.duration_us
        calls[name] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    busy = None
    if gpu and profile.steps:
        span = sum(s.gpu_span_ms or 0.0 for s in profile.steps)
        busy = sum(s.gpu_busy_ms or 0.0 for s in profile.steps) / span if span else None
    return Summary(
        device=profile.environment.gpu_name or "CPU",
        steps=len(profile.steps),
        detection=profile.step_detection,
        median_step_ms=profile.median_step_ms(),
        plain_step_ms=profile.plain_step_ms(),
        gpu_busy_share=busy,
        top_ops=[OpTotal(n, calls[n] / steps, t / steps / 1000.0) for n, t in ranked],
        time_basis="GPU" if gpu else "CPU",
        memory=memory_text(profile),
    )
