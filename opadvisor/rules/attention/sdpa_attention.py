"""Attention written by hand: q @ k^T, scale, mask, softmax, dropout, @ v as separate kernels.

What it finds
    The whole attention in one function, in the order it ran: a matrix product giving the scores,
    optionally a scale and a mask (masked_fill or an additive mask), softmax over the last dim,
    optionally zeroing and dropout, and the product with the values. Code that already calls
    `F.scaled_dot_product_attention` runs none of these ops and is not reported.

Why it is slow
    The [batch, heads, seq, seq] score matrix is written to memory and read back by every op, forward and
    backward, and kept alive for the backward pass. `scaled_dot_product_attention` dispatches to a fused
    (flash / memory-efficient) kernel that never materialises it. On an H200, a BERT-base training step
    (seq 512, bf16) went from 59.0 ms to 29.2 ms with this change alone.

Example
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores + mask
    probs = self.dropout(F.softmax(scores, dim=-1))
    ctx = probs @ v

Fix and its safety
    Replace the lines with `F.scaled_dot_product_attention(q, k, v, attn_mask=..., dropout_p=...,
    scale=...)` (`opadvisor apply --rule sdpa_attention`). Safe when nothing else reads the probabilities:
    the same function up to rounding (dropout draws its own random mask). Unsafe when the original zeroes
    masked probabilities after softmax (fully masked rows then differ) — it is applied only with --unsafe.
    The softmax part alone is `fused_softmax`, reported on the same lines: apply one of the two.
"""

from __future__ import annotations

from collections import defaultdict

from opadvisor.profile.model import Profile
from opadvisor.rules._attention import ATTENTION_LABELS, SAMPLING_OPS, AttentionSite, attention_sites
from opadvisor.rules._chains import GEMM_OPS
from opadvisor.rules._findings import build_finding
from opadvisor.rules._index import index_of
from opadvisor.rules.attention import attention_facts
from opadvisor.rules.finding import Finding
from opadvisor.rules.patterns import DROPOUT, MASK, PV, QK, SCALE, SOFTMAX, ZERO

ID = "sdpa_attention"
TITLE = "Hand-written attention"
FIX = "safe"
FIX_CAVEAT = "unsafe where masked rows are zeroed after softmax"
ALTERNATIVES = ("fused_softmax",)


def eligible(site: AttentionSite) -> bool:
    m = site.match
    if not all(x in m.ops for x in (QK, SOFTMAX, PV)):
        return False
    frame = m.frame
    pos = frame.positions[m.ops[QK].id]
    return not any(op.name in SAMPLING_OPS for op in frame.ops[max(0, pos - 40) : pos])


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    groups: dict[tuple, list[AttentionSite]] = defaultdict(list)
    for site in attention_sites(ix):
        if eligible(site):
            line, end = site.span()
            groups[(site.path, line, end)].append(site)
    findings: list[Finding] = []
    for (path, line, end), sites in groups.items():
        first = sites[0].match
        labels = first.ran(ATTENTION_LABELS)
        occurrences = [[s.match.ops[x] for x in labels] for s in sites]
        if ix.gpu and sum(ix.kernel_count(op) for op in occurrences[0]) < 2:
            continue  # ran on the CPU in a GPU profile, or already fused: nothing to measure or fuse
        elementwise = [[op for op in occ if op.name not in GEMM_OPS] for occ in occurrences]
        saving = None
        if ix.gpu:
            saving = ix.per_step_ms(ix.site_cost_us(op for occ in elementwise for op in occ))
        zero = ZERO in first.ops
        facts = attention_facts(sites[0], ATTENTION_LABELS)
        notes = []
        if zero:
            notes.append(
                "the original zeroes masked probabilities after softmax: fully masked rows may differ"
            )
        head = "attention by hand (" + " -> ".join(_word(x, first.ops[x]) for x in labels) + ")"
        findings.append(
            build_finding(
                ix,
                rule=ID,
                fix="unsafe" if zero else FIX,
                path=path,
                line=line,
                end_line=end,
                function=first.frame.function,
                occurrences=occurrences,
                head=head,
                fused_kernels=1,
                est_saving_ms=saving,
                advice="F.scaled_dot_product_attention (opadvisor apply --rule sdpa_attention)",
                details=facts.to_details(),
                notes=notes,
            )
        )
    return findings


def _word(label: str, op) -> str:
    words = {
        QK: "q@k",
        SCALE: "scale",
        SOFTMAX: "softmax",
        ZERO: "masked_fill(0)",
        DROPOUT: "dropout",
    }
    if label == MASK:
        return "masked_fill" if "masked_fill" in op.name else "+ mask"
    if label == PV:
        return "@v"
    return words[label]
