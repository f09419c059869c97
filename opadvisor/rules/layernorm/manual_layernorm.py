"""Layer norm written by hand as mean / variance / square root / divide ops.

What it finds
    In one function, in the order they ran: a mean over one or more dimensions (usually the last) kept as
    size-1 dimensions, the input minus that mean, a variance (the mean of the squared difference, or
    `x.var(...)` / `x.std(...)` / `torch.var_mean(...)`), an `eps` added, a square root (or `rsqrt`), the
    division (or multiplication by the reciprocal), and optionally an affine `weight * x + bias` whose
    shapes are the normalised dimensions. The ops are tied together by their shapes: the mean has the
    input's shape with the reduced dimensions set to 1, the weight and bias the shape of the reduced
    dimensions. It works on CPU profiles too (it reads op names and shapes, not kernels).

Why it is slow
    Each op is its own kernel reading (and most writing) the whole activation: six to nine passes over a
    [tokens, hidden] tensor forward and about as many again backward, where `F.layer_norm` makes one
    pass forward and one or two backward. On a GPU these are memory-bound kernels, so the time scales with
    the number of passes.

Example
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    x = (x - u) / torch.sqrt(s + self.eps)
    return self.weight * x + self.bias

Fix and its safety
    `torch.nn.functional.layer_norm(x, x.shape[-k:], weight, bias, eps)` (k reduced trailing dims).
    Safe when the hand-written version computes the same function: a biased variance (`.mean()` of the
    squares, `var(unbiased=False)` / `correction=0`), eps inside the square root, reduction over the last
    dimension(s). Unsafe, and said so in the finding, where it is not: an unbiased `std`/`var` (the default
    of `torch.std` and `torch.var`), eps added to the standard deviation instead of the variance (the
    Annotated Transformer's `(x - mean) / (std + eps)`), or normalisation over another dimension
    (`F.layer_norm` would need a transpose). A full reduction of a whole tensor (`x.mean()` with no dim)
    is not reported.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._chains import PASS_THROUGH_OPS, names, scalar, scalar_float, shape
from opadvisor.rules._findings import build_finding
from opadvisor.rules._index import Frame, ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source, locate_each
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Finding


@dataclass
class LayerNormFacts(Facts):
    """What a manual_layernorm finding carries to its fix (see opadvisor.rules.facts): the normalized shape
    and the dims reduced (counted from the end), how the variance was taken ("var" / "std", "_unbiased"),
    where eps went ("none", "inside_sqrt", "outside_sqrt"), rsqrt, whether a weight and a bias were
    applied, whether it is the same function as F.layer_norm (and why not), the input dtype."""

    RULES = ("manual_layernorm",)

    normalized_shape: list[int] | None = None
    reduce_dims: list[int] = field(default_factory=list)
    variance: str = "var"
    eps: str = "none"
    rsqrt: bool = False
    weight: bool = False
    bias: bool = False
    equivalent: bool = True
    not_equivalent_because: list[str] = field(default_factory=list)
    dtype: str | None = None


ID = "manual_layernorm"
TITLE = "Layer norm written as mean/var/sqrt ops"
FIX = "safe"
FIX_CAVEAT = "unsafe where it is not the same function (unbiased variance, eps outside the root)"

ANCHORS = names("mean", "var_mean", "std_mean")
VAR_OPS = names("var", "std")
WINDOW = 20  # ops after the mean in which the rest must run
MAX_STRAY = 3  # unrelated (non pass-through) ops tolerated inside the pattern


@dataclass
class _Match:
    frame: Frame
    ops: list[Op] = field(default_factory=list)  # the pattern's ops, in the order they ran
    roles: dict[str, Op] = field(default_factory=dict)
    x_shape: list[int] = field(default_factory=list)
    reduced: list[int] = field(default_factory=list)  # dims the mean ran over (non-negative)
    unbiased: bool = False
    std: bool = False  # the variance op was a standard deviation (its own square root)
    eps_outside: bool = False  # eps added after the square root
    rsqrt: bool = False


def _keepdim_shape(r: list[int] | None, s: list[int]) -> list[int] | None:
    """The dims `r` reduced when it is `s` with some dims set to 1 (kept), else None."""
    if r is None or len(r) != len(s) or r == s:
        return None
    dims = []
    for i, (a, b) in enumerate(zip(r, s, strict=True)):
        if a == b and not (a == 1 and b == 1):
            continue
        if a != 1:
            return None
        dims.append(i)
    return dims or None


def _is_scalar_like(op: Op, i: int) -> bool:
    """Input i is a Python number (recorded as a scalar or a 0-dim tensor) or a one-element tensor."""
    s = shape(op, i)
    if s is None:
        return scalar(op, i) is not None or i >= len(op.input_shapes)
    return s in ([], [1])


def _biased(op: Op) -> bool:
    """aten::var / std / var_mean (self, dim, unbiased | correction, keepdim): True when it divides by N."""
    v = scalar(op, 2)
    if v is None:
        return False  # correction=None: the default, 1
    if isinstance(v, bool):
        return not v
    return scalar_float(op, 2) == 0.0


def _suffix_param(w: list[int] | None, s: list[int], dims: list[int]) -> bool:
    """`w` (weight or bias) has the shape of the normalised trailing dims of `s` (leading 1s allowed)."""
    if w is None or not w or w == s or len(w) > len(s):
        return False
    core = list(w)
    while len(core) > 1 and core[0] == 1:
        core.pop(0)
    n = len(s)
    return core == s[n - len(core) :] and dims == list(range(n - len(core), n))


def _scan(frame: Frame, i: int) -> tuple[_Match | None, int]:
    """Try the pattern from the anchor at position i; return (match or None, position to resume at)."""
    ops = frame.ops
    anchor = ops[i]
    s = shape(anchor, 0)
    if not s or (anchor.name == "aten::mean" and len(anchor.input_shapes) < 3):
        return None, i + 1  # x.mean() over everything (no dim argument): not a layer norm
    m = _Match(frame, [anchor], {"mean": anchor}, list(s))
    if anchor.name != "aten::mean":  # var_mean / std_mean: variance and mean in one op
        m.roles["var"] = anchor
        m.unbiased = not _biased(anchor)
        m.std = anchor.name == "aten::std_mean"
    else:
        _variance_before(frame, i, m)
    centers = stray = 0
    last = i
    j = i + 1
    while j < len(ops) and j <= i + WINDOW:
        op = ops[j]
        role = _role(op, m, centers)
        if role == "stop":
            break
        if role is None:
            if op.name not in PASS_THROUGH_OPS:
                stray += 1
                if stray > MAX_STRAY:
                    break
            j += 1
            continue
        if role == "center":
            centers += 1
        else:
            m.roles[role] = op
        m.ops.append(op)
        last = j
        j += 1
    ok = centers > 0 and "var" in m.roles and "norm" in m.roles and ("sqrt" in m.roles or m.std)
    if not ok or not m.reduced:
        return None, i + 1
    return m, last + 1


def _variance_before(frame: Frame, i: int, m: _Match) -> None:
    """A variance of the same input that ran just before the mean (lucidrains' `var = torch.var(x, ...)`
    then `mean = torch.mean(x, ...)`) joins the match, first in its ops."""
    for j in range(i - 1, max(-1, i - 1 - MAX_STRAY), -1):
        op = frame.ops[j]
        if op.name in VAR_OPS and shape(op, 0) == m.x_shape:
            m.roles["var"] = op
            m.ops.insert(0, op)
            m.unbiased = not _biased(op)
            m.std = op.name == "aten::std"
            return
        if op.name not in PASS_THROUGH_OPS or op.name in ANCHORS:
            return


def _role(op: Op, m: _Match, centers: int) -> str | None:
    """The part `op` plays in the layer norm started at m's anchor; None: not part of it; "stop": give up."""
    s, roles, n = m.x_shape, m.roles, op.name
    s0, s1 = shape(op, 0), shape(op, 1)
    if n in ("aten::sub", "aten::sub_") and s0 == s:
        dims = _keepdim_shape(s1, s)
        if dims is None or (m.reduced and dims != m.reduced) or centers >= 2 or "norm" in roles:
            return None
        m.reduced = dims
        return "center"
    if "var" not in roles:
        return _variance_role(op, m, centers)
    return _normalise_role(op, m, centers)


