"""16-bit matrix products whose M, N or K is not a multiple of 8.

What it finds
    Matrix products (linear, matmul, mm, addmm, bmm, baddbmm, and their backward) that run in float16 or
    bfloat16 with a dimension that is not a multiple of 8, and where that size comes from: the
    `nn.Linear(in_features, out_features)` that was built with it (file:line of the construction), a
    vocabulary size (an `nn.Embedding` whose weight is used as the output head), or the batch / sequence
    rows. On a GPU profile it reports only products that run measurably slower than the aligned products
    of the same run, with the measured time. float32 products are `fp32_gemm`'s business, not this rule's.

Why it is slow
    Tensor cores read tiles whose rows must start on 16-byte boundaries; an odd size forces cuBLAS onto
    slower kernels or padding paths. On an H200, bf16 8192x8192xK ran at 682 TFLOP/s for K=4096 and 144
    for K=4095 (4.7x slower); a 30522-wide LM head ran 2.5x slower than a 30528-wide one.

Example
    self.lm_head = nn.Linear(hidden, 30522)      # vocabulary of BERT

Fix and its safety
    For an nn.Linear: `opadvisor apply --rule gemm_align` builds a padded linear (out_features rounded up
    to a multiple of 8, the extra rows zero) that slices its output back: the same function, safe. For a
    vocabulary or batch size the fix is yours to make (pad the vocabulary / pick a batch size that is a
    multiple of 8): display-only.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from opadvisor.profile.model import Construction, Op, Profile
from opadvisor.rules._chains import GEMM_OPS, in_dtype, is_16bit, matmul_mnk, names
from opadvisor.rules._findings import build_finding, fmt_ms
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules.facts import Facts, absent_as
from opadvisor.rules.finding import Finding

ID = "gemm_align"
TITLE = "Misaligned 16-bit matrix products"
FIX = "safe"
FIX_CAVEAT = "none for a vocabulary or batch size (display only)"

ALIGN = 8
MIN_ELEMENTS = 1 << 18  # batch*M*N*K below this: too small to matter, whatever the alignment
SLOW_RATIO = 0.8  # on a GPU, report only products slower than this fraction of the aligned rate
# H200 anchors for when the profile has no aligned product to compare with (see DESIGN.md)
ANCHOR_SLOWDOWN = {"K": 4.7, "N": 2.5, "M": 2.5}
LEAF_GEMMS = names("mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm")


_KIND_ONLY = "only the findings of the kinds that name it carry it (`GemmAlignFacts.KIND_FIELDS`)"


@dataclass(kw_only=True)
class GemmAlignFacts(Facts):
    """What a gemm_align finding carries, by the origin of the odd size (`kind`): an nn.Linear's features
    (the codemod pads them to `pad_to`), an nn.Embedding's vocabulary, the rows of a batch, or a size
    computed in the function; `odd`: the dimensions ("M", "N", "K") that are not multiples of 8."""

    RULES = ("gemm_align",)
    KIND_FIELDS = {
        "shape": ("kind", "odd"),
        "linear": (
            "kind", "in_features", "out_features", "pad_to", "padded_in_features", "padded_out_features", "odd",
            "module",
        ),
        "vocab": ("kind", "num_embeddings", "pad_to", "padded", "construction", "odd"),
        "batch": ("kind", "rows", "batch_size", "odd"),
    }  # fmt: skip
    kind: Literal["shape", "linear", "vocab", "batch"] = "shape"
    in_features: int | None = absent_as(None, _KIND_ONLY)
    out_features: int | None = absent_as(None, _KIND_ONLY)
    num_embeddings: int | None = absent_as(None, _KIND_ONLY)
    pad_to: int | None = absent_as(None, _KIND_ONLY)
    padded_in_features: int | None = absent_as(None, _KIND_ONLY)
    padded_out_features: int | None = absent_as(None, _KIND_ONLY)
    padded: int | None = absent_as(None, _KIND_ONLY)
    construction: list[str | int | None] | None = absent_as(None, _KIND_ONLY)  # [path, line]
    rows: int | None = absent_as(None, _KIND_ONLY)
    batch_size: int | None = absent_as(None, _KIND_ONLY)
    odd: list[str] = field(default_factory=list)
    module: str | None = absent_as(None, _KIND_ONLY)

    def unwritten(self) -> frozenset[str]:
        return frozenset(f.name for f in fields(self) if f.name not in self.KIND_FIELDS[self.kind])


def pad(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _dtype(ix: ProfileIndex, op: Op) -> str | None:
    """The dtype the product ran in: under autocast the root op sees fp32 and its mm child bf16."""
    for sub in [op, *ix.descendants(op)]:
        if sub.name in GEMM_OPS and is_16bit(in_dtype(sub)):
            return in_dtype(sub)
    return in_dtype(op)


def _flops(mnk: tuple[int, int, int, int]) -> float:
    b, m, n, k = mnk
    return 2.0 * b * m * n * k


def _odd(mnk: tuple[int, int, int, int]) -> list[str]:
    _, m, n, k = mnk
    return [name for name, v in (("M", m), ("N", n), ("K", k)) if v % ALIGN]


def _constructions(
    profile: Profile,
) -> tuple[dict[str, Construction], list[Construction], Construction | None]:
    linear_by_module: dict[str, Construction] = {}
    embeddings: list[Construction] = []
    loader = None
    for c in profile.constructions:
        if c.kind == "module" and c.cls.endswith("Linear") and c.module is not None:
            linear_by_module[c.module] = c
        elif c.kind == "module" and c.cls.endswith("Embedding"):
            embeddings.append(c)
        elif c.kind == "dataloader" and loader is None:
            loader = c
    return linear_by_module, embeddings, loader


def _where(c: Construction) -> str:
    return f"{Path(c.file).name}:{c.line}" if c.file else "its construction"


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    linear_by_module, embeddings, loader = _constructions(profile)
    candidates, aligned_rates = _candidates(ix)
    # group by origin: the Linear construction, the vocabulary, or the call site
    groups: dict[tuple, list[tuple[Op, tuple[int, int, int, int], str]]] = defaultdict(list)
    origins: dict[tuple, dict] = {}
    for op, mnk, dtype in candidates:
        key, origin = _origin(op, mnk, linear_by_module, embeddings, loader)
        groups[key].append((op, mnk, dtype))
        origins.setdefault(key, origin)

    findings: list[Finding] = []
    for key, items in groups.items():
        origin = origins[key]
        if origin["path"] is None or origin["line"] is None:
            continue  # ran outside the user's code and no construction names it
        op0, mnk, dtype = items[0]
        ops = [op for op, _, _ in items]
        odd = _odd(mnk)
        measured = _saving(ix, items, aligned_rates) if ix.gpu else (None, None)
        if measured is None:
            continue
        saving, basis_note = measured
        b, m, n, k = mnk
        dims = f"{m}x{n}x{k}" + (f" (batch {b})" if b > 1 else "")
        head = f"{_short(op0.name)} {dims} in {dtype}: {', '.join(f'{d}={dict(M=m, N=n, K=k)[d]}' for d in odd)} not a multiple of {ALIGN} ({origin['words']})"
        notes = [basis_note] if basis_note else []
        if saving is not None:
            notes.append(f"padding would save about {fmt_ms(saving)}/step")
        f = build_finding(
            ix,
            rule=ID,
            fix=origin["fix"],
            path=origin["path"],
            line=origin["line"],
            end_line=origin["end_line"],
            function=origin.get("function") or op0.function,
            occurrences=[[op] for op in ops],
            head=head,
            fused_kernels=None,
            est_saving_ms=saving,
            advice=origin["advice"],
            details=origin["details"].to_details(),
            notes=notes,
        )
        findings.append(f)
    return findings


def _candidates(
    ix: ProfileIndex,
) -> tuple[list[tuple[Op, tuple[int, int, int, int], str]], list[tuple[float, float]]]:
    """(the misaligned 16-bit matrix products large enough to matter, with their sizes and dtype; the
    (flops, flop/us) of the aligned 16-bit ones, measured on a GPU)."""
    candidates: list[tuple[Op, tuple[int, int, int, int], str]] = []
    aligned_rates: list[tuple[float, float]] = []  # (flops, flop/us) of aligned 16-bit products
    for op in ix.forward_roots(sorted(GEMM_OPS)):
        mnk = matmul_mnk(op)
        dtype = _dtype(ix, op)
        if mnk is None or not is_16bit(dtype) or math.prod(mnk) < MIN_ELEMENTS:
            continue
        if _odd(mnk):
            candidates.append((op, mnk, dtype))
        elif ix.gpu and op.gpu_time_us:
            aligned_rates.append((_flops(mnk), _flops(mnk) / op.gpu_time_us))
    return candidates, aligned_rates


def _saving(
    ix: ProfileIndex,
    items: list[tuple[Op, tuple[int, int, int, int], str]],
    aligned_rates: list[tuple[float, float]],
) -> tuple[float | None, str | None] | None:
    """(the saving per step padding would bring, how it was judged) on a GPU; None when there is nothing to
    gain (no time measured, or the products run as fast as the aligned ones)."""
    ops = [op for op, _, _ in items]
    mnk = items[0][1]
    measured = sum(op.gpu_time_us or 0.0 for op in ops)
    if measured <= 0:
        return None
    rate = sum(_flops(m) for _, m, _ in items) / measured
    ref = _reference_rate(aligned_rates, _flops(mnk))
    if ref is not None:
        if rate >= SLOW_RATIO * ref:
            return None  # runs as fast as the aligned products: nothing to gain
        fraction = 1 - rate / ref
        basis_note = f"{rate / 1e6:.0f} TFLOP/s here against {ref / 1e6:.0f} for aligned products in this run"
    else:
        odd = _odd(mnk)
        slowdown = max(ANCHOR_SLOWDOWN[d] for d in odd)
        fraction = 1 - 1 / slowdown
        basis_note = f"estimate from an H200 measurement: {'/'.join(odd)} misaligned ran {slowdown}x slower"
    return ix.per_step_ms(ix.site_cost_us(ops)) * fraction, basis_note


def _short(name: str) -> str:
    return name.rsplit("::", 1)[-1]


def _reference_rate(aligned: list[tuple[float, float]], flops: float) -> float | None:
    """Median rate of aligned products of comparable size (within 8x in FLOPs), None when there are none."""
    near = [r for f, r in aligned if flops / 8 <= f <= flops * 8]
    return statistics.median(near) if near else None


def _origin(op: Op, mnk, linear_by_module, embeddings, loader) -> tuple[tuple, dict]:
    _, m, n, k = mnk
    odd = _odd(mnk)
    lin = linear_by_module.get(op.module) if op.name == "aten::linear" and op.module is not None else None
    if lin is not None and ("N" in odd or "K" in odd):
        return _linear_origin(op, lin, n, k, odd)
    for emb in embeddings:
        vocab = emb.attrs.get("num_embeddings")
        if vocab is not None and vocab % ALIGN and vocab in (n, k):
            return _vocab_origin(op, emb, vocab, odd)
    if odd == ["M"]:
        return _rows_origin(op, m, loader, odd)
    return ("shape", op.file, op.line), {
        "words": "a size computed in this function",
        "fix": "none",
        "path": op.file,
        "line": op.line,
        "end_line": op.line,
        "advice": "pad the odd dimension to a multiple of 8 (zeros in K; slice extra outputs of N/M)",
        "details": GemmAlignFacts(kind="shape", odd=odd),
    }


def _linear_origin(op: Op, lin, n: int, k: int, odd: list[str]) -> tuple[tuple, dict]:  # noqa: ANN001
    """An nn.Linear whose in or out features are misaligned: padded by the codemod (safe)."""
    in_f, out_f = lin.attrs.get("in_features", k), lin.attrs.get("out_features", n)
    end = lin.line
    return ("linear", lin.file, lin.line), {
        "words": f"nn.Linear({in_f}, {out_f}) built at {_where(lin)}",
        "fix": "safe",
        "path": lin.file or op.file,
        "line": lin.line or op.line,
        "end_line": end or op.line,
        "function": lin.function,
        "advice": f"pad the Linear to {pad(in_f)} x {pad(out_f)} (opadvisor apply --rule gemm_align: a padded "
        "linear that slices its output)",
        "details": GemmAlignFacts(
            kind="linear",
            in_features=in_f,
            out_features=out_f,
            pad_to=ALIGN,
            padded_in_features=pad(in_f),
            padded_out_features=pad(out_f),
            odd=odd,
            module=lin.module,
        ),
    }


def _vocab_origin(op: Op, emb, vocab: int, odd: list[str]) -> tuple[tuple, dict]:  # noqa: ANN001
    """A vocabulary size (an nn.Embedding's) that is misaligned: advice only."""
    return ("vocab", emb.file, emb.line, op.file, op.line), {
        "words": f"vocabulary size {vocab} of the nn.Embedding built at {_where(emb)}",
        "fix": "none",
        "path": op.file,
        "line": op.line,
        "end_line": op.line,
        "advice": f"pad the vocabulary to {pad(vocab, 64)} (unused rows are never predicted when masked)",
        "details": GemmAlignFacts(
            kind="vocab",
            num_embeddings=vocab,
            pad_to=ALIGN,
            padded=pad(vocab, 64),
            construction=[emb.file, emb.line],
            odd=odd,
        ),
    }


def _rows_origin(op: Op, m: int, loader, odd: list[str]) -> tuple[tuple, dict]:  # noqa: ANN001
    """Misaligned rows (batch x sequence), named by the DataLoader's batch size where that is odd."""
    batch = loader.attrs.get("batch_size") if loader is not None else None
    words = f"{m} rows (batch x sequence)"
    if isinstance(batch, int) and batch % ALIGN:
        words = f"{m} rows: batch size {batch} of the DataLoader at {_where(loader)}"
    return ("rows", op.file, op.line), {
        "words": words,
        "fix": "none",
        "path": op.file,
        "line": op.line,
        "end_line": op.line,
        "advice": "use a batch size (or sequence length) whose product is a multiple of 8",
        "details": GemmAlignFacts(kind="batch", rows=m, batch_size=batch, odd=odd),
    }
