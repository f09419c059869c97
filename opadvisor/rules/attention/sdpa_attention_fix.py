"""sdpa_attention: a hand-written attention (q @ k^T, scale, mask, softmax, dropout, @ v) into
`torch.nn.functional.scaled_dot_product_attention`.

Before (GPT style)::

    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)
    y = att @ v

After::

    y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_dropout.p if self.attn_dropout.training
                                       else 0.0, is_causal=True, scale=(1.0 / math.sqrt(k.size(-1))))

How each part carries over:
- scale: always passed (`scale=1.0` when the original had none, since SDPA's default is 1/sqrt(E));
  a divisor `/ c` becomes `scale=1 / c`.
- mask: SDPA's boolean mask is True where a position takes part, the opposite of masked_fill's, so it is
  inverted (`~mask` -> `mask`, `m == 0` -> `m != 0`, else `~(m)`); an additive float mask is passed as it
  is. A slice `[..., :T, :T]` of a causal buffer (`torch.tril(torch.ones(n, n))` registered in `__init__`,
  filled where it is 0; or a `torch.triu(..., diagonal=1)` one filled where it is 1), or such a mask
  built inline, becomes `is_causal=True` with no mask. The fill value must be -inf or a very large negative
  number (finfo.min, <= -1e4): then masked positions get probability 0 either way. With a finite fill, a row
  whose every key is masked averages the values in the original and gives zeros with SDPA, so the original
  must zero those probabilities afterwards (`probs.masked_fill(mask, 0)`, which SDPA then makes redundant)
  or the site is left alone.
- dropout: `dropout_p=<p> if <training> else 0.0`, from an nn.Dropout module (`self.drop.p`,
  `self.drop.training`) or `F.dropout(p=..., training=...)`. SDPA draws its own dropout mask, so with
  dropout on, the random numbers differ from the original's (the distribution is the same).

Unsafe, so rewritten only with --unsafe (the engine sets `allow_unsafe`): a chain that zeroes the masked
probabilities after the softmax (DeBERTa's XSoftmax). Its author expects rows whose every key is masked,
where the original gives zeros; SDPA's math and memory-efficient backends give zeros too, but on an H200
(torch 2.11, bf16/fp16, bool mask) the cuDNN backend it picks by default gave non-zero rows there and NaN
gradients. The zeroing itself is dropped: for the other rows it changes nothing.

Left alone, with the reason: the attention weights are read after the product with v (returned to the
caller, stored, or printed: SDPA does not return them), a softmax over another dim than the last, a
softmax with `dtype=`, a mask fill SDPA cannot express.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
import libcst.matchers as m

from opadvisor.rewrite import toolkit as ed
from opadvisor.rewrite import toolkit as mt
from opadvisor.rewrite.toolkit import (
    BlockEdit,
    Chain,
    ChainFinder,
    SoftmaxChainRewriter,
    Step,
    assign_name,
    block_index,
    cast_problem,
    guarded,
    upcast_problem,
)
from opadvisor.rewrite.toolkit import (
    small_statement as _small,
)
from opadvisor.rules.attention import AttentionFacts
from opadvisor.rules.patterns import DROPOUT, MASK, PV, QK, SCALE, SOFTMAX, ZERO

SDPA = "torch.nn.functional.scaled_dot_product_attention"
VERY_NEGATIVE = -1e4

_PEELABLE_METHODS = {
    "view",
    "reshape",
    "bool",
    "to",
    "unsqueeze",
    "type",
    "byte",
    "float",
    "contiguous",
    "expand",
}


class SdpaAttentionCodemod(SoftmaxChainRewriter):
    RULE = "sdpa_attention"
    FACTS = AttentionFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("softmax",)  # a hand-written attention has its softmax
    NO_KERNEL_OP = "F.scaled_dot_product_attention is PyTorch's own fused attention"
    SAFETY = "safe"
    SDPA = True

    # ---- one chain --------------------------------------------------------------------------------------
    def _edit_for(
        self, finder: ChainFinder, stmts: Sequence[cst.BaseStatement], chain: Chain, indent: str
    ) -> BlockEdit | None:
        kinds = chain.kinds()
        start, end = self.stmt_lines(stmts, chain.first, chain.last)
        if self.target_for_lines(start, end) is None:
            return None
        anchor = _small(stmts[chain.first]) or stmts[chain.first]
        if QK not in kinds or PV not in kinds:
            if finder.refused:
                self._refuse(anchor, self.refused_words(finder))
            elif self.targets is not None:  # the profile says it is an attention: say why it is not rewritten
                self._refuse(anchor, self._missing_product(stmts, chain, QK not in kinds))
            return None
        problem, keywords, carried = self._arguments(finder, chain)
        if problem is None:
            read = finder.temps_problem(chain, carried)
            if read is not None:
                name, line, in_return = read
                weights = self._is_weights(chain, name)
                if weights and in_return:
                    problem = (
                        f"the attention weights `{name}` are returned to the caller (line {line}); "
                        "scaled_dot_product_attention does not return them"
                    )
                elif weights:
                    problem = (
                        f"the attention weights `{name}` are used again at line {line}; "
                        "scaled_dot_product_attention does not return them"
                    )
                else:
                    problem = f"`{name}` is read again at line {line}, so the intermediate value cannot be folded away"
        if problem is not None:
            self._refuse(anchor, problem)
            return None
        qk, pv = chain.step(QK), chain.step(PV)
        assert qk is not None and pv is not None
        q, k, v = qk.params["q"], qk.params["k"], pv.params["v"]
        assert q is not None and k is not None and v is not None
        last_stmt = stmts[chain.last]
        assert isinstance(last_stmt, cst.SimpleStatementLine)
        call = self.call_for(self.ref(SDPA), [q, k, v], keywords, last_stmt, chain.top, indent)
        self.record_change(anchor, self._describe(chain, keywords))
        return BlockEdit(chain.first, chain.last, {id(chain.top): call}, [q, k, v, *carried])

    def _refuse(self, anchor: cst.CSTNode, reason: str) -> None:
        """Skip the chain at `anchor`, saying where the code's own scaled_dot_product_attention is when the
        chain is the `else` of an `if` that calls it (timm's `if self.fused_attn:`, nanoGPT's `if self.flash:`):
        the switch that was off in this run is the one-word fix."""
        switch = self._sdpa_switch(anchor)
        if switch is not None:
            line, test = switch
            reason += (
                f"; the `if {test}:` at line {line} already calls scaled_dot_product_attention, and this "
                "branch runs only where that is false"
            )
        self.skip(anchor, f"not rewritten: {reason}")

    def _sdpa_switch(self, anchor: cst.CSTNode) -> tuple[int, str] | None:
        """(line, test) of the `if` whose `else` block holds `anchor` and whose body calls SDPA, or None."""
        node: cst.CSTNode = anchor
        for _ in range(4):  # small statement -> line -> block -> else -> if
            parent = mt.parent(self, node)
            if parent is None:
                return None
            if isinstance(parent, cst.If) and isinstance(node, cst.Else):
                calls = mt.nodes_of(parent.body, cst.Call)
                if any(_names_sdpa(c.func) for c in calls):
                    return self.lines_of(parent)[0], mt.code(parent.test)
                return None
            node = parent
        return None

    def _missing_product(self, stmts: Sequence[cst.BaseStatement], chain: Chain, qk: bool) -> str:
        """Why the chain does not reach q @ k^T (`qk`) or the product with v."""
        if qk:
            between = self._read_between(stmts, chain)
            if between is not None:
                name, line, text = between
                return (
                    f"`{name}` (q @ k^T) is read at line {line} (`{text}`), between the product and the "
                    "softmax; scaled_dot_product_attention never makes the scores that line reads"
                )
            source = self._made_by(stmts, chain)
            if source is not None:
                line, text = source
                return (
                    f"the scores come from line {line} (`{text}`), not straight from q @ k.transpose(-2, -1); "
                    "scaled_dot_product_attention cannot take that step"
                )
            return "no q @ k.transpose(-2, -1) found in the same block, next to the softmax"
        name = chain.segments[-1].target
        following = stmts[chain.last + 1] if chain.last + 1 < len(stmts) else None
        if name and following is not None and any(n.value == name for n in mt.names_in(following)):
            line = self.lines_of(following)[0]
            text = mt.code(following).strip().splitlines()[0]
            return (
                f"`{name}` is used at line {line} (`{text}`) before its product with v; "
                "scaled_dot_product_attention cannot do that"
            )
        return "no product with v found in the same block, next to the softmax"

    def _read_between(self, stmts: Sequence[cst.BaseStatement], chain: Chain) -> tuple[str, int, str] | None:
        """(name, line, text) of the first statement between `name = <q @ k^T>` and the chain (the chain's
        base is `name`, bound there) that reads `name` without binding it (timm: `attn_bias =
        resolve_self_attn_mask(N, attn, ...)` between `attn = q @ k.transpose(-2, -1)` and the mask)."""
        base = mt.unparen(chain.base)
        if not isinstance(base, cst.Name):
            return None
        for index in range(chain.first - 1, max(chain.first - 8, -1), -1):  # a few statements up, no more
            bound = assign_name(stmts[index])
            if bound is not None and bound[0] == base.value:
                if not _a_product(bound[1]):
                    return None
                reader = next(
                    (
                        s
                        for s in stmts[index + 1 : chain.first]
                        if any(n.value == base.value for n in mt.names_in(s))
                    ),
                    None,
                )
                if reader is None:
                    return None
                return base.value, self.lines_of(reader)[0], mt.code(reader).strip().splitlines()[0]
        return None

    def _made_by(self, stmts: Sequence[cst.BaseStatement], chain: Chain) -> tuple[int, str] | None:
        """The statement just before the chain, when it binds the scores the chain starts from (GPT-2's
        `torch.where(causal_mask, attn_weights, mask_value)`): its line and first line of text."""
        base = mt.unparen(chain.base)
        before = stmts[chain.first - 1] if chain.first > 0 else None
        if not isinstance(base, cst.Name) or before is None:
            return None
        bound = assign_name(before)
        if bound is None or bound[0] != base.value:
            return None
        if _a_product(bound[1]):
            return None  # a product the rewrite did not read as q @ k^T: the general words fit better
        return self.lines_of(before)[0], mt.code(before).strip().splitlines()[0]

    def _is_weights(self, chain: Chain, name: str) -> bool:
        after = False
        for seg in chain.segments:
            if seg.index == chain.segments[chain.softmax_seg].index:
                after = True
            if after and seg.target == name:
                return True
        return False

    def _describe(self, chain: Chain, keywords: list[tuple[str, cst.BaseExpression]]) -> str:
        parts = [k for k, _ in keywords if k != "scale"]
        detail = f" ({', '.join(parts)})" if parts else ""
        return f"manual attention ({' -> '.join(chain.kinds())}) -> scaled_dot_product_attention{detail}"

    def _arguments(
        self, finder: ChainFinder, chain: Chain
    ) -> tuple[str | None, list[tuple[str, cst.BaseExpression]], list[cst.CSTNode]]:
        keywords: list[tuple[str, cst.BaseExpression]] = []
        carried: list[cst.CSTNode] = []
        softmax = chain.step(SOFTMAX)
        assert softmax is not None
        if softmax.problem:
            return softmax.problem, keywords, carried
        if mt.int_value(softmax.params.get("dim")) != -1:
            return "the softmax is not over the last dim (the keys)", keywords, carried
        dtype_problem = upcast_problem(chain, finder.facts) or cast_problem(chain, finder.facts)
        if dtype_problem is not None:
            return dtype_problem, keywords, carried
        mask, zero, scale, dropout = (chain.step(k) for k in (MASK, ZERO, SCALE, DROPOUT))
        if mask is not None and mask.params.get("reshape") is not None:
            return (
                "the mask is added to a view of the scores in another shape (3-D scores, 4-D mask), "
                "which scaled_dot_product_attention's attn_mask cannot take",
                keywords,
                carried,
            )
        problem, causal = self._mask_arguments(finder, mask, zero, keywords, carried)
        if problem is not None:
            return problem, keywords, carried
        if dropout is not None:
            keywords.append(("dropout_p", _dropout_p(dropout, carried)))
        if causal:
            keywords.append(("is_causal", cst.Name("True")))
        if scale is None:
            keywords.append(("scale", cst.Float("1.0")))
        else:
            factor = scale.params["factor"]
            assert factor is not None
            keywords.append(("scale", ed.reciprocal(factor) if scale.divide else factor))
            carried.append(factor)
        return None, keywords, carried

    def _mask_arguments(
        self,
        finder: ChainFinder,
        mask: Step | None,
        zero: Step | None,
        keywords: list[tuple[str, cst.BaseExpression]],
        carried: list[cst.CSTNode],
    ) -> tuple[str | None, bool]:
        """Add attn_mask (and what it reads) for the chain's mask: (why SDPA cannot take it, None when it
        can; whether the mask is the causal one, given as is_causal instead)."""
        if mask is None:
            if zero is not None:
                return "the zeroing after the softmax has no matching masked_fill", False
            return None, False
        mask_node = mask.params["mask"]
        assert mask_node is not None
        fill = mask.params.get("fill")
        if fill is None:  # additive float mask: SDPA adds it the same way
            value, reused = guarded(mask, mask_node)
            keywords.append(("attn_mask", value))
            carried.extend([mask_node, *reused])
            if zero is not None:
                return "the zeroing after the softmax has no matching masked_fill", False
            return None, False
        return self._filled_mask_arguments(finder, mask, mask_node, fill, zero, keywords, carried)

    def _filled_mask_arguments(
        self,
        finder: ChainFinder,
        mask: Step,
        mask_node: cst.BaseExpression,
        fill: cst.BaseExpression,
        zero: Step | None,
        keywords: list[tuple[str, cst.BaseExpression]],
        carried: list[cst.CSTNode],
    ) -> tuple[str | None, bool]:
        """`_mask_arguments` for a masked_fill: SDPA's boolean attn_mask is the mask inverted (or is_causal)."""
        profiled = finder.facts.fill_value if finder.facts is not None else None
        if not _very_negative(fill, profiled):
            return f"the mask fills with `{mt.code(fill)}`, not -inf or a very large negative number", False
        if zero is not None and not getattr(self, "allow_unsafe", False):
            return (
                "the original zeroes the probabilities of masked positions, so it expects rows whose every "
                "key is masked; SDPA does not give zeros there on every backend (on an H200 in bf16, cuDNN "
                "attention gave non-zero rows and NaN gradients): an unsafe fix, pass --unsafe",
                False,
            )
        if zero is not None and not zero.params["mask"].deep_equals(mask_node):  # type: ignore[union-attr]
            return "the zeroing after the softmax uses a different mask than the masked_fill", False
        causal = mask.params.get("condition") is None and self._is_causal(finder, mask_node)
        if not causal:
            neg_inf = mt.is_neg_inf(fill) or (mt.number_value(fill) is None and profiled == float("-inf"))
            if not neg_inf and zero is None:
                return (
                    f"with the finite fill `{mt.code(fill)}`, a row whose every key is masked averages "
                    "the values; SDPA gives zeros there (fill with float('-inf') or zero the masked "
                    "probabilities after the softmax)",
                    False,
                )
            value, reused = guarded(mask, ed.invert(mask_node))
            keywords.append(("attn_mask", value))
            carried.extend([mask_node, *reused])
        return None, causal

    # ---- causal masks ---------------------------------------------------------------------------------------
    def _is_causal(self, finder: ChainFinder, mask: cst.BaseExpression) -> bool:
        """Whether masked_fill(mask, -inf) masks exactly the future keys (the full causal mask)."""
        mask = mt.unparen(mask)
        negated: cst.BaseExpression | None = None  # the tensor the mask is the negation of
        positive: cst.BaseExpression | None = None  # the tensor the mask is (True where masked)
        if isinstance(mask, cst.UnaryOperation) and isinstance(mask.operator, cst.BitInvert):
            negated = mask.expression
        elif isinstance(mask, cst.Comparison) and len(mask.comparisons) == 1:
            comp = mask.comparisons[0]
            value = mt.number_value(comp.comparator)
            is_false = m.matches(comp.comparator, m.Name("False"))
            is_true = m.matches(comp.comparator, m.Name("True"))
            if isinstance(comp.operator, cst.Equal) and (value == 0.0 or is_false):
                negated = mask.left
            elif isinstance(comp.operator, cst.Equal) and (value == 1.0 or is_true):
                positive = mask.left
            elif isinstance(comp.operator, cst.NotEqual) and (value == 0.0 or is_false):
                positive = mask.left
        elif m.matches(mask, m.Call(func=m.Attribute(attr=m.Name("logical_not")), args=[])):
            negated = mask.func.value  # type: ignore[union-attr]
        else:
            positive = mask
        if negated is not None:
            return self._causal_source(finder, negated) == "tril"
        if positive is not None:
            return self._causal_source(finder, positive) == "triu1"
        return False

    def _causal_source(self, finder: ChainFinder, node: cst.BaseExpression) -> str | None:
        """Whether node is a full causal mask: "tril" (lower triangle) or "triu1" (strictly upper); see _is_causal."""
        node = _peel_casts(mt.unparen(node))
        sliced = False
        if isinstance(node, cst.Subscript):
            if not _square_tail_slice(node):
                return None
            sliced = True
            node = _peel_casts(mt.unparen(node.value))
        source: cst.BaseExpression | None = node
        if mt.self_attr(node) is not None:  # a buffer: only a [..., :T, :T] slice of it is the full mask
            if not sliced:
                return None
            source = finder.class_value(node)
        elif isinstance(node, cst.Name):
            source = _local_value(finder, node)
        if source is None:
            return None
        return self._triangle(_peel_casts(mt.unparen(source)))

    def _triangle(self, node: cst.BaseExpression) -> str | None:
        if not isinstance(node, cst.Call):
            return None
        if mt.resolves_to(self, node.func, mt.TRIL_FUNCS):
            args = mt.bind_args(node, ("input", "diagonal"))
            if (
                args
                and _square_ones(self, args["input"].value)
                and mt.int_value(_arg(args, "diagonal", 0)) == 0
            ):
                return "tril"
        if mt.resolves_to(self, node.func, mt.TRIU_FUNCS):
            args = mt.bind_args(node, ("input", "diagonal"))
            if (
                args
                and _square_ones(self, args["input"].value)
                and mt.int_value(_arg(args, "diagonal", 0)) == 1
            ):
                return "triu1"
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in {"tril", "triu"}:
            args = mt.bind_args(node, ("diagonal",), required=0)
            if args is None or not _square_ones(self, node.func.value):
                return None
            diagonal = mt.int_value(_arg(args, "diagonal", 0))
            if node.func.attr.value == "tril" and diagonal == 0:
                return "tril"
            if node.func.attr.value == "triu" and diagonal == 1:
                return "triu1"
        return None


