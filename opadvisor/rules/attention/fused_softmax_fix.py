"""fused_softmax: scale -> mask -> softmax (-> zero the masked -> dropout) into one fused kernel call.

Before (DeBERTa style)::

    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1)
    probs = probs.masked_fill(~mask, 0.0)
    probs = self.dropout(probs)

After::

    scores = q @ k.transpose(-1, -2)
    probs = masked_softmax(scores, ~mask, scale=1 / math.sqrt(d), fill_value=torch.finfo(scores.dtype).min,
                           zero_masked=True, dropout_p=self.dropout.p, training=self.dropout.training)

`opadvisor.kernels.masked_softmax(x, mask=None, *, dim=-1, scale=None, fill_value=-inf, zero_masked=False,
dropout_p=0.0, training=True)` computes softmax(x * scale, filled with fill_value where a bool mask is True,
or plus a float mask), zeroes the masked positions when asked, then applies dropout. The user's own
expressions are carried over verbatim: the mask (its polarity is masked_fill's, so `~mask`, `mask == 0`
... stay as written), the fill value, the scale (a divisor `/ c` becomes `scale=1 / c`), the softmax dim,
and the dropout's p and training flag (`self.drop.p` / `self.drop.training` for an nn.Dropout module).

Recognised: `F.softmax` / `torch.softmax` / `x.softmax(dim)` / an `nn.Softmax` module, whatever the import
alias; `x.masked_fill(m, v)` / `torch.masked_fill`; `x + mask` and `x += mask`; `x * c`, `c * x`, `x / c`;
`nn.Dropout` modules (from `__init__`), `F.dropout`, `torch.dropout`; within one expression or across
consecutive statements. Left alone, with the reason: a softmax with `dtype=` or without a dim, and chains
whose intermediate values are read elsewhere (the longest safe part is fused instead, if any).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst

from opadvisor.rewrite import toolkit as ed
from opadvisor.rewrite import toolkit as mt
from opadvisor.rewrite.toolkit import (
    CAST,
    BlockEdit,
    Chain,
    ChainFinder,
    Segment,
    SoftmaxChainRewriter,
    Step,
    cast_problem,
    guarded,
    upcast_problem,
)
from opadvisor.rewrite.toolkit import (
    small_statement as _small,
)
from opadvisor.rules.attention import AttentionFacts
from opadvisor.rules.patterns import DROPOUT, MASK, SCALE, SOFTMAX, ZERO

KERNEL = "opadvisor.kernels.masked_softmax"

_LABELS = {
    CAST: "cast back",
    SCALE: "scale",
    MASK: "masked_fill",
    SOFTMAX: "softmax",
    ZERO: "masked_fill(0)",
    DROPOUT: "dropout",
}


def describe(chain: Chain) -> str:
    labels = []
    for step in chain.steps:
        label = _LABELS[step.kind]
        if step.kind == MASK and step.params.get("fill") is None:
            label = "+ mask"
        labels.append(label)
    return " -> ".join(labels)


class FusedSoftmaxCodemod(SoftmaxChainRewriter):
    RULE = "fused_softmax"
    FACTS = AttentionFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("softmax",)  # a softmax call or module
    KERNEL_OP = "masked_softmax"
    SAFETY = "safe"

    def _edit_for(
        self, finder: ChainFinder, stmts: Sequence[cst.BaseStatement], chain: Chain, indent: str
    ) -> BlockEdit | None:
        start, end = self.stmt_lines(stmts, chain.first, chain.last)
        if self.target_for_lines(start, end) is None:
            return None
        anchor = _small(stmts[chain.first]) or stmts[chain.first]
        if not any(step.kind != SOFTMAX for step in chain.steps):
            if finder.refused:  # a plain softmax once what could not be folded is left out
                self.skip(anchor, f"not fused: {self.refused_words(finder)}")
            return None
        softmax = chain.step(SOFTMAX)
        assert softmax is not None
        if softmax.problem:
            self.skip(anchor, f"not fused: {softmax.problem}")
            return None
        first_problem: str | None = None
        for cand in finder.candidates(chain):
            problem = self._candidate_problem(finder, cand)
            if problem is None:
                edit, read = self._build(finder, stmts, cand, indent)
                if read is None:
                    left_out = first_problem or self.refused_words(finder) or None
                    self._record(_small(stmts[cand.first]) or stmts[cand.first], chain, cand, left_out)
                    return edit
                problem = read
            if first_problem is None:
                first_problem = problem
        if first_problem is not None:
            self.skip(anchor, f"not fused: {first_problem}")
        return None

    def _candidate_problem(self, finder: ChainFinder, cand: Chain) -> str | None:
        kinds = cand.kinds()
        if not any(k != SOFTMAX for k in kinds):
            return "nothing left to fuse"
        zero = cand.step(ZERO)
        if zero is not None:
            mask = cand.step(MASK)
            if mask is None or mask.params.get("fill") is None:
                return "the zeroing after the softmax has no matching masked_fill before it"
            if not mask.params["mask"].deep_equals(zero.params["mask"]):  # type: ignore[union-attr]
                return "the zeroing after the softmax uses a different mask than the masked_fill before it"
        upcast = upcast_problem(cand, finder.facts) or cast_problem(cand, finder.facts)
        if upcast is not None:
            return upcast
        if not finder.fresh_before(cand):
            seg = cand.segments[0]
            return f"`{seg.target} {code_op(stmt_of(finder, seg.index))}=` updates a tensor that may be shared in place"
        return None

    def _build(
        self, finder: ChainFinder, stmts: Sequence[cst.BaseStatement], cand: Chain, indent: str
    ) -> tuple[BlockEdit | None, str | None]:
        first = cand.segments[0]
        single = len(cand.segments) == 1
        x, keep_first = _scores_of(first, single)
        positional: list[cst.BaseExpression] = [x]
        carried: list[cst.CSTNode] = [first.entry] if (single or keep_first) else []
        mask = cand.step(MASK)
        meta_name = x.value if isinstance(x, cst.Name) else None
        reshape, restore = (mask.params.get("reshape"), mask.params.get("restore")) if mask else (None, None)
        if reshape is not None:  # the mask applies to a view of the scores: the call takes that view
            if cand.segments[0].steps[0] is not mask or not isinstance(x, cst.Name):
                return None, "the mask is added to a view of the scores that other folded steps come before"
            positional[0] = reshape
            carried.extend([reshape, restore])  # type: ignore[list-item]
        if mask is not None:
            value, reused = guarded(mask, mask.params["mask"])  # type: ignore[arg-type]
            positional.append(value)
            carried.extend([mask.params["mask"], *reused])  # type: ignore[list-item]
        keywords = _keywords(cand, carried)
        read = finder.temps_problem(cand, carried, meta_name, keep_first)
        if read is not None:
            name, line, _in_return = read
            return (
                None,
                f"`{name}` is read again at line {line}, so the intermediate value cannot be folded away",
            )
        last_stmt = stmts[cand.last]
        assert isinstance(last_stmt, cst.SimpleStatementLine)
        call: cst.BaseExpression = self.call_for(
            self.ref(KERNEL), positional, keywords, last_stmt, cand.top, _indent_of(indent)
        )
        if isinstance(restore, cst.Call):  # back to the view the code had after its mask
            call = cst.Call(func=cst.Attribute(value=call, attr=restore.func.attr), args=restore.args)  # type: ignore[attr-defined]
        edit = BlockEdit(cand.first, cand.last, {id(cand.top): call}, carried)
        if keep_first:
            _keep_first(edit, stmts[cand.first], first)
        return edit, None

    def _record(self, anchor: cst.CSTNode, full: Chain, done: Chain, problem: str | None) -> None:
        message = f"{describe(done)} -> opadvisor.kernels.masked_softmax"
        if problem:
            message += f" (the rest stays separate: {problem})"
        self.record_change(anchor, message)


def _indent_of(indent: str) -> str:
    return indent


def stmt_of(finder: ChainFinder, index: int) -> cst.CSTNode:
    return finder.stmts[index]


def code_op(stmt: cst.CSTNode) -> str:
    small = _small(stmt)
    if isinstance(small, cst.AugAssign):
        return mt.code(small.operator).strip().rstrip("=")
    return ""


def _scores_of(first: Segment, single: bool) -> tuple[cst.BaseExpression, bool]:
    """(what the kernel call takes as the scores, whether the first statement is kept as `name = base`)."""
    if single:
        return first.entry, False
    if first.aug or isinstance(first.entry, cst.Name):
        return cst.Name(first.target if first.aug else first.entry.value), False  # type: ignore[union-attr,arg-type]
    return cst.Name(first.target), True  # type: ignore[arg-type]


def _keywords(cand: Chain, carried: list[cst.CSTNode]) -> list[tuple[str, cst.BaseExpression]]:
    """The kernel call's keywords (dim, scale, fill_value, zero_masked, dropout_p, training) from the chain's
    steps; what they read is added to `carried`."""
    keywords: list[tuple[str, cst.BaseExpression]] = []
    softmax = cand.step(SOFTMAX)
    assert softmax is not None
    mask = cand.step(MASK)
    scale = cand.step(SCALE)
    dim = softmax.params.get("dim")
    if dim is not None and mt.int_value(dim) != -1:
        keywords.append(("dim", dim))
        carried.append(dim)
    if scale is not None:
        factor = scale.params["factor"]
        assert factor is not None
        keywords.append(("scale", ed.reciprocal(factor) if scale.divide else factor))
        carried.append(factor)
    if mask is not None and mask.params.get("fill") is not None:
        fill = mask.params["fill"]
        assert fill is not None
        if not mt.is_neg_inf(fill):
            keywords.append(("fill_value", fill))
            carried.append(fill)
    if cand.step(ZERO) is not None:
        keywords.append(("zero_masked", cst.Name("True")))
    dropout = cand.step(DROPOUT)
    if dropout is not None:
        keywords.extend(_dropout_keywords(dropout, carried))
    return keywords


def _dropout_keywords(dropout: Step, carried: list[cst.CSTNode]) -> list[tuple[str, cst.BaseExpression]]:
    """dropout_p= and training= as the dropout had them (a module's: `m.p`, `m.training`)."""
    module = dropout.params.get("module")
    if module is not None:
        carried.append(module)
        return [
            ("dropout_p", ed.template("__m__.p", m=module)),
            ("training", ed.template("__m__.training", m=module)),
        ]
    p, training = dropout.params["p"], dropout.params.get("training")
    assert p is not None
    carried.append(p)
    if training is None:
        return [("dropout_p", p)]
    carried.append(training)
    return [("dropout_p", p), ("training", training)]


def _keep_first(edit: BlockEdit, first_stmt: cst.BaseStatement, first: Segment) -> None:
    """The first statement stays as `name = base` (its value unparenthesised where that fits one line)."""
    assert isinstance(first_stmt, cst.SimpleStatementLine)
    assign = first_stmt.body[0]
    assert isinstance(assign, cst.Assign)
    base = first.entry
    if getattr(base, "lpar", None) and "\n" not in mt.code(mt.unparen(base)):
        base = mt.unparen(base)
    edit.kept_first = first_stmt.with_changes(body=[assign.with_changes(value=base)])
    edit.kept_first_dropped = assign.value
