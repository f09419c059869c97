"""Hot regions of memory-bound kernels: hand-written activations, dropout, gathers and elementwise chains.

What it finds
    Places in the source (a function, or a run of lines inside one; a model's own code or, through its
    call site, a library's) whose GPU time goes to chains of memory-bound kernels: elementwise ops,
    reductions, gathers and scatters, casts, random masks, with no matrix product inside. Each run of such
    ops in one call of one function is a region; its runs in every layer and step are added up and the
    regions ranked by measured time (forward and backward). A region whose ops another rule fixes as a
    pattern (fused_softmax, sdpa_attention, fused_dropout_add, manual_layernorm, fused_cross_entropy)
    is left to that rule. Recognised chains are named: a tanh or erf GELU written by hand, SiLU,
    x * sigmoid(1.702 x) (QuickGELU), dropout written by hand (a `rand`/`bernoulli` mask, `masked_fill`
    or a multiply, the 1/(1-p) scale; inline or in an autograd Function), DeBERTa's relative-position
    gather with its clamp and scaling. On a CPU profile the op chain is the same, so the named chains are
    found there too (with CPU times).

Why it is slow
    Each kernel of the chain reads its inputs from memory and writes its output back: a tanh GELU written
    by hand is 8 kernels forward and about 12 backward over the [tokens, 4 x hidden] activation, where one
    kernel reading x and writing y would do. Such kernels run at the memory's speed, so the time scales
    with the passes; when they are short, with the launches. The finding gives the floor: the bytes one
    fused kernel must still read and write (an estimate from the shapes the profile recorded), at the copy
    bandwidth `opadvisor profile` measured on the device.

Example
    def new_gelu(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

Fix and its safety
    `opadvisor apply --rule fuse_region`, best first:
    - an exact equivalent where one exists: tanh GELU -> `F.gelu(x, approximate="tanh")`, erf GELU ->
      `F.gelu(x)`, SiLU -> `F.silu(x)`, QuickGELU -> `opadvisor.kernels.quick_gelu(x)` (one kernel each
      way); safe, the same function up to rounding. Dropout written by hand -> `opadvisor.kernels.dropout`:
      safe, the same distribution (kept with probability 1-p, scaled by 1/(1-p)) from a different random
      stream, so losses agree in distribution, not bit for bit;
    - DeBERTa's relative-position scores -> `opadvisor.kernels.disentangled_bias` (one kernel each way);
    - any other region: the function it is in is compiled on its own (`@opadvisor.kernels.compile_region`,
      regional torch.compile), which fuses the chain even where compiling the whole model fails; if
      compiling fails it prints one line and runs the original. Safe (floating-point order may differ). A
      region inside an autograd.Function (DeBERTa's XSoftmax) is compiled with the functions that call it.
    A region at a script's top level (no function to compile) has no automatic fix.

    In a library model's repeated blocks (transformers' BertLayer x12, GPT2Block, timm's Block,
    nn.TransformerEncoderLayer: `opadvisor.libraries.repeated_blocks`) the memory-bound ops sit between
    matrix products in many small runs (an autocast cast, a GELU, a LayerNorm, a residual add), each too
    short to be a region; what no other finding holds is added up per block class as one region at the
    block's forward (also on a CPU profile, whatever its share of the step there: the module each op ran
    in says it is the model's, and the Python issuing the ops, most of a CPU step, is cut too). Its fix is
    `opadvisor.patch(model, rules=["compile_blocks"])` after the model's construction: each block instance
    runs one compiled forward shared by all (regional torch.compile; see opadvisor/patching/), safe
    as the regional compile is. `opadvisor verify`
    compares losses with dropout disabled; for a replaced hand-written dropout the original it runs has
    the same replacement (which it can disable), so the rest of the rewrite is still checked exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from opadvisor.libraries import block_of, repeated_blocks
from opadvisor.profile.model import Op, Profile
from opadvisor.rules._findings import build_finding, cost_words, fmt_ms
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._library import library_view_path
from opadvisor.rules._regions import (
    CHAIN_LABELS,
    COPY_IF_NEEDED,
    COPY_OPS,
    VIEW_OPS,
    Site,
    bytes_moved,
    find_regions,
    is_compute,
    merge_same_fix,
    op_does_work,
)
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.facts import Facts, absent_as
from opadvisor.rules.finding import Finding
from opadvisor.rules.patterns import DROPOUT, REGION_CHAINS

ID = "fuse_region"
TITLE = "Hot chain of memory-bound kernels"
FIX = "safe"
FIX_CAVEAT = "none for a region at a script's top level (no function to compile)"

# Rules whose patterns are chains of memory-bound ops: their ops are theirs, never a region's.
OWNER_RULES = (
    "fused_softmax",
    "sdpa_attention",
    "fused_dropout_add",
    "manual_layernorm",
    "fused_cross_entropy",
)
_NO_FLOOR = "no floor: a CPU profile, a run without a measured copy bandwidth, or a library block"
_BLOCK_ONLY = "only a library block's finding names its module and block"
_RUN_ONLY = "a library block's ops are many short runs, not one pass: no bytes per run"


@dataclass(kw_only=True)
class FuseRegionFacts(Facts):
    """What a fuse_region finding carries to its fix: the chain the profile saw ("silu", "dropout", ...;
    None for a region of unnamed ops), its function and `def` line, forward and backward kernels (ops on a
    CPU profile: `count_unit`), the bytes one fused pass would move and its floor, the fix in words, and
    for a library block its module and block class."""

    RULES = ("fuse_region",)
    chain: str | None = None
    function: str | None = None
    def_line: int | None = None
    kernels_forward: int = 0
    kernels_backward: int = 0
    count_unit: str = "kernels"
    bytes_per_run: int | None = absent_as(None, _RUN_ONLY)
    runs_per_step: float | None = absent_as(None, _RUN_ONLY)
    copy_bandwidth_gbps: float | None = absent_as(None, _RUN_ONLY)
    floor_ms_per_step: float | None = absent_as(None, _NO_FLOOR)
    fix: str = ""
    module: str | None = absent_as(None, _BLOCK_ONLY)
    block: str | None = absent_as(None, _BLOCK_ONLY)

    def unwritten(self) -> frozenset[str]:
        if self.block is not None:
            return frozenset({"bytes_per_run", "runs_per_step", "copy_bandwidth_gbps", "floor_ms_per_step"})
        return frozenset(
            {"module", "block"} | ({"floor_ms_per_step"} if self.floor_ms_per_step is None else set())
        )


MIN_KERNELS = 3  # a region of unnamed ops needs at least this many kernels (ops on a CPU profile) forward
MIN_SHARE = 0.005  # ... and at least this share of the step
MIN_SHARE_TOP_LEVEL = 0.02  # ... this much at a script's top level, where there is no function to fix
MAX_FINDINGS = 10
OPTIMIZER_MARK = "Optimizer.step"
CAST_OPS = COPY_OPS | COPY_IF_NEEDED  # copies a matrix product's op makes of its inputs (autocast's casts)
# autograd nodes of views: their backward is another view (no kernel)
VIEW_BACKWARD = tuple(
    f"{n}Backward"
    for n in "View UnsafeView Transpose Permute Expand Squeeze Unsqueeze Slice Select Alias T Split "
    "Unbind AsStrided Reshape Detach".split()
)

# chain -> what apply writes, in words (declared in rules/patterns.py); unnamed regions get the regional compile
FIXES = {c.name: c.fix for c in REGION_CHAINS.values()}
COMPILE_FIX = "@opadvisor.kernels.compile_region on {function} (regional torch.compile)"
BLOCK_FIX = (
    'opadvisor.patch(model, rules=["compile_blocks"]): every {block} runs one compiled forward, shared by '
    "its instances (regional torch.compile)"
)


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    owned = _owned_by_other_rules(profile)
    in_optimizer = _in_optimizer_step(profile)
    findings = []
    taken: set[int] = set()  # ops of the regions found: a library block's region leaves them out
    for site in merge_same_fix(find_regions(ix, lambda op: owned(op) or in_optimizer(op))):
        # on a CPU profile every op is work, data preparation included: only the named chains are kept
        f = _finding(ix, site) if ix.gpu or site.chain is not None else None
        if f is not None:
            findings.append(f)
            taken.update(op.id for occ in site.occurrences for op in occ)
    for site in _block_sites(ix, lambda op: op.id in taken or owned(op) or in_optimizer(op)):
        f = _finding(ix, site)
        if f is not None:
            findings.append(f)
    findings.sort(key=lambda f: -(f.time_ms_per_step or 0.0))
    return findings[:MAX_FINDINGS]


def _owned_by_other_rules(profile: Profile) -> Callable[[Op], bool]:
    """A test: does another rule's finding hold this op (its file, function and lines)?"""
    from opadvisor.rules import registry
    from opadvisor.rules.engine import NotApplicable

    spans: dict[str, list[tuple[int, int, str | None]]] = {}
    for rid in OWNER_RULES:
        try:
            found = registry.get_rule(rid).detect(profile)
        except NotApplicable:
            continue
        for f in found:
            spans.setdefault(f.path, []).append((f.line, f.end_line, f.function))

    def owned(op: Op) -> bool:
        if op.file is None or op.line is None:
            return False
        return any(
            a <= op.line <= b and (fn is None or fn == op.function) for a, b, fn in spans.get(op.file, ())
        )

    return owned


