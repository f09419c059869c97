"""Cross-entropy over a wide class dimension (a language-model head) as separate full-size passes.

What it finds
    In a CUDA profile, `F.cross_entropy` (`aten::cross_entropy_loss`) over 2-D logits [N, C] with at least
    `MIN_CLASSES` classes, class-index targets, no class weights and no label smoothing: the loss of an LM
    head over a vocabulary. The finding points at the call, with the GPU time that the loss took forward
    and backward (log_softmax, nll_loss, their backward ops and, under autocast, the float32 copies of the
    logits and of their gradient), the size of the logits, and whether autocast cast them to float32.

Why it is slow
    Eager cross-entropy makes several full passes over the logits: log_softmax writes log-probabilities
    of the logits' size, under bf16 autocast a float32 copy of them follows ([N, C] x 4 bytes: 1 GB for
    BERT-base's 8192 x 30522) for nll_loss, and backward writes a float32 gradient (zeros, then the
    scatter), casts it, and runs log_softmax's backward over it. The work needs one read of the logits
    forward and one read plus one write of the gradient backward; the rest is memory traffic (several GB a
    step on an LM head; on an H200 2.84 ms fwd+bwd eager against 0.65 ms fused at [8192, 30522]).

Example
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

Fix and its safety
    `opadvisor apply --rule fused_cross_entropy` calls `opadvisor.kernels.cross_entropy` with the same
    arguments: it reads the 16-bit logits where they lie (a column slice of a padded LM head included),
    computes log-sum-exp per row in float32 and writes the gradient once, in the logits' dtype; rows
    whose target is ignore_index are not read at all. Safe: the same function, computed more precisely
    (eager rounds the log-probabilities to the logits' 16-bit dtype before the loss, even under autocast
    on CUDA: losses differ by up to half a bf16 step of the loss value). Arguments it does not fuse (class
    weights, label smoothing, other ranks) make it call `F.cross_entropy` itself, so the rewrite never
    changes what is computed. On a CPU profile the rule
    reports nothing: the bundled kernel runs on CUDA only, and its saving is GPU time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._chains import in_dtype, scalar, shape
from opadvisor.rules._findings import build_finding, fmt_ms
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules.engine import NeedsGpuProfile
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Finding

ID = "fused_cross_entropy"
TITLE = "Cross-entropy over many classes, unfused"
FIX = "safe"

LOSS_OP = "aten::cross_entropy_loss"
FUSED_DTYPES = frozenset({"float32", "float16", "bfloat16"})
INDEX_DTYPES = frozenset({"int64", "int32", "long", "int"})
# opadvisor.kernels.cross_entropy.SMALL_CLASSES: below it the bundled function runs F.cross_entropy itself
# (kept here so `suggest` does not import torch; tests/rules/test_fused_cross_entropy.py ties the two).
MIN_CLASSES = 8192
# The fused loss's share of the eager one, forward + backward, bf16 logits under autocast (H200, benchmarks/
# cross_entropy.py at [8192, 30522] as a slice of [8192, 30528]; RESULTS.md): the estimate of the saving.
FUSED_SHARE = 0.25
_ARG_WEIGHT, _ARG_IGNORE_INDEX, _ARG_LABEL_SMOOTHING = 2, 4, 5


@dataclass
class CrossEntropyFacts(Facts):
    """What a fused_cross_entropy finding carries: the logits' rows, classes and dtype, whether autocast
    made a float32 copy of them, and the ignore_index the call passed (None: the default)."""

    RULES = ("fused_cross_entropy",)
    rows: int = 0
    classes: int = 0
    dtype: str = ""
    autocast_copy: bool = False
    ignore_index: float | None = None


def _fusable(op: Op) -> tuple[int, int, str] | None:
    """(rows, classes, dtype) of a cross-entropy the kernel takes, None otherwise."""
    logits, target = shape(op, 0), shape(op, 1)
    dtypes = op.input_dtypes
    dtype = in_dtype(op)
    target_dtype = dtypes[1] if len(dtypes) > 1 else None
    if logits is None or len(logits) != 2 or target is None or len(target) != 1:
        return None
    if dtype not in FUSED_DTYPES or target_dtype not in INDEX_DTYPES:
        return None
    if shape(op, _ARG_WEIGHT) is not None or (scalar(op, _ARG_LABEL_SMOOTHING) or 0.0) != 0.0:
        return None
    rows, classes = logits
    return (rows, classes, dtype) if classes >= MIN_CLASSES else None


def _autocast_copy(ix: ProfileIndex, op: Op) -> bool:
    """Whether autocast copied 16-bit values to float32 inside the loss (for nll_loss)."""
    return any(
        d.name in ("aten::copy_", "aten::_to_copy", "aten::to")
        and (d.input_dtypes[:1] == ["float32"] or in_dtype(d) == "float32")
        and any(t in ("bfloat16", "float16") for t in d.input_dtypes if t)
        for d in ix.descendants(op)
    )


def detect(profile: Profile) -> list[Finding]:
    if not profile.has_gpu:
        raise NeedsGpuProfile(
            "the fused loss runs on CUDA and saves GPU time, which a CPU profile cannot measure"
        )
    ix = index_of(profile)
    sites: dict[tuple[str, int], list[tuple[Op, tuple[int, int, str]]]] = defaultdict(list)
    for op in ix.forward_roots([LOSS_OP]):
        got = _fusable(op)
        if got is not None and op.file and op.line:
            sites[(op.file, op.line)].append((op, got))
    findings = []
    for (path, line), items in sites.items():
        ops = [op for op, _ in items]
        rows, classes, dtype = items[0][1]
        cast = any(_autocast_copy(ix, op) for op in ops)
        cost_ms = ix.per_step_ms(ix.site_cost_us(ops))
        saving = cost_ms * (1 - FUSED_SHARE) if cost_ms else None
        ignore_index = scalar(items[0][0], _ARG_IGNORE_INDEX)
        head = f"cross_entropy over {classes} classes x {rows} rows in {dtype}" + (
            " (plus autocast's float32 copy)" if cast else ""
        )
        notes = [
            f"the logits are {rows * classes * _itemsize(dtype) / 2**20:.0f} MiB; eager makes "
            "several full-size passes over them (cast, log_softmax, nll, and as many backward)"
        ]
        if saving is not None:
            notes.append(f"one fused read forward and one read + write backward would save about "
                         f"{fmt_ms(saving)}/step (estimate from an H200 measurement)")  # fmt: skip
        findings.append(
            build_finding(
                ix,
                rule=ID,
                fix=FIX,
                path=path,
                line=line,
                end_line=line,
                function=ops[0].function,
                occurrences=[[op] for op in ops],
                head=head,
                fused_kernels=None,
                est_saving_ms=saving,
                advice="use opadvisor.kernels.cross_entropy (opadvisor apply --rule fused_cross_entropy): "
                "the same arguments, one pass over the 16-bit logits each way",
                details=CrossEntropyFacts(
                    rows=rows, classes=classes, dtype=dtype, autocast_copy=cast, ignore_index=ignore_index
                ).to_details(),
                notes=notes,
            )
        )
    return findings


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2
