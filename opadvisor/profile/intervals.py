"""Time intervals of a profile, `(start, end)` in one unit (the profile's microseconds, or ms): their
union, total length and difference, for "how long was the GPU busy with X" and "X not hidden behind Y"."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]

__all__ = ["Interval", "interval_union", "length", "subtract"]


def interval_union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same instants (empty ones left out)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """The total length of disjoint intervals."""
    return sum(b - a for a, b in intervals)


def subtract(base: list[Interval], cut: list[Interval]) -> list[Interval]:
    """Parts of the (unioned) `base` outside the (unioned) `cut`."""
    out: list[Interval] = []
    j = 0
    for a, b in base:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, cursor = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < b:
            out.append((cursor, b))
    return out
