"""The attention family (fused_softmax, sdpa_attention: a detect module `<rule>.py` and its fix
`<rule>_fix.py` each; see docs/ADDING_A_RULE.md), and here the facts of an attention site, shared by both
rules and read by both codemods (and by the shared source matcher, `rewrite/_chain.py`).

`AttentionFacts` is what a finding of either rule carries in its `details` (see `opadvisor.rules.facts`):

    ops            the chain's links in the order they ran: "qk", "scale", "mask", "softmax", "zero",
                   "dropout", "pv" (fused_softmax reports mask .. dropout; sdpa_attention qk .. pv)
    op_names       the aten op of each link ("aten::masked_fill", ...)
    lines          link -> [first, last] source line of its statement; pinpointed: read from the source
    scores_shape / scores_dtype   the [..., q, k] scores the mask and softmax see
    scale          the factor (or, with scale_divides, the divisor) applied to the scores: a Python
                   number, or a tensor (a learnable temperature, a per-head parameter)
    mask_kind      "additive" (scores + mask) or "masked_fill"; mask: its shape (as broadcast) and dtype
    fill_value     masked_fill's value (a float; "tensor" when it was a 0-dim tensor)
    zero_fill      masked probabilities zeroed after the softmax (DeBERTa's XSoftmax)
    dropout_p      the dropout probability on the probabilities
    softmax_dim    the dim as the op got it (-1, or the last dim's index)
    softmax_dtype  the dtype the softmax read (float32 after an upcast); out_dtype: the dtype of the
                   probabilities where the next link read them (None when nothing after the softmax ran)
    inplace        links that ran in place (`scores += mask` -> ["mask"])

The legacy keys of turn-1 findings (mask_kind, fill_value, zero_fill, dropout_p, lines, pinpointed) keep
their meaning; `scale` was a bool and is now the operand (truthy the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.profile.model import Op
from opadvisor.rules._attention import AttentionSite, fill_value
from opadvisor.rules._chains import dtype_of, numel, scalar, scalar_float, shape
from opadvisor.rules.facts import Facts, Operand, operand
from opadvisor.rules.patterns import DROPOUT, MASK, QK, SCALE, SOFTMAX, ZERO

__all__ = ["AttentionFacts", "attention_facts"]


@dataclass
class AttentionFacts(Facts):
    RULES = ("fused_softmax", "sdpa_attention")
    ops: list[str] = field(default_factory=list)
    op_names: list[str] = field(default_factory=list)
    lines: dict[str, list[int]] = field(default_factory=dict)
    pinpointed: bool = False
    scores_shape: list[int] | None = None
    scores_dtype: str | None = None
    scale: Operand | None = None
    scale_divides: bool = False
    mask_kind: str | None = None
    mask: Operand | None = None
    fill_value: float | str | None = None
    zero_fill: bool = False
    dropout_p: float | None = None
    softmax_dim: int | None = None
    softmax_dtype: str | None = None
    out_dtype: str | None = None
    inplace: list[str] = field(default_factory=list)

    def has(self, label: str) -> bool:
        return label in self.ops


def attention_facts(site: AttentionSite, labels: tuple[str, ...]) -> AttentionFacts:
    """The facts of one site, over the links in `labels` that it bound."""
    ops = site.match.ops
    present = site.match.ran(labels)
    softmax = ops[SOFTMAX]
    scores = shape(softmax, 0)
    facts = AttentionFacts(
        ops=present,
        op_names=[ops[x].name for x in present],
        lines={x: list(site.lines[x]) for x in present if x in site.lines},
        pinpointed=site.pinpointed,
        scores_shape=scores,
        scores_dtype=_scores_dtype(ops, present),
        softmax_dim=scalar(softmax, 1) if isinstance(scalar(softmax, 1), int) else None,
        softmax_dtype=dtype_of(softmax, 0),
        out_dtype=_out_dtype(ops, present),
        inplace=[x for x in present if ops[x].name.endswith("_")],
    )
    if SCALE in present:
        facts.scale = operand(ops[SCALE], _other_side(ops[SCALE], scores))
        facts.scale_divides = ops[SCALE].name.startswith("aten::div")
    if MASK in present:
        mask = ops[MASK]
        if mask.name.startswith("aten::add"):
            facts.mask_kind = "additive"
            facts.mask = operand(mask, _other_side(mask, scores))
        else:
            facts.mask_kind = "masked_fill"
            facts.mask = operand(mask, 1)
            facts.fill_value = fill_value(mask)
    facts.zero_fill = ZERO in present
    if DROPOUT in present:
        facts.dropout_p = scalar_float(ops[DROPOUT], 1)
    return facts


def _other_side(op: Op, scores: list[int] | None) -> int:
    """Which input of a binary op (scores op x) is not the scores: 1, unless input 0 is the smaller one."""
    want = numel(scores)
    first, second = numel(shape(op, 0)), numel(shape(op, 1))
    if want is not None and first is not None and first != want and second == want:
        return 0
    return 1


def _scores_dtype(ops: dict[str, Op], present: list[str]) -> str | None:
    for label in (SCALE, MASK):
        if label in present:
            return dtype_of(ops[label], _scores_side(ops[label]))
    if QK in present:
        return dtype_of(ops[QK], 0)
    return dtype_of(ops[SOFTMAX], 0)


def _scores_side(op: Op) -> int:
    first, second = numel(shape(op, 0)), numel(shape(op, 1))
    return 1 if first is not None and second is not None and second > first else 0


def _out_dtype(ops: dict[str, Op], present: list[str]) -> str | None:
    after = present[present.index(SOFTMAX) + 1 :] if SOFTMAX in present else []
    return dtype_of(ops[after[0]], 0) if after else None