def _arg(args: dict[str, cst.Arg], name: str, default: int) -> cst.BaseExpression:
    return args[name].value if name in args else cst.Integer(str(default))


def _peel_casts(node: cst.BaseExpression) -> cst.BaseExpression:
    """Strip `.view(...)`, `.bool()`, `.to(...)`, `[None, None]` ... that keep a mask's pattern."""
    while True:
        node = mt.unparen(node)
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in _PEELABLE_METHODS
        ):
            node = node.func.value
            continue
        if isinstance(node, cst.Subscript) and all(
            m.matches(el.slice, m.Index(value=m.Name("None"))) for el in node.slice
        ):
            node = node.value
            continue
        return node


def _square_tail_slice(node: cst.Subscript) -> bool:
    """`[..., :T, :T]` / `[:, :, :T, :T]` / `[:T, :T]`: full leading dims, then the same `:T` twice."""
    elements = list(node.slice)
    if len(elements) < 2:
        return False
    *lead, a, b = elements
    for el in lead:
        if m.matches(el.slice, m.Index(value=m.Ellipsis())):
            continue
        if m.matches(el.slice, m.Slice(lower=None, upper=None, step=None)):
            continue
        return False
    if not (isinstance(a.slice, cst.Slice) and isinstance(b.slice, cst.Slice)):
        return False
    for s in (a.slice, b.slice):
        lower = s.lower
        if s.step is not None or s.upper is None or (lower is not None and mt.int_value(lower) != 0):
            return False
    return a.slice.upper.deep_equals(b.slice.upper)  # type: ignore[union-attr]