def _variance_role(op: Op, m: _Match, centers: int) -> str | None:
    """`_role` before the variance: the variance itself, or the square it is the mean of."""
    s, roles, n = m.x_shape, m.roles, op.name
    s0, s1 = shape(op, 0), shape(op, 1)
    if s0 != s:
        return None
    if n in VAR_OPS:
        m.unbiased = not _biased(op)
        m.std = n == "aten::std"
        return "var"
    if n == "aten::mean":
        return "var" if "square" in roles else "stop"  # else: the next layer norm's mean
    if n in ANCHORS:
        return "stop"
    if centers and "square" not in roles:
        if n == "aten::pow" and scalar_float(op, 1) in (None, 2.0):
            return "square"
        if n == "aten::square" or (n == "aten::mul" and s1 == s):
            return "square"
    return None


def _normalise_role(op: Op, m: _Match, centers: int) -> str | None:
    """`_role` after the variance: eps, the square root, the normalisation, the weight and the bias."""
    s, roles, n = m.x_shape, m.roles, op.name
    s0, s1 = shape(op, 0), shape(op, 1)
    if n in ANCHORS and s0 == s:
        return "stop"
    if not m.reduced:  # variance before the centring (`mean, std, x - mean`): learn the kept shape
        for t in (s0, s1):
            dims = _keepdim_shape(t, s) if n in ("aten::add", "aten::sqrt", "aten::rsqrt") else None
            if dims is not None:
                m.reduced = dims
                break
        if not m.reduced:
            return None
    kept = [1 if d in m.reduced else v for d, v in enumerate(s)]
    if n == "aten::add" and "eps" not in roles:
        if (s0 == kept and _is_scalar_like(op, 1)) or (s1 == kept and _is_scalar_like(op, 0)):
            m.eps_outside = "sqrt" in roles or m.std
            return "eps"
    if n in ("aten::sqrt", "aten::rsqrt") and s0 == kept and "sqrt" not in roles and not m.std:
        m.rsqrt = n == "aten::rsqrt"
        return "sqrt"
    if n == "aten::pow" and s0 == kept and "sqrt" not in roles and not m.std:
        e = scalar_float(op, 1)
        if e in (0.5, -0.5):
            m.rsqrt = e < 0
            return "sqrt"
        return None
    if "norm" not in roles and ("sqrt" in roles or m.std):
        if n == "aten::div" and s0 == s and s1 == kept:
            return "norm"
        if n == "aten::mul" and m.rsqrt and ((s0 == s and s1 == kept) or (s0 == kept and s1 == s)):
            return "norm"
    if centers and n == "aten::mul" and "weight" not in roles:
        if (s0 == s and _suffix_param(s1, s, m.reduced)) or (s1 == s and _suffix_param(s0, s, m.reduced)):
            return "weight"
    if n == "aten::add" and "bias" not in roles and "norm" in roles:
        if (s0 == s and _suffix_param(s1, s, m.reduced)) or (s1 == s and _suffix_param(s0, s, m.reduced)):
            return "bias"
    return None


