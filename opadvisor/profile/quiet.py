"""Keep torch's profiler from writing noise into the user's terminal.

torch 2.13's Kineto prints `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`
(and `profiler_stop`) to the process's stderr, from C++, at every profiler start and stop, whatever
KINETO_LOG_LEVEL asks short of silencing its errors too. `without_usdt_lines` captures file descriptor 2
around those two calls and writes back every other line, so Kineto's real warnings and errors still show.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_USDT_LINE = re.compile(rb"USDT:.*\] profiler_(start|stop)\r?\n?")


@contextmanager
def without_usdt_lines() -> Iterator[None]:
    """Run the block with fd 2 going to a temporary file, then write its lines back minus Kineto's USDT ones."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()  # Python-level writes made inside the block go where they were meant to
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [ln for ln in captured.read().splitlines(keepends=True) if not _USDT_LINE.fullmatch(ln)]
            if kept:
                os.write(2, b"".join(kept))