def _in_optimizer_step(profile: Profile) -> Callable[[Op], bool]:
    """A test: did this op run inside an optimizer's step (fused_optimizer's and sparse_launch's business)?"""
    spans: dict[int, list[tuple[float, float]]] = {}
    for a in profile.annotations:
        if a.name.startswith(OPTIMIZER_MARK):
            spans.setdefault(a.thread, []).append((a.start_us, a.start_us + a.duration_us))

    def inside(op: Op) -> bool:
        return any(s <= op.start_us <= e for s, e in spans.get(op.thread, ()))

    return inside


def _block_sites(ix: ProfileIndex, skip: Callable[[Op], bool]) -> list[Site]:
    """One site per repeated library block class (BertLayer x12): each call's memory-bound work ops that
    `skip` leaves, at the class's forward. A library class counts when its package ran ops in the profile."""
    view = ix.profile
    blocks = repeated_blocks(view.modules, lambda cls: cls.split(".", 1)[0] in view.libraries)
    runs: dict[tuple, list[Op]] = {}
    for ops in ix.sequences.values():
        for op in ops:
            block = block_of(op.module, blocks)
            if block is not None:  # one call of the block per step and thread (a sequence may end inside it)
                work = [w for w in _block_work(ix, op) if not skip(w)]
                runs.setdefault((op.step, op.thread, block), []).extend(work)
    runs = {key: ops for key, ops in runs.items() if ops}
    by_class: dict[str, list[tuple[str, list[Op]]]] = {}
    for (_, _, block), ops in runs.items():
        by_class.setdefault(blocks[block], []).append((block, ops))
    sites = []
    for cls, calls in by_class.items():
        place = _forward_of(view, cls)
        if place is not None:
            path, span = place
            site = Site(path, span.qualname, span.line, span.line, span.end_line, [ops for _, ops in calls])
            site.block = min((b for b, _ in calls), key=lambda b: (len(b), b))
            sites.append(site)
    return sites