def _square_ones(cm: cst.MetadataDependent, node: cst.BaseExpression) -> bool:
    """`torch.ones(n, n, ...)` (or `torch.ones((n, n))`)."""
    node = _peel_casts(mt.unparen(node))
    if not (isinstance(node, cst.Call) and mt.resolves_to(cm, node.func, mt.ONES_FUNCS)):
        return False
    sizes = [a.value for a in node.args if a.keyword is None and not a.star]
    if len(sizes) == 1 and isinstance(sizes[0], cst.Tuple | cst.List):
        sizes = [el.value for el in sizes[0].elements]
    return len(sizes) == 2 and sizes[0].deep_equals(sizes[1])


def _local_value(finder: ChainFinder, name: cst.Name) -> cst.BaseExpression | None:
    """The value a name was last given in the block before the chain (a mask built in the same function)."""
    at = next((k for k, stmt in enumerate(finder.stmts) if mt.contains(stmt, name)), len(finder.stmts))
    bound = block_index(finder.stmts).simple_before(name.value, at)
    return bound.value if bound is not None else None


def _called_name(func: cst.BaseExpression) -> str | None:
    """`f` of `f(...)` and of `x.f(...)`."""
    return func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", None)


def _names_sdpa(func: cst.BaseExpression) -> bool:
    return _called_name(func) == "scaled_dot_product_attention"


