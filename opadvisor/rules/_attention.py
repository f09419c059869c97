"""The attention chain that fused_softmax and sdpa_attention share, as the profile shows it.

    q @ k^T  ->  scale  ->  mask (masked_fill with a large negative, or + additive mask)  ->  softmax
             ->  masked_fill(..., 0)  ->  dropout  ->  @ v

The steps, their order, which are optional and which may swap (the zeroing and the dropout) are declared
once in `rules/patterns.py` (the source matcher reads the same declaration); this module says which ops
each step runs as (`STEP_OPS`). Every link but softmax is optional; each rule asks for the links it needs (fused_softmax: mask and
softmax; sdpa_attention: both matrix products and softmax). Shapes tie the links together: the scores
that the mask, softmax, zero-fill and dropout see have one shape, the products' output / input match it
in element count (a bmm on [B*H, T, T] then a view is the same tensor), softmax runs over the last dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from opadvisor.profile.model import Op
from opadvisor.rules._chains import (
    MASK_PREP_OPS,
    PASS_THROUGH_OPS,
    ChainMatch,
    StepOps,
    broadcastable,
    declared_chain,
    find_chains,
    names,
    numel,
    out_shape,
    scalar,
    scalar_float,
    shape,
)
from opadvisor.rules._index import ProfileIndex
from opadvisor.rules._source import load_profiled_source, locate_each
from opadvisor.rules.patterns import ATTENTION as PATTERN
from opadvisor.rules.patterns import DROPOUT, MASK, PV, QK, SCALE, SOFTMAX, ZERO

MASK_FILL_MAX = -1e4  # a fill at or below this (or -inf) masks a score out; 0 after softmax zeroes it
SAMPLING_OPS = names("topk", "sort", "kthvalue", "argsort", "multinomial")
DROPOUT_OPS = names("dropout", "native_dropout", "feature_dropout", "dropout_", "alpha_dropout")
SOFTMAX_OPS = names("softmax", "_softmax", "_safe_softmax")
MATMUL_OPS = names("matmul", "bmm", "baddbmm")


def dropout_active(op: Op) -> bool:
    """aten::dropout(x, p, train): True when it trains with p > 0 (native_dropout has no train flag)."""
    p = scalar_float(op, 1)
    train = scalar(op, 2) if op.name != "aten::native_dropout" else True
    return bool(train) and (p is None or p > 0)


def _skip(op: Op) -> bool:
    if op.name in PASS_THROUGH_OPS or op.name in MASK_PREP_OPS:
        return True
    return op.name in DROPOUT_OPS and not dropout_active(op)  # eval-mode dropout launches nothing


def _scores_numel(bound: dict[str, Op]) -> int | None:
    for label in (MASK, SCALE, SOFTMAX):
        if label in bound:
            return numel(shape(bound[label], 0))
    if QK in bound:
        return numel(out_shape(bound[QK]))
    return None


def _same_scores(op: Op, bound: dict[str, Op]) -> bool:
    want = _scores_numel(bound)
    return want is None or numel(shape(op, 0)) == want


def _qk(op: Op, bound: dict[str, Op]) -> bool:
    out = out_shape(op)
    return out is not None and len(out) >= 2


def _scale(op: Op, bound: dict[str, Op]) -> bool:
    s0, s1 = shape(op, 0), shape(op, 1)
    scalar_operand = s1 is None or s1 == [] or numel(s1) == 1
    return s0 is not None and len(s0) >= 2 and scalar_operand and _same_scores(op, bound)


def fill_value(op: Op) -> float | str | None:
    """The masked_fill value: a float, or "tensor" when it was a 0-dim tensor whose value is unknown."""
    v = scalar_float(op, 2)
    if v is not None:
        return v
    s = shape(op, 2)
    return "tensor" if s == [] else None


def _mask(op: Op, bound: dict[str, Op]) -> bool:
    s0 = shape(op, 0)
    if s0 is None or len(s0) < 2 or not _same_scores(op, bound):
        return False
    if op.name in ("aten::masked_fill", "aten::masked_fill_"):
        v = fill_value(op)
        big_negative = v == "tensor" or (isinstance(v, float) and (v <= MASK_FILL_MAX or v == -math.inf))
        return big_negative and broadcastable(shape(op, 1), s0)
    # additive mask: scores + mask, the mask broadcasting to the scores (not a scalar, not the residual)
    s1 = shape(op, 1)
    if s1 is None or numel(s1) in (None, 1):
        return False
    return broadcastable(s1, s0) or broadcastable(s0, s1)


def _softmax(op: Op, bound: dict[str, Op]) -> bool:
    s0 = shape(op, 0)
    dim = scalar(op, 1)
    if s0 is None or not isinstance(dim, int) or dim not in (-1, len(s0) - 1):
        return False
    if MASK in bound:
        mshape = shape(bound[MASK], 0)
        other = shape(bound[MASK], 1)
        # the mask may apply to a view of the scores (BART's [b, h, t, s] view of [b * h, t, s] scores)
        viewed = numel(mshape) == numel(s0) and mshape is not None and mshape[-1:] == s0[-1:]
        if (
            mshape != s0
            and not viewed
            and not (other is not None and (other == s0 or broadcastable(mshape, s0)))
        ):
            return False
    return _same_scores(op, bound)


def _zero(op: Op, bound: dict[str, Op]) -> bool:
    return scalar_float(op, 2) == 0.0 and shape(op, 0) == shape(bound[SOFTMAX], 0)


def _dropout(op: Op, bound: dict[str, Op]) -> bool:
    return dropout_active(op) and shape(op, 0) == shape(bound[SOFTMAX], 0)


def _pv(op: Op, bound: dict[str, Op]) -> bool:
    return numel(shape(op, 0)) == numel(shape(bound[SOFTMAX], 0))


# how each declared step shows in the profile: the ops it runs as, and what else must hold of them
STEP_OPS: StepOps = {
    QK: (MATMUL_OPS, _qk),
    SCALE: (names("div", "mul", "div_", "mul_"), _scale),
    MASK: (names("masked_fill", "masked_fill_", "add", "add_"), _mask),
    SOFTMAX: (SOFTMAX_OPS, _softmax),
    ZERO: (names("masked_fill", "masked_fill_"), _zero),
    DROPOUT: (DROPOUT_OPS, _dropout),
    PV: (MATMUL_OPS, _pv),
}

ATTENTION = declared_chain(PATTERN, STEP_OPS, skip=_skip, max_between=12)


ATTENTION_LABELS = PATTERN.names


@dataclass
class AttentionSite:
    """One occurrence of the chain, with the source lines of each bound link."""

    match: ChainMatch
    lines: dict[str, tuple[int, int]]  # label -> (first, last) statement lines
    pinpointed: bool  # lines come from the parsed source (else from the profile alone)

    @property
    def path(self) -> str:
        return self.match.frame.file

    def span(self, *labels: str) -> tuple[int, int]:
        """(first, last) line over the given bound labels (all bound labels when none are given)."""
        spans = [self.lines[x] for x in (labels or self.lines) if x in self.lines]
        return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (0, 0)


def attention_sites(index: ProfileIndex) -> list[AttentionSite]:
    """Every attention-chain occurrence in the profile (cached on the index), with per-link lines."""
    cached = getattr(index, "_attention_sites", None)
    if cached is not None:
        return cached
    sites: list[AttentionSite] = []
    for m in find_chains(index, ATTENTION):
        src = load_profiled_source(index.profile, m.frame.file)
        labels = [label for label in ATTENTION_LABELS if label in m.ops]
        ops = [m.ops[x] for x in labels]
        spans = locate_each(src, ops) if src is not None else [None] * len(ops)
        lines: dict[str, tuple[int, int]] = {}
        for label, op, span in zip(labels, ops, spans, strict=True):
            if span is not None:
                lines[label] = span
            elif op.line is not None:
                lines[label] = (op.line, op.line)
        sites.append(AttentionSite(m, lines, src is not None))
    index._attention_sites = sites  # type: ignore[attr-defined]
    return sites