def _find(frame: Frame) -> list[_Match]:
    out: list[_Match] = []
    i = 0
    ops = frame.ops
    while i < len(ops):
        if ops[i].name in ANCHORS:
            m, nxt = _scan(frame, i)
            if m is not None:
                out.append(m)
            i = nxt
        else:
            i += 1
    return out


def _judge(m: _Match) -> tuple[bool, list[str]]:
    """(equivalent to F.layer_norm, reasons it is not)."""
    reasons: list[str] = []
    n = len(m.x_shape)
    trailing = m.reduced == list(range(n - len(m.reduced), n))
    if not trailing:
        reasons.append(
            f"it normalises over dim {', '.join(str(d - n) for d in m.reduced)}, not the last "
            "dimension(s): F.layer_norm needs the dimension moved last"
        )
    if m.unbiased:
        reasons.append(
            f"it uses the unbiased {'std' if m.std else 'variance'} (divides by N-1); F.layer_norm divides by N"
        )
    if m.eps_outside:
        reasons.append(
            "eps is added to the standard deviation, outside the square root; F.layer_norm adds it to the variance"
        )
    return not reasons, reasons


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    findings: list[Finding] = []
    for (path, line, end, function), matches in _sites(profile, ix).items():
        first = matches[0]
        safe, reasons = _judge(first)
        n = len(first.x_shape)
        trailing = first.reduced == list(range(n - len(first.reduced), n))
        normalized_shape = first.x_shape[n - len(first.reduced) :] if trailing else None
        occurrences = [m.ops for m in matches]
        saving = None
        if ix.gpu:
            kernels = ix.site_kernels(first.ops)
            total_ms = ix.per_step_ms(ix.site_cost_us(op for m in matches for op in m.ops))
            # F.layer_norm: one kernel forward, about two backward
            saving = total_ms * max(0.0, 1 - 3 / kernels) if kernels else None
        chain = " -> ".join(op.name.rsplit("::", 1)[-1] for op in first.ops)
        advice = _advice(first, n, trailing)
        if not safe:
            advice += ": not the same function here, " + "; ".join(reasons)
        findings.append(
            build_finding(
                ix,
                rule=ID,
                fix="safe" if safe else "unsafe",
                path=path,
                line=line,
                end_line=end,
                function=function,
                occurrences=occurrences,
                head=f"hand-written layer norm ({chain})",
                fused_kernels=1,
                est_saving_ms=saving,
                advice=advice,
                details=LayerNormFacts(
                    normalized_shape=normalized_shape,
                    reduce_dims=[d - n for d in first.reduced],
                    variance=("std" if first.std else "var") + ("_unbiased" if first.unbiased else ""),
                    eps="none"
                    if "eps" not in first.roles
                    else ("outside_sqrt" if first.eps_outside else "inside_sqrt"),
                    rsqrt=first.rsqrt,
                    weight="weight" in first.roles,
                    bias="bias" in first.roles,
                    equivalent=safe,
                    not_equivalent_because=reasons,
                    dtype=first.ops[0].input_dtypes[0] if first.ops[0].input_dtypes else None,
                ).to_details(),
                notes=reasons,
            )
        )
    return findings