def _block_work(ix: ProfileIndex, op: Op) -> list[Op]:
    """The memory-bound work of one root op in a block: the op itself, or, for a matrix product, the copies
    it made of its inputs (autocast's casts of the weights and activations run inside `aten::linear`)."""
    if op.name in VIEW_OPS:
        return []
    if not is_compute(op):
        return [op] if op_does_work(ix, op) else []
    children = (ix.profile.ops[c] for c in ix.children[op.id])
    return [c for c in children if c.name in CAST_OPS and op_does_work(ix, c)]


def _forward_of(view: Profile, cls: str):
    """(the view's path of the library file defining `cls`, the span of its forward), or None when the
    profile holds no op of that file or its source cannot be read as profiled."""
    module, _, name = cls.rpartition(".")
    path = library_view_path(view, module.replace(".", "/") + ".py")
    src = load_profiled_source(view, path) if path is not None else None
    span = src.function_qualified(f"{name}.forward") if src is not None else None
    return (path, span) if span is not None else None


def _wrapper_backward(ix: ProfileIndex, ops: list[Op]) -> list[Op]:
    """Backward ops of an autograd.Function (or named range) whose forward is entirely in `ops`: its
    backward belongs to the region, though autograd links it to the Function, not to the ops inside."""
    inside = {o.id for o in ops}
    out = []
    for wid in {ix.root(o).id for o in ops if ix.root(o) is not o}:
        wrapper = ix.profile.ops[wid]
        work = [d for d in ix.descendants(wrapper) if d.parent == wid and op_does_work(ix, d)]
        if work and all(d.id in inside for d in work):
            out.extend(ix.backward_ops(wrapper))
    return out


