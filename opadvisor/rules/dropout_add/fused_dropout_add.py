"""Bias add, dropout and residual add run as separate kernels.

What it finds
    In one function, in the order they ran: an optional bias (a separate `+ bias`, or the bias of the
    `nn.Linear` producing the value), dropout in training mode, and the residual add of a tensor of the
    same shape — `x = x + self.drop(self.proj(y))`, `h = self.dropout(self.dense(h)); h + residual`, and the
    in-place `x += self.drop(h)`. A dropout whose result is not added to a residual is not reported.

Why it is slow
    Dropout reads the activation and writes it (plus a mask), and the residual add reads it again with the
    residual and writes the sum: two to three memory-bound kernels over a [tokens, hidden] tensor where one
    pass would do, and as many again in backward. On an H200 ([16384, 1024] bf16), eager forward took
    0.104 ms against 0.025 ms for one pass at the memory roofline.

Example
    x = x + self.resid_dropout(self.c_proj(y))

Fix and its safety
    `opadvisor apply --rule fused_dropout_add` rewrites the expression to
    `opadvisor.kernels.bias_dropout_add(...)` (the bias moves out of the linear into the fused kernel when
    there is one). Safe: the same function up to rounding; dropout draws its own random mask, so losses
    agree in distribution, not bit for bit. On a GPU profile, a chain over fewer than 2^26 elements
    (`KERNEL_MIN_NUMEL`) keeps the fix with no saving estimated: at that size the bundled function runs this same chain
    (a fused call costs more host time than the kernel saves on the GPU) except inside a CUDA graph
    (sparse_launch's fix, `opadvisor.kernels.cuda_graphed`), where no host time is spent per call and the
    fused kernel runs (measured in benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._attention import DROPOUT_OPS, dropout_active
from opadvisor.rules._chains import (
    StepOps,
    declared_chain,
    dtype_of,
    names,
    numel,
    out_shape,
    scalar_float,
    shape,
)
from opadvisor.rules._chains import find_chains as _find
from opadvisor.rules._findings import build_finding
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source, locate_each
from opadvisor.rules.facts import Facts, Operand, operand, operand_kind
from opadvisor.rules.finding import Finding
from opadvisor.rules.patterns import BIAS, DROPOUT, DROPOUT_ADD, RESIDUAL

ID = "fused_dropout_add"
TITLE = "Bias + dropout + residual as separate kernels"
FIX = "safe"

LABELS = DROPOUT_ADD.names

# opadvisor.kernels.dropout_add.SMALL_NUMEL, which the kernels package owns (importing it here would import
# torch into every `suggest`); tests/rules/test_chain_rules.py checks the two agree.
KERNEL_MIN_NUMEL = 1 << 26


@dataclass
class DropoutAddFacts(Facts):
    """What a fused_dropout_add finding carries to its fix (see opadvisor.rules.facts).

    ops / op_names: the links that ran ("bias", "dropout", "residual") and their aten ops; lines: link ->
    [first, last] source line. shape / dtype: the dropout's input (the sublayer output). bias: "add" (a
    separate `+ bias`, whose operand is `bias_operand`, 1-D [hidden]) or "linear" (the producing
    nn.Linear has one) or None; producer: "linear" when an nn.Linear produced the value. residual_shape:
    the residual added (the dropout output's shape: the rule reports no broadcast residual); residual_kinds:
    what the two operands of the add were ("tensor"; "param" for a learned table such as a positional
    embedding, which is no residual stream).
    inplace: the residual add ran in place (`x += ...`); dropout_inplace: the dropout did
    (`nn.Dropout(inplace=True)`), so the original also overwrote its input.
    """

    RULES = ("fused_dropout_add",)

    ops: list[str] = field(default_factory=list)
    op_names: list[str] = field(default_factory=list)
    lines: dict[str, list[int]] = field(default_factory=dict)
    shape: list[int] | None = None
    dtype: str | None = None
    bias: str | None = None
    producer: str | None = None
    bias_operand: Operand | None = None
    residual_shape: list[int] | None = None
    residual_kinds: list[str | None] = field(default_factory=list)
    inplace: bool = False
    dropout_p: float | None = None
    dropout_inplace: bool = False


def _bias(op: Op, bound: dict[str, Op]) -> bool:
    if op.name == "aten::linear":
        return True  # with or without bias: it produces the value dropped out
    s0, s1 = shape(op, 0), shape(op, 1)
    return (
        s0 is not None and s1 is not None and len(s1) == 1 and bool(s0) and s1[0] == s0[-1] and len(s0) >= 2
    )


def _produced(bound: dict[str, Op]) -> list[int] | None:
    b = bound.get(BIAS)
    if b is None:
        return None
    return out_shape(b) if b.name == "aten::linear" else shape(b, 0)


def _dropout(op: Op, bound: dict[str, Op]) -> bool:
    if not dropout_active(op):
        return False
    want = _produced(bound)
    return want is None or shape(op, 0) == want


def _residual(op: Op, bound: dict[str, Op]) -> bool:
    want = shape(bound[DROPOUT], 0)
    s0, s1 = shape(op, 0), shape(op, 1)
    # a learned table added (a positional embedding parameter) is no residual stream: it only has the
    # dropout output's shape when the batch is 1
    learned = {operand_kind(op, 0), operand_kind(op, 1)} & {"param", "frozen", "buffer"}
    return (
        want is not None and s0 == want and s1 == want and scalar_float(op, 2) in (None, 1.0) and not learned
    )


# how each declared step shows in the profile
STEP_OPS: StepOps = {
    BIAS: (names("linear", "add"), _bias),
    DROPOUT: (DROPOUT_OPS, _dropout),
    RESIDUAL: (names("add", "add_"), _residual),
}
CHAIN = declared_chain(DROPOUT_ADD, STEP_OPS, max_between=6)


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    findings: list[Finding] = []
    for (path, line, end, function), items in _sites(profile, ix).items():
        finding = _finding(ix, path, line, end, function, items)
        if finding is not None:
            findings.append(finding)
    return findings


def _sites(
    profile: Profile, ix: ProfileIndex
) -> dict[tuple, list[tuple[dict[str, Op], dict[str, tuple[int, int]]]]]:
    """The chains found, by (file, first line, last line, function): each one's ops and their lines."""
    groups: dict[tuple, list[tuple[dict[str, Op], dict[str, tuple[int, int]]]]] = defaultdict(list)
    for m in _find(ix, CHAIN):
        labels = [x for x in LABELS if x in m.ops]
        ops = [m.ops[x] for x in labels]
        src = load_profiled_source(profile, m.frame.file)
        spans = locate_each(src, ops) if src is not None else [None] * len(ops)
        lines = {
            label: span or (op.line, op.line)
            for label, op, span in zip(labels, ops, spans, strict=True)
            if span is not None or op.line is not None
        }
        if not lines:
            continue
        line = min(s[0] for s in lines.values())
        end = max(s[1] for s in lines.values())
        groups[(m.frame.file, line, end, m.frame.function)].append((m.ops, lines))
    return groups


def _finding(
    ix: ProfileIndex,
    path: str,
    line: int,
    end: int,
    function: str | None,
    items: list[tuple[dict[str, Op], dict[str, tuple[int, int]]]],
) -> Finding | None:
    first, lines = items[0]
    bias = first.get(BIAS)
    bias_kind = None if bias is None else ("linear" if bias.name == "aten::linear" else "add")
    # the linear stays a GEMM: cost and kernels are the elementwise ops the fused kernel replaces
    occurrences = [[ops[x] for x in LABELS if x in ops and ops[x].name != "aten::linear"] for ops, _ in items]
    n_fwd = sum(ix.kernel_count(op) for op in occurrences[0]) if ix.gpu else len(occurrences[0])
    if ix.gpu and n_fwd < 2:
        return None
    size = numel(shape(first[DROPOUT], 0))
    too_small = ix.gpu and size is not None and size < KERNEL_MIN_NUMEL
    saving = None
    if too_small:
        saving = 0.0  # outside CUDA graphs the bundled function runs this same chain at this size
    elif ix.gpu:
        saving = ix.per_step_ms(ix.site_cost_us(op for occ in occurrences for op in occ)) * (1 - 1 / n_fwd)
    residual = first[RESIDUAL]
    return build_finding(
        ix,
        rule=ID,
        fix=FIX,
        path=path,
        line=line,
        end_line=end,
        function=function,
        occurrences=occurrences,
        head=_head(bias_kind, residual),
        fused_kernels=1,
        est_saving_ms=saving,
        advice=_advice(size, too_small),
        details=_facts(first, lines, bias, bias_kind, residual).to_details(),
        notes=["the fused dropout draws its own random mask: losses agree in distribution"],
    )


def _head(bias_kind: str | None, residual: Op) -> str:
    """ "linear(+bias) -> dropout -> + residual" as the chain has it."""
    return " -> ".join(
        w
        for w in (
            {"linear": "linear(+bias)", "add": "+ bias", None: None}[bias_kind],
            "dropout",
            "+= residual" if residual.name.endswith("_") else "+ residual",
        )
        if w
    )


def _advice(size: int | None, too_small: bool) -> str:
    if too_small:
        return (
            f"at this size ({size:,} elements) the fused kernel runs only inside CUDA graphs "
            "(opadvisor apply --rule sparse_launch --unsafe); elsewhere "
            "opadvisor.kernels.bias_dropout_add runs this same chain, because under "
            f"{KERNEL_MIN_NUMEL:,} elements a fused call costs more host time than it saves"
        )
    return "one fused kernel: opadvisor.kernels.bias_dropout_add (opadvisor apply --rule fused_dropout_add)"


def _facts(
    first: dict[str, Op],
    lines: dict[str, tuple[int, int]],
    bias: Op | None,
    bias_kind: str | None,
    residual: Op,
) -> DropoutAddFacts:
    """What the profile proved of the chain, for the codemod to check the source against."""
    has_bias = bias_kind == "add" or (bias is not None and shape(bias, 2) is not None)
    return DropoutAddFacts(
        ops=[x for x in LABELS if x in first],
        op_names=[first[x].name for x in LABELS if x in first],
        lines={k: list(v) for k, v in lines.items()},
        shape=shape(first[DROPOUT], 0),
        dtype=dtype_of(first[DROPOUT], 0),
        bias=bias_kind if has_bias else None,
        producer="linear" if bias_kind == "linear" else None,
        bias_operand=operand(bias, 1) if bias_kind == "add" else None,
        residual_shape=shape(residual, 0),
        residual_kinds=[operand_kind(residual, 0), operand_kind(residual, 1)],
        inplace=residual.name.endswith("_"),
        dropout_p=scalar_float(first[DROPOUT], 1),
        dropout_inplace=first[DROPOUT].name.endswith("_"),
    )


__all__ = ["CHAIN", "DROPOUT_OPS", "FIX", "ID", "TITLE", "DropoutAddFacts", "detect"]
