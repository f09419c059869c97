"""Line hunks: the rewrites several static passes made of one text, put together.

`apply --rule all FILE` used to run each rule on the text the rule before it left: every rule that changed
the file made a new text, and libcst's metadata (most of a pass's time) was computed again for each. The
engine now runs every rule's first pass on the original (one metadata for all of them), turns each pass's
output into hunks of lines against the original, and puts together the rules whose hunks touch no other
rule's lines; a rule whose hunks do is left for the second round, which runs every rule, in order, on the
merged text as before (engine._merged_first_round).

A hunk replaces original lines [start, end) with `lines`; start == end inserts before line `start`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

IMPORTS, BODY = 0, 1  # a hunk's kind: at one insertion point the imports come first (as AddImportsVisitor
# places them after the last import, before any other statement a rewrite inserted there)


@dataclass(frozen=True)
class Hunk:
    start: int  # 0-based index of the first original line replaced
    end: int  # one past the last (== start: an insertion before line `start`)
    lines: tuple[str, ...]
    kind: int = BODY


def lines_of(text: bytes) -> list[str]:
    return text.decode("utf-8", errors="surrogateescape").splitlines(keepends=True)


def hunks(old: bytes, new: bytes, kind: int = BODY) -> list[Hunk]:
    """The hunks that turn `old` into `new`."""
    a, b = lines_of(old), lines_of(new)
    # the lines both start and end with are not handed to difflib (its matching is quadratic-ish in what
    # it is given; a rewrite changes a few places of a long file)
    same = min(len(a), len(b))
    lo = next((i for i in range(same) if a[i] != b[i]), same)
    hi = next((i for i in range(same - lo) if a[-1 - i] != b[-1 - i]), same - lo)
    middle_a, middle_b = a[lo : len(a) - hi], b[lo : len(b) - hi]
    ops = difflib.SequenceMatcher(a=middle_a, b=middle_b, autojunk=False).get_opcodes()
    return [
        Hunk(lo + i1, lo + i2, tuple(middle_b[j1:j2]), kind) for tag, i1, i2, j1, j2 in ops if tag != "equal"
    ]


def clash(a: Hunk, b: Hunk) -> bool:
    """Whether two hunks of different rewrites touch the same lines, border on each other or insert at the
    same point (their order there would be a guess); an import hunk inserting where a body hunk starts
    does not (the imports go first)."""
    if a.kind != b.kind:
        imports, body = (a, b) if a.kind == IMPORTS else (b, a)
        if imports.start == imports.end == body.start:
            return False
    return a.start <= b.end and b.start <= a.end


def clashes(new: Sequence[Hunk], taken: Sequence[Hunk]) -> bool:
    return any(clash(h, g) for h in new for g in taken)


def applied(old: bytes, chosen: Sequence[Hunk]) -> bytes:
    """`old` with `chosen` (hunks that do not clash) applied."""
    a = lines_of(old)
    out: list[str] = []
    at = 0
    for h in sorted(chosen, key=lambda h: (h.start, h.kind, h.end)):
        out.extend(a[at : h.start])
        out.extend(h.lines)
        at = max(at, h.end)
    out.extend(a[at:])
    return "".join(out).encode("utf-8", errors="surrogateescape")
