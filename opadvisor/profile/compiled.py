"""What torch.compile did while the script ran: every frame dynamo compiled, its graph breaks, its recompiles.

Read from PyTorch's structured trace (the records `TORCH_TRACE` and tlparse read): a handler on its logger
(`torch.__trace`) receives each record as plain data, `record.metadata` and `record.payload`. The records
used, by their key (torch 2.11 - 2.13 word them alike):

    "str"                  an interned file name: [path, index]; later records name files by index
    "dynamo_start"         a frame's compilation starts (frame_id, frame_compile_id; its stack)
    artifact "dynamo_graph_break_reason"
                           the payload's first line is "Graph break in user code at FILE:LINE", then
                           "Graph Break Reason: ..." and dynamo's explanation
    artifact "recompile_reasons"
                           the guard failures that made dynamo compile a frame again (a string or a list)
    "compilation_metrics"  the compile's summary: co_name, co_filename, co_firstlineno,
                           entire_frame_compile_time_s, graph_op_count, fail_type / fail_reason (dynamo gave
                           up on the frame, e.g. its recompile limit was reached: it then runs eagerly)

Only the metadata and short payloads are kept (a frame's break reason, its guard failures); graphs and
generated code are dropped as they arrive. Torch computes every record's payload once a handler is
attached, which adds to compile time (a few percent of a compile); the rest of the step is untouched.
The records become `CompiledFrame`s of the profile (opadvisor/profile/model.py); the rules `graph_break`
and `recompile` read them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opadvisor.profile.model import CompiledFrame
from opadvisor.profile.userframes import resolve_user_file

# The profiler's names for what a compiled frame runs: the region of one call of a compiled frame (with
# its dynamo frame/compile id after ": "), the guard check before it, the graph itself (autograd's
# Function), and the bookkeeping around the graph.
REGION_PREFIX = "Torch-Compiled Region"
CACHE_LOOKUP = "TorchDynamo Cache Lookup"
GRAPH_FUNCTION = "CompiledFunction"
BOOKKEEPING = frozenset(
    {
        "Pregraph bytecode",
        "AOTDispatcher Runtime Wrapper Prologue",
        "AOTDispatcher Runtime Wrapper Epilogue",
        CACHE_LOOKUP,
    }
)
TRACE_LOGGER = "torch.__trace"  # torch._logging's structured trace: logging.getLogger of this name
OWN_DIR = str(Path(__file__).resolve().parent) + os.sep  # this package: the session's hooks
_BREAK_AT = re.compile(r"^Graph break(?: \(user stack suppressed[^)]*\))? in user code at (.+):(\d+)\s*$")
_REASON = re.compile(r"^Graph Break Reason:\s*(.*)$")
MAX_TEXT = 2000  # characters kept of a reason or an explanation


class CompileRecorder:
    """A logging handler on torch's structured trace, from the script's start to its end."""

    def __init__(self, current_step: Callable[[], int]):
        self.current_step = current_step
        self.frames: list[CompiledFrame] = []
        self._open: dict[tuple[Any, Any], CompiledFrame] = {}
        self._strings: dict[int, str] = {}
        self._handler: _Handler | None = None
        self._saved_level: int | None = None
        self.errors: list[str] = []

    def install(self) -> Callable[[], None]:
        """Start listening; returns the function that stops it."""
        logger = logging.getLogger(TRACE_LOGGER)
        self._handler = _Handler(self)
        self._saved_level = logger.level
        logger.setLevel(logging.DEBUG)  # the trace logs at DEBUG and never propagates
        logger.addHandler(self._handler)
        return self.uninstall

    def uninstall(self) -> None:
        logger = logging.getLogger(TRACE_LOGGER)
        if self._handler is not None:
            logger.removeHandler(self._handler)
            self._handler = None
        if self._saved_level is not None:
            logger.setLevel(self._saved_level)
            self._saved_level = None

    # ---- records ------------------------------------------------------------------------------------
    def on_record(self, metadata: dict[str, Any], payload: Any) -> None:
        if "str" in metadata:
            self._intern(metadata["str"])
        elif "dynamo_start" in metadata:
            self._frame_of(metadata)
        elif "artifact" in metadata:
            self._artifact(metadata, payload)
        elif "compilation_metrics" in metadata:
            self._metrics(metadata)

    def _intern(self, value: Any) -> None:
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int):
            self._strings[value[1]] = str(value[0])

    def _frame_of(self, metadata: dict[str, Any]) -> CompiledFrame:
        key = (metadata.get("frame_id"), metadata.get("frame_compile_id"))
        frame = self._open.get(key)
        if frame is None:
            frame = CompiledFrame(compile_id=f"{key[0]}/{key[1]}", step=self.current_step())
            self._open[key] = frame
            self.frames.append(frame)
        return frame

    def _artifact(self, metadata: dict[str, Any], payload: Any) -> None:
        name = (metadata.get("artifact") or {}).get("name")
        if name == "dynamo_graph_break_reason":
            _read_break(self._frame_of(metadata), payload)
        elif name == "recompile_reasons":
            frame = self._frame_of(metadata)
            reasons = payload if isinstance(payload, list) else [payload]
            frame.recompile_reasons = [_short(str(r)) for r in reasons if r]

    def _metrics(self, metadata: dict[str, Any]) -> None:
        metrics = metadata.get("compilation_metrics") or {}
        frame = self._frame_of(metadata)
        if str(metrics.get("co_filename") or "").startswith(OWN_DIR):
            # the session's own module hooks, which dynamo compiles around a compiled module's call: an
            # artifact of profiling, not the user's code
            self.frames.remove(frame)
            return
        frame.function = str(metrics.get("co_name") or frame.function)
        file = metrics.get("co_filename")
        frame.file = (resolve_user_file(file) or file) if isinstance(file, str) else None
        frame.line = _int(metrics.get("co_firstlineno"))
        frame.compile_s = _float(metrics.get("entire_frame_compile_time_s"))
        frame.graph_ops = _int(metrics.get("graph_op_count"))
        if metrics.get("fail_type"):
            frame.failed = _short(f"{metrics.get('fail_type')}: {metrics.get('fail_reason') or ''}".strip())
        if frame.break_reason is None and metrics.get("restart_reasons"):
            # a break whose reason artifact torch did not emit: the restart reason says why, not where
            frame.break_reason = _first_line(str(metrics["restart_reasons"][0]))


class _Handler(logging.Handler):
    def __init__(self, recorder: CompileRecorder):
        super().__init__(level=logging.DEBUG)
        self.recorder = recorder

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict):
            return
        try:
            self.recorder.on_record(metadata, getattr(record, "payload", None))
        except Exception as exc:  # a record we cannot read must never break the user's compile
            if len(self.recorder.errors) < 5:
                self.recorder.errors.append(f"{type(exc).__name__}: {exc}")


def compile_structure(name: str) -> bool:
    """Whether an op is part of how a compiled frame runs (kept at any depth: a graph break's cost)."""
    return name.startswith(REGION_PREFIX) or name == GRAPH_FUNCTION or name in BOOKKEEPING


def _read_break(frame: CompiledFrame, payload: Any) -> None:
    """Dynamo's graph-break text: where (its first line), why (the reason line) and its explanation."""
    lines = str(payload or "").splitlines()
    if not lines:
        return
    where = _BREAK_AT.match(lines[0].strip())
    if where:
        file = where.group(1)
        frame.break_file = resolve_user_file(file) or file
        frame.break_line = int(where.group(2))
    body = lines[1:]
    for i, ln in enumerate(body):
        reason = _REASON.match(ln.strip())
        if reason:
            # "Encountered graph break when attempting to trace CALL: ..." then the gb_type on the next line
            rest = [r.strip() for r in body[i + 1 :] if r.strip()]
            frame.break_reason = _short(
                rest[0] if rest and reason.group(1).startswith("Encountered") else reason.group(1)
            )
            frame.break_explanation = _short(_explanation(body[i + 1 :]))
            return
    frame.break_reason = _short(lines[1].strip() if len(lines) > 1 else lines[0])


def _explanation(lines: list[str]) -> str:
    """The "Explanation:" paragraph of dynamo's text, else its first non-empty lines."""
    for i, ln in enumerate(lines):
        if ln.strip().startswith("Explanation:"):
            out = [ln.strip().removeprefix("Explanation:").strip()]
            for more in lines[i + 1 :]:
                if not more.strip() or more.strip().startswith(("Hint:", "Developer debug context:")):
                    break
                out.append(more.strip())
            return " ".join(out)
    return " ".join(ln.strip() for ln in lines[:3] if ln.strip())


def _first_line(text: str) -> str:
    return _short(text.strip().splitlines()[0] if text.strip() else "")


def _short(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


__all__ = [
    "BOOKKEEPING",
    "CACHE_LOOKUP",
    "GRAPH_FUNCTION",
    "REGION_PREFIX",
    "TRACE_LOGGER",
    "CompileRecorder",
    "compile_structure",
]
