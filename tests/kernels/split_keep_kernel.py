"""A Triton kernel that stores `keep_rows_cols`' mask for rows first .. first + ROWS - 1 (the split Philox
draw at row indices no small tensor reaches). Imported inside the test that uses it: importing triton must
wait until conftest has chosen the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl
from opadvisor.kernels._dropout_add_triton import keep_rows_cols


@triton.jit
def draw_keep(OUT, first, threshold, k0, k1, stream, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = first + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    keep = keep_rows_cols(k0, k1, stream, threshold, rows[:, None], cols[None, :])
    tl.store(OUT + tl.arange(0, ROWS)[:, None] * BLOCK + cols[None, :], keep.to(tl.int8))