def _a_product(node: cst.BaseExpression) -> bool:
    """`a @ b`, or a call of matmul / bmm / baddbmm / einsum, anywhere in `node`."""
    products = {"matmul", "bmm", "baddbmm", "einsum"}
    for sub in mt.nodes_of(node, cst.BaseExpression):
        if isinstance(sub, cst.BinaryOperation) and isinstance(sub.operator, cst.MatrixMultiply):
            return True
        if isinstance(sub, cst.Call):
            if _called_name(sub.func) in products:
                return True
    return False


def _very_negative(fill: cst.BaseExpression, profiled: object) -> bool:
    """Whether a masked_fill's value is -inf, finfo.min or at most VERY_NEGATIVE (as written, or for a fill
    read from a name, `mask_value = -torch.finfo(dots.dtype).max`, as profiled)."""
    return (
        mt.is_neg_inf(fill)
        or mt.is_finfo_min(fill)
        or ((mt.number_value(fill) or 0.0) <= VERY_NEGATIVE and mt.number_value(fill) is not None)
        or (mt.number_value(fill) is None and isinstance(profiled, float) and profiled <= VERY_NEGATIVE)
    )


def _dropout_p(dropout: Step, carried: list[cst.CSTNode]) -> cst.BaseExpression:
    """SDPA's dropout_p for the chain's dropout: p where it always drops, `p if training else 0.0` where it
    drops in training only (a module's: `m.p if m.training else 0.0`); what it reads is added to `carried`."""
    module = dropout.params.get("module")
    if module is not None:
        carried.append(module)
        return ed.template("__m__.p if __m__.training else 0.0", m=module)
    p, training = dropout.params["p"], dropout.params.get("training")
    assert p is not None
    carried.append(p)
    if training is None or m.matches(training, m.Name("True")):
        return p
    carried.append(training)
    return ed.template("__p__ if __t__ else 0.0", p=ed.atomic(p), t=ed.atomic(training))
