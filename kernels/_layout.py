"""Row layouts shared by the launchers: a tensor as rows of one dimension over <= 3 batch dimensions.

Everything here works on shapes and strides (plain tuples), so the launchers can cache the result per
layout: a training step that repeats its shapes pays for this arithmetic once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Kernels index in int32 below this many elements (a margin under 2**31 covers the last program's rows
# beyond the end, which are masked but still computed).
INT32_SAFE = 2**31 - 2**24


def moved(seq: Sequence[int], dim: int) -> tuple[int, ...]:
    """`seq` (a shape or strides) with entry `dim` moved last, as `Tensor.movedim(dim, -1)` does."""
    return (*seq[:dim], *seq[dim + 1 :], seq[dim])


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def expanded_strides(shape: Sequence[int], strides: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Strides of a tensor of `shape` broadcast to `target` (0 along broadcast dims), like `expand`."""
    lead = len(target) - len(shape)
    return (0,) * lead + tuple(0 if size == 1 else st for size, st in zip(shape, strides, strict=True))


def merge_batch_dims(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[tuple[int, int, int], list[tuple[int, int, int]]] | None:
    """Merge the batch dims of tensors sharing `shape` into exactly three (D0, D1, D2).

    `strides[k]` are tensor k's strides of those dims (0 where broadcast). Two neighbouring dims merge
    when every tensor can step over both with the inner stride. Returns None when more than three
    dims remain (the caller then copies).
    """
    n = len(strides)
    merged: list[tuple[int, list[int]]] = []
    for i, size in enumerate(shape):
        if size == 1:
            continue
        st = [s[i] for s in strides]
        if merged and all(outer == inner * size for outer, inner in zip(merged[-1][1], st, strict=True)):
            merged[-1] = (merged[-1][0] * size, st)
        else:
            merged.append((size, st))
    if len(merged) > 3:
        return None
    while len(merged) < 3:
        merged.insert(0, (1, [0] * n))
    sizes = (merged[0][0], merged[1][0], merged[2][0])
    per_tensor = [(merged[0][1][k], merged[1][1][k], merged[2][1][k]) for k in range(n)]
    return sizes, per_tensor


def row_layout(shape: Sequence[int], strides: Sequence[Sequence[int]], dim: int):
    """Rows along `dim` of tensors of one `shape` with the given strides (already broadcast).

    Returns (n_rows, n_cols, (D0, D1, D2), [(s0, s1, s2, s_col) per tensor]), or None when the batch
    dims do not merge into three (the caller then makes the tensors contiguous).
    """
    shape_m = moved(shape, dim)
    strides_m = [moved(s, dim) for s in strides]
    got = merge_batch_dims(shape_m[:-1], [s[:-1] for s in strides_m])
    if got is None:
        return None
    sizes, batch = got
    n_cols = shape_m[-1]
    n_rows = sizes[0] * sizes[1] * sizes[2]
    return n_rows, n_cols, sizes, [(*b, s[-1]) for b, s in zip(batch, strides_m, strict=True)]


def needs_int64(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> bool:
    """Whether a kernel over tensors of `shape` with these strides (0 for broadcast dims) must compute
    offsets in int64: the element count or some tensor's furthest element reaches INT32_SAFE."""
    if math.prod(shape) >= INT32_SAFE:
        return True
    return any(
        sum((n - 1) * abs(st) for n, st in zip(shape, s, strict=True) if n > 0) >= INT32_SAFE for s in strides
    )