def _backward_counts(ix: ProfileIndex, ops: list[Op]) -> tuple[int, float]:
    """(kernels or ops, cost in us) of the backward of one run."""
    bwd = [b for o in ops for b in ix.backward_ops(o)] + _wrapper_backward(ix, ops)
    cost = sum(ix.cost_us(b) for b in bwd)
    if ix.gpu:
        return sum(ix.kernel_count(b) for b in bwd), cost
    # CPU: the innermost aten ops that did work under each backward node, or the node itself when the
    # profile kept nothing under it (a view's backward counts for nothing)
    count = 0
    for b in bwd:
        leaves = [
            d
            for d in ix.descendants(b)
            if d.name.startswith("aten::")
            and op_does_work(ix, d)
            and not any(ix.profile.ops[c].name.startswith("aten::") for c in ix.children[d.id])
        ]
        node = b.name.rsplit(": ", 1)[-1]
        count += len(leaves) or (not node.startswith(VIEW_BACKWARD))
    return count, cost


def _per_run(ix: ProfileIndex, site: Site) -> tuple[list[Op], int]:
    """(a typical run, its forward kernels or ops): the most common count over the site's runs (a function
    called twice in a row with nothing between gives one run of twice the ops)."""
    counts = [sum(ix.kernel_count(o) for o in occ) if ix.gpu else len(occ) for occ in site.occurrences]
    typical = max(set(counts), key=lambda c: (counts.count(c), -c))
    return site.occurrences[counts.index(typical)], typical


