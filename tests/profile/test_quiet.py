"""`without_usdt_lines` drops Kineto's USDT lines from fd 2 and keeps every other line, in order."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import os, sys
from opadvisor.profile.quiet import without_usdt_lines
with without_usdt_lines():
    os.write(2, b"USDT:2026-11-24 03:35:11 9789:9789 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    os.write(2, b"ERROR: kineto says something real\n")
    print("from python", file=sys.stderr)
    os.write(2, b"USDT:2026-11-24 03:35:11 9789:9789 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
print("after", file=sys.stderr)
"""


def test_usdt_lines_dropped_others_kept() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "ERROR: kineto says something real\nfrom python\nafter\n"
