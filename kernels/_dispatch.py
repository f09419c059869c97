"""The dispatch record (which implementation each fused call ran) and the one-time fallback warnings.

`dispatch_counts()` maps an op ("masked_softmax", "bias_dropout_add", "cross_entropy", "padded_linear",
"dropout", "quick_gelu", "silu_mul", "rms_norm", "rotary_embedding", "linear_cross_entropy", "disentangled_bias", "cell_sequence") to
its paths and their call counts:

- "kernel": the fused implementation ran (a Triton kernel, compiled or interpreted; for `padded_linear`, the
  matrix product on padded sizes; for `cell_sequence`, the fused recurrence `nn.LSTM` runs);
- "chain": the plain PyTorch chain, by design: a CUDA tensor under the op's size threshold, an aligned
  `padded_linear`, or a call traced by torch.compile where the op traces its chain;
- "reference": the PyTorch reference, where no kernel applies (CPU tensors without Triton's interpreter,
  no Triton, a dtype, layout or argument the kernels do not cover).

Recording is a dict increment. Python-level: code that runs without Python per call is recorded when its
Python ran, once per trace for torch.compile and once per capture for a CUDA graph (replays run no Python).

Every fallback that is not the documented size dispatch (Triton missing on CUDA, a dtype or argument the
kernels do not cover, a layout that needs a copy) warns once per op and reason (`warn_fallback`).
"""

from __future__ import annotations

import os
import sys
import warnings

KERNEL = "kernel"
CHAIN = "chain"
REFERENCE = "reference"

_COUNTS: dict[str, dict[str, int]] = {}
_WARNED: set[tuple[str, str]] = set()


def record(op: str, path: str) -> None:
    """Count one call of `op` that took `path`."""
    paths = _COUNTS.get(op)
    if paths is None:
        paths = _COUNTS[op] = {}
    paths[path] = paths.get(path, 0) + 1


def dispatch_counts() -> dict[str, dict[str, int]]:
    """{op: {path: calls}} since the process started or the last `reset_dispatch_counts()` (a copy)."""
    return {op: dict(paths) for op, paths in _COUNTS.items()}


def reset_dispatch_counts() -> None:
    """Forget the calls recorded so far (the fallback warnings already given stay given)."""
    _COUNTS.clear()


def record_reference(op: str, reason: str | None) -> None:
    """Count a call of `op` that ran its PyTorch reference; warn once when `reason` says it is a fallback."""
    record(op, REFERENCE)
    if reason is not None:
        warn_fallback(op, reason)


def warn_fallback(op: str, reason: str) -> None:
    """Warn once per (op, reason) that `op` did not run its kernel, and why."""
    if (op, reason) in _WARNED:
        return
    _WARNED.add((op, reason))
    warnings.warn(f"opadvisor.kernels.{op}: {reason}", RuntimeWarning, stacklevel=_caller_level())


# Frames a warning skips to reach the user's call: this package's, and autograd's between them.
_INNER = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.join("torch", "autograd") + os.sep)


def _caller_level() -> int:
    """The stacklevel of the innermost frame outside this package (the user's call, for the warning)."""
    level, frame = 2, sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _INNER):
        frame, level = frame.f_back, level + 1
    return level


# Under torch.compile both run while dynamo traces the call, not in the compiled code: dynamo would otherwise
# replay the dict update on every call with the count it saw as a constant (a guard that fails each call, so
# a recompile each call) and break the graph at `warnings.warn`. This is the attribute that
# `torch.compiler.assume_constant_result` sets; setting it directly avoids importing torch._dynamo (which
# imports Triton and so fixes its interpret mode) when the kernels are imported. tests/kernels test both.
record._dynamo_marked_constant = True  # type: ignore[attr-defined]
warn_fallback._dynamo_marked_constant = True  # type: ignore[attr-defined]
