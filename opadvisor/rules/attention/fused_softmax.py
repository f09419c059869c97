"""Masked softmax run as separate kernels: mask -> softmax (-> zero the masked -> dropout).

What it finds
    Attention scores masked and normalised op by op, in the order they ran in one function:
    `masked_fill(mask, -inf | -1e9 | finfo.min)` or `scores + additive_mask` (optionally after a scale),
    then `softmax` over the last dim, then optionally `masked_fill(mask, 0)` and/or dropout. This covers
    BERT's `scores / sqrt(d) + mask -> softmax -> dropout`, DeBERTa's XSoftmax (mask -> softmax -> mask),
    the annotated transformer's `masked_fill(mask == 0, -1e9)` and GPT's causal buffer mask. A softmax
    whose mask comes from top-k / sorting (sampling) is not attention and is not reported.

Why it is slow
    Each op is its own kernel that reads and writes the whole [batch, heads, seq, seq] score tensor, and
    autograd keeps each intermediate for the backward pass, which runs as many kernels again. The work is
    memory-bound: one fused pass reads the scores once and writes the probabilities once. On an H200,
    DeBERTa's masked softmax ([32,16,512,512] bf16) took 3.07 ms forward+backward eager and 0.79 ms fused.

Example
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1)
    probs = probs.masked_fill(~mask, 0.0)
    probs = self.dropout(probs)

Fix and its safety
    `opadvisor apply --rule fused_softmax` replaces the lines with one call to
    `opadvisor.kernels.masked_softmax(...)` (a Triton kernel with its own backward; pure PyTorch on CPU),
    keeping the fill value, the scale, the zeroing and the dropout probability. Safe: the same function up
    to rounding (dropout draws its own random mask, so losses agree in distribution, not bit for bit).
    When the whole attention is written by hand, `sdpa_attention` reports the same lines too; the output
    says which of the two saves more, and you apply one of them.
"""

from __future__ import annotations

from collections import defaultdict

from opadvisor.profile.model import Profile
from opadvisor.rules._attention import SAMPLING_OPS, AttentionSite, attention_sites
from opadvisor.rules._findings import build_finding
from opadvisor.rules._index import index_of
from opadvisor.rules.attention import attention_facts
from opadvisor.rules.finding import Finding
from opadvisor.rules.patterns import DROPOUT, FUSED_SOFTMAX, MASK, QK, SCALE, SOFTMAX, ZERO

ID = "fused_softmax"
TITLE = "Masked softmax as separate kernels"
FIX = "safe"
ALTERNATIVES = ("sdpa_attention",)  # rules whose fix rewrites the same lines another way

FACT_LABELS = FUSED_SOFTMAX.names  # the fix folds a scale in front of the mask too
LABELS = tuple(label for label in FACT_LABELS if label != SCALE)  # what the finding reports and costs
SAMPLING_LOOKBACK = 40  # frame ops before the mask searched for top-k / sort


def _is_sampling(site: AttentionSite) -> bool:
    """A mask built from top-k / sort just before: sampling logits, not attention scores."""
    m = site.match
    frame = m.frame
    pos = frame.positions[m.ops[MASK].id]
    return any(op.name in SAMPLING_OPS for op in frame.ops[max(0, pos - SAMPLING_LOOKBACK) : pos])


def eligible(site: AttentionSite) -> bool:
    """True when the occurrence is a masked softmax this rule reports."""
    m = site.match
    if MASK not in m.ops or SOFTMAX not in m.ops or _is_sampling(site):
        return False
    # without the q @ k^T in the same function, ask for attention-shaped scores ([..., heads, q, k])
    if QK not in m.ops:
        scores = m.ops[SOFTMAX].input_shapes[0] or []
        return len(scores) >= 3
    return True


def chain_ops(site: AttentionSite) -> list:
    return [site.match.ops[x] for x in site.match.ran(LABELS)]


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    groups: dict[tuple, list[AttentionSite]] = defaultdict(list)
    for site in attention_sites(ix):
        if eligible(site):
            line, end = site.span(*LABELS)
            groups[(site.path, line, end)].append(site)
    findings: list[Finding] = []
    for (path, line, end), sites in groups.items():
        occurrences = [chain_ops(s) for s in sites]
        first = sites[0].match
        if ix.gpu and sum(ix.kernel_count(op) for op in occurrences[0]) < 2:
            continue  # already one kernel (or none): nothing to fuse
        head = " -> ".join(_word(label, first.ops[label]) for label in first.ran(LABELS))
        total_us = ix.site_cost_us(op for occ in occurrences for op in occ)
        n_fwd = sum(ix.kernel_count(op) for op in occurrences[0]) if ix.gpu else len(occurrences[0])
        saving = ix.per_step_ms(total_us) * (1 - 1 / n_fwd) if ix.gpu and n_fwd > 1 else None
        facts = attention_facts(sites[0], FACT_LABELS)
        notes = []
        if facts.fill_value == float("-inf"):
            notes.append(
                "fill is -inf: a fully masked row gives NaN in the original; the fused kernel gives 0"
            )
        if DROPOUT in first.ops:
            notes.append("the fused dropout draws its own random mask: losses agree in distribution")
        findings.append(
            build_finding(
                ix,
                rule=ID,
                fix=FIX,
                path=path,
                line=line,
                end_line=end,
                function=first.frame.function,
                occurrences=occurrences,
                head=head,
                fused_kernels=1,
                est_saving_ms=saving,
                advice="one fused kernel: opadvisor.kernels.masked_softmax (opadvisor apply --rule fused_softmax)",
                details=facts.to_details(),
                notes=notes,
            )
        )
    return findings


def _word(label: str, op) -> str:
    if label == MASK:
        return "masked_fill" if "masked_fill" in op.name else "+ mask"
    if label == ZERO:
        return "masked_fill(0)"
    return {SOFTMAX: "softmax", DROPOUT: "dropout"}[label]
