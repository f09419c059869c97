"""The six codemods that rewrite construction sites and loops, run without the engine (see fixture_cases)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixture_cases import FIXTURES, Options, expected_path, options, run  # noqa: E402

RULES = (
    "fused_optimizer",
    "dataloader_stall",
    "manual_layernorm",
    "fp32_gemm",
    "sparse_launch",
    "fused_cross_entropy",
)

__all__ = ["FIXTURES", "RULES", "Options", "expected_path", "options", "run"]
