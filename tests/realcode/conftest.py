"""The real-code proving ground's tests run the harnesses of benchmarks/ (ecosystem.py, realcode.py,
realcode_families.py), which import each other by module name as scripts do: benchmarks/ goes on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