def _finding(ix: ProfileIndex, site: Site) -> Finding | None:
    first, fwd = _per_run(ix, site)
    if site.chain is None and fwd < MIN_KERNELS:
        return None
    bwd_n, _ = _backward_counts(ix, first)
    total_us = sum(sum(ix.cost_us(o) for o in occ) + _backward_counts(ix, occ)[1] for occ in site.occurrences)
    time_ms = ix.per_step_ms(total_us)
    share = ix.share_of_step(time_ms)
    top_level = site.def_line is None and site.chain is None
    # a library block on a CPU profile: the step is mostly the Python that issues the block's ops (which the
    # compiled block cuts too), not the ops' own time, so the count of ops decides there
    cpu_block = site.block is not None and not ix.gpu
    low = share is None or share < (MIN_SHARE_TOP_LEVEL if top_level else MIN_SHARE)
    if site.chain is None and low and not cpu_block:
        return None
    # a block's ops are many short runs, not one pass: no single-kernel floor for them
    floor_ms, bytes_info = _floor(ix, site, bwd_n > 0) if site.block is None else (None, {})
    saving = None if (floor_ms is None or not ix.gpu) else max(0.0, time_ms - floor_ms)
    function = site.function or "?"
    label, fix_words = _label_and_fix(site, function)
    unit = "kernels" if ix.gpu else "ops"
    head = f"{label} ({_op_names(first)})"
    f = build_finding(
        ix,
        rule=ID,
        fix="none" if top_level else FIX,
        path=site.file,
        line=site.line,
        end_line=site.end_line,
        function=function,
        occurrences=site.occurrences,
        head=head,
        fused_kernels=None,
        est_saving_ms=saving,
        advice=(
            "no automatic fix: the region is not inside a function (move it into one, then compile it with "
            "@opadvisor.kernels.compile_region)"
            if top_level
            else f"fuse it: {fix_words} (opadvisor apply --rule fuse_region)"
        ),
        details=FuseRegionFacts(
            chain=site.chain, function=site.function, def_line=site.def_line, kernels_forward=fwd,
            kernels_backward=bwd_n, count_unit=unit, **bytes_info, fix=fix_words,
            **({"module": site.block, "block": function.split(".")[0]} if site.block else {}),
        ).to_details(),
        notes=(["the fused dropout draws its own random mask: losses agree in distribution"]
               if site.chain == DROPOUT else []),
    )  # fmt: skip
    f.time_ms_per_step = time_ms
    f.evidence.time_ms_per_step = time_ms
    f.evidence.share_of_step = share
    f.message = _message(ix, f, label, fwd, bwd_n, unit, floor_ms, bytes_info)
    return f


def _label_and_fix(site: Site, function: str) -> tuple[str, str]:
    """What the region is called in the message, and the fix in words."""
    if site.block is not None:
        block = function.split(".")[0]
        label = f"memory-bound ops between the matrix products of {block} (a library block, every instance)"
        return label, BLOCK_FIX.format(block=block)
    label = CHAIN_LABELS.get(site.chain or "", "memory-bound chain")
    return label, FIXES.get(site.chain or "") or COMPILE_FIX.format(function=function)


def _op_names(ops: list[Op]) -> str:
    short = [o.name.rsplit("::", 1)[-1] for o in ops]
    return " -> ".join(short) if len(short) <= 8 else " -> ".join([*short[:7], f"... ({len(short)} ops)"])


def _floor(ix: ProfileIndex, site: Site, has_backward: bool) -> tuple[float | None, dict]:
    """(floor in ms per step or None, facts about it for `details`)."""
    read, written = bytes_moved(site.occurrences[0])
    # backward of a fused region: read the output's gradient and the saved inputs, write their gradients
    bwd = written + 2 * read if has_backward else 0
    per_run = read + written + bwd
    runs_per_step = len(site.occurrences) / ix.steps_recorded
    bw = ix.profile.environment.copy_bandwidth_gbps
    info = {"bytes_per_run": per_run, "runs_per_step": round(runs_per_step, 2), "copy_bandwidth_gbps": bw}
    if not ix.gpu or not bw:
        return None, info
    floor_ms = per_run * runs_per_step / (bw * 1e9) * 1e3
    info["floor_ms_per_step"] = floor_ms
    return floor_ms, info


def _message(ix, f: Finding, label, fwd, bwd, unit, floor_ms, info) -> str:
    per_step = f.evidence.occurrences
    parts = [f"{label}: {fwd} {unit} forward, {bwd} backward"]
    if per_step > 1:
        parts.append(f"{per_step}x per step")
    parts.append(cost_words(ix, f.time_ms_per_step, f.evidence.share_of_step))
    text = ", ".join(parts)
    if floor_ms is not None:
        text += (
            f"; one fused pass would move {info['bytes_per_run'] / 2**20:.0f} MiB per run: "
            f"{fmt_ms(floor_ms)}/step at the measured {info['copy_bandwidth_gbps']:.0f} GB/s"
        )
    elif ix.gpu and "bytes_per_run" in info:
        text += "; copy bandwidth not measured in this profile (profile again to get the floor)"
    return text


__all__ = ["FIX", "ID", "TITLE", "detect"]