def _sites(profile: Profile, ix: ProfileIndex) -> dict[tuple, list[_Match]]:
    """The layer norms found, by (file, first line, last line, function)."""
    groups: dict[tuple, list[_Match]] = defaultdict(list)
    for frame in ix.frames:
        for m in _find(frame):
            src = load_profiled_source(profile, frame.file)
            spans = [s for s in (locate_each(src, m.ops) if src is not None else []) if s is not None]
            if spans:
                line, end = min(a for a, _ in spans), max(b for _, b in spans)
            else:
                lines = [o.line for o in m.ops if o.line is not None]
                if not lines:
                    continue
                line, end = min(lines), max(lines)
            groups[(frame.file, line, end, frame.function)].append(m)
    return groups


def _advice(first: _Match, n: int, trailing: bool) -> str:
    """F.layer_norm over the reduced trailing dims; otherwise move them last first."""
    affine = [r for r in ("weight", "bias") if r in first.roles]
    params = "".join(f", {r}" for r in affine)
    if trailing:
        return (
            f"use torch.nn.functional.layer_norm(x, x.shape[-{len(first.reduced)}:]{params}, eps=...) "
            "(or nn.LayerNorm)"
        )
    dims = ", ".join(str(d - n) for d in first.reduced)
    return (
        f"move dim {dims} last and use torch.nn.functional.layer_norm on it "
        f"(x.movedim({first.reduced[0] - n}, -1) ... .movedim(-1, {first.reduced[0] - n}))"
        if len(first.reduced) == 1
        else f"normalising over dims {dims} needs them moved last before torch.nn.functional.layer_norm"
    )


__all__ = ["FIX", "ID", "TITLE", "LayerNormFacts", "detect"]
