"""Repeated blocks holding most of the step's activation memory: checkpoint them to lower the peak.

What it finds
    The modules that hold the most activation memory (what autograd saves for backward, measured per
    module while profiling) and, among them, the repeated blocks of the model (`layers.0`, `layers.1`,
    ... of one class: transformer layers, residual stages) with the line that calls them. It reports when
    a step's peak memory is high against the device (the allocator's reserved peak at 80% of the GPU's
    memory or more), or when asked: `opadvisor profile --memory`, `opadvisor suggest --memory`, or
    `opadvisor apply --rule activation_checkpointing`. The finding gives the blocks' activation memory, the
    step's peak against the device, the memory checkpointing would free and the compute it costs.

Why it matters
    Training keeps every tensor that backward needs from the forward until backward reaches it: for a
    transformer that is several copies of the [batch, sequence, hidden] activations per layer, plus the
    [batch, heads, sequence, sequence] attention scores, for every layer at once. That, not the weights, is
    what limits the batch size or the sequence length, and it is what an out-of-memory error runs out of.
    Activation checkpointing keeps only each block's input and recomputes the block's forward during
    backward: the memory of all blocks but one for one more forward of the blocks per step (about a third
    more compute for a transformer's layers). TorchAcc (`auto_checkpoint`) and LightSeq make the same trade.

Example
    for block in self.blocks:
        x = block(x)

Fix and its safety
    `opadvisor apply --rule activation_checkpointing` wraps the call of the blocks where the model calls
    them: `x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` (keyword arguments pass
    through). The form chosen is the call site, not a wrapper module around each block: a wrapper
    (`checkpoint_wrapper`) renames every parameter in the state_dict, so saved checkpoints no longer load;
    the call site changes no name and works for the loop over a ModuleList and for blocks called one by
    one. Safe: checkpointing recomputes the same function (non-reentrant checkpoint restores the RNG
    state, so dropout draws the same masks), gradients are the same, and `opadvisor verify` reports the
    peak memory before and after with the step time. Unsafe (applied only with --unsafe) where a block
    holds BatchNorm: its running statistics are updated again by the recomputation. Blocks called from
    library code (a transformers model) get no rewrite: the finding names the library's own switch
    (`model.gradient_checkpointing_enable(...)`). Blocks held in an `nn.Sequential` that the model calls as
    a whole get `torch.utils.checkpoint.checkpoint_sequential(self.blocks, len(self.blocks), x,
    use_reentrant=False)` at that call (its last block runs without a checkpoint: backward needs it first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opadvisor.profile.memory import (
    Holder,
    activation_holders,
    fmt_bytes,
    inclusive_saved,
    saved_per_step,
)
from opadvisor.profile.model import ModuleCall, Op, Profile
from opadvisor.rules._findings import fmt_ms, fmt_share
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.engine import NeedsGpuProfile, NotApplicable
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "activation_checkpointing"
TITLE = "Checkpoint the blocks that hold the activation memory"
FIX = "safe"
FIX_CAVEAT = (
    "unsafe where a block holds BatchNorm; none where library code calls the blocks (its switch is named)"
)
ON_REQUEST = True  # reports on memory pressure, or when asked (see the engine)

HIGH_PEAK_SHARE = 0.8  # reserved peak / device memory from which memory is the constraint
MIN_GROUP_SHARE = 0.2  # blocks holding less of the saved memory are not worth reporting unasked
HOLDERS_NAMED = 4
SEQUENTIAL_FRAME = "torch/nn/modules/container.py"  # blocks of an nn.Sequential are called from there
HF_SWITCH = 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'


@dataclass
class CheckpointFacts(Facts):
    """What the profile proved about the blocks (the finding's `details`; the codemod reads `modules` and
    `form`). Bytes are per step; None where the profile could not tell (no CUDA: no peaks)."""

    RULES = ("activation_checkpointing",)

    modules: list[str] = field(default_factory=list)  # the blocks' paths: "blocks.0", "blocks.1", ...
    module_class: str | None = None
    form: str = "call"  # "call": the caller calls each block; "sequential": an nn.Sequential calls them
    call_lines: list[int] = field(default_factory=list)  # where the caller calls them
    activation_bytes: int = 0  # what the blocks (with their submodules) save for backward
    saved_bytes_per_step: int = 0  # what the whole step saves
    input_bytes: int | None = None  # the blocks' tensor arguments: what a checkpoint keeps
    est_memory_saving_bytes: int = 0
    extra_compute_ms_per_step: float | None = None  # the blocks' forward: what recomputation repeats
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_bytes: int | None = None
    batchnorm: list[str] = field(default_factory=list)  # BatchNorm classes inside the blocks
    in_library: bool = False  # called from library code: no rewrite


def detect(profile: Profile, requested: bool = False) -> list[Finding]:
    holders = activation_holders(profile)
    saved = saved_per_step(profile)
    if saved is None:
        raise NotApplicable(
            "activation memory was not measured in this run (profiled with --no-activations, by an older "
            "opadvisor, or under the script's own saved-tensor hooks); profile again"
        )
    asked = requested or profile.memory_requested
    pressure = _pressure(profile)
    if not asked:
        if pressure is None and not profile.has_gpu:
            raise NeedsGpuProfile(
                "it reports when the step's peak memory is high against the GPU's "
                "(or when asked: `opadvisor suggest --memory`)"
            )
        if pressure is None:
            raise NotApplicable(
                "reports on a GPU profile whose peak memory is high against the device, or when asked "
                "(`opadvisor suggest --memory`): this profile has no device memory peak"
            )
        if pressure < HIGH_PEAK_SHARE:
            return []
    ix = index_of(profile)
    findings = []
    for holder in holders:
        if not holder.repeated or (not asked and holder.saved_bytes < MIN_GROUP_SHARE * saved):
            continue
        finding = _finding(profile, ix, holder, holders, saved, pressure)
        if finding is not None:
            findings.append(finding)
    return findings


def _pressure(profile: Profile) -> float | None:
    _, reserved = profile.peak_memory()
    device = profile.environment.gpu_memory_bytes
    return reserved / device if reserved is not None and device else None


def _members(profile: Profile, holder: Holder) -> list[ModuleCall]:
    by_path = {c.module: c for c in profile.module_calls}
    return [by_path[m] for m in holder.modules if m in by_path]


def _subtree_classes(profile: Profile, paths: list[str]) -> set[str]:
    return {
        c.module_class
        for c in profile.module_calls
        if any(c.module == p or c.module.startswith(p + ".") for p in paths)
    }


def _forward_ops(ix: ProfileIndex, paths: list[str]) -> list[Op]:
    """The forward root ops run inside the blocks (what a checkpoint runs a second time)."""
    prefixes = tuple(p + "." for p in paths)
    wanted = set(paths)
    return [
        op
        for op in ix.forward_root_ops
        if op.module is not None and (op.module in wanted or op.module.startswith(prefixes))
    ]


def memory_saving(profile: Profile, holder: Holder) -> float:
    """Bytes a checkpoint of every block frees: each keeps only its input, and backward recomputes one
    block at a time (its activations are held again meanwhile)."""
    calls = [c for c in profile.module_calls if c.saved_bytes is not None]
    per_block = [inclusive_saved(calls, m) for m in holder.modules]
    inputs = holder.input_bytes or 0
    return max(0.0, sum(per_block) - inputs - max(per_block, default=0.0))


def _holders_words(holders: list[Holder], saved: float) -> str:
    words = []
    for h in holders[:HOLDERS_NAMED]:
        cls = (h.module_class or "").rpartition(".")[2]
        what = f"{cls} x{len(h.modules)}" if h.repeated else cls
        label = f"{h.name} ({what})" if what else h.name
        words.append(f"{label} {fmt_bytes(h.saved_bytes)} ({fmt_share(h.saved_bytes / saved)})")
    return ", ".join(words)


def _finding(
    profile: Profile,
    ix: ProfileIndex,
    holder: Holder,
    holders: list[Holder],
    saved: float,
    pressure: float | None,
) -> Finding | None:
    members = _members(profile, holder)
    sites = [(m.file, m.line) for m in members if m.file and m.line]
    if not members or not sites:
        return None
    path = sites[0][0]
    lines = sorted({line for file, line in sites if file == path})
    spans = _spans(profile, path, lines)
    callers = [str(m.attrs.get("caller") or "") for m in members]
    sequential = all(SEQUENTIAL_FRAME in c for c in callers)  # called by nn.Sequential's forward
    in_library = not sequential and any(callers)
    classes = _subtree_classes(profile, holder.modules)
    batchnorm = sorted(c for c in classes if "BatchNorm" in c)
    ops = _forward_ops(ix, holder.modules)
    extra_ms = ix.per_step_ms(ix.site_cost_us(ops, backward=False)) if ops else None
    freed = memory_saving(profile, holder)
    allocated, reserved = profile.peak_memory()
    device = profile.environment.gpu_memory_bytes
    message = _message(profile, holder, len(members), saved, pressure, freed, extra_ms)
    fix, advice = _fix(profile, members, in_library, batchnorm)
    notes = _notes(ix, holders, saved, batchnorm, extra_ms)
    return Finding(
        rule=ID,
        path=path,
        line=min(s[0] for s in spans),
        end_line=max(s[1] for s in spans),
        message=message,
        fix=fix,
        function=members[0].function,
        module=holder.name,
        evidence=_evidence(ix, members, extra_ms, notes),
        time_ms_per_step=extra_ms,
        est_saving_ms_per_step=None if extra_ms is None else -extra_ms,  # a cost: the recomputed forward
        advice=advice,
        details=CheckpointFacts(
            modules=holder.modules,
            module_class=holder.module_class,
            form="sequential" if sequential else "call",
            call_lines=lines,
            activation_bytes=round(holder.saved_bytes),
            saved_bytes_per_step=round(saved),
            input_bytes=holder.input_bytes,
            est_memory_saving_bytes=round(freed),
            extra_compute_ms_per_step=extra_ms,
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            device_bytes=device,
            batchnorm=batchnorm,
            in_library=in_library,
        ).to_details(),
    )


def _evidence(ix: ProfileIndex, members: list, extra_ms: float | None, notes: list[str]) -> Evidence:
    """The recomputation's cost as the finding's time (no ops: the blocks' forwards are the evidence)."""
    return Evidence(
        ops=[],
        time_ms_per_step=extra_ms,
        share_of_step=ix.share_of_step(extra_ms),
        time_basis=ix.basis if extra_ms is not None else "none",  # type: ignore[arg-type]
        occurrences=max(1, round(sum(m.calls for m in members) / ix.steps_recorded)),
        notes=notes,
    )


def _spans(profile: Profile, path: str, lines: list[int]) -> list[tuple[int, int]]:
    """The statements of the calls at `lines` (each line alone where the source is not at hand)."""
    src = load_profiled_source(profile, path)
    return [src.statement_span(line) if src is not None else (line, line) for line in lines]


def _message(
    profile: Profile,
    holder: Holder,
    count: int,
    saved: float,
    pressure: float | None,
    freed: float,
    extra_ms: float | None,
) -> str:
    """What the blocks hold, the step's peak against the device, and what checkpointing frees and costs."""
    _, reserved = profile.peak_memory()
    device = profile.environment.gpu_memory_bytes
    cls = holder.module_class.rpartition(".")[2] if holder.module_class else "block"
    message = (
        f"{count} x {cls} ({holder.name}) hold {fmt_bytes(holder.saved_bytes)} of the "
        f"{fmt_bytes(saved)} saved for backward per step ({fmt_share(holder.saved_bytes / saved)})"
    )
    if reserved is not None and device:
        message += f"; the step peaks at {fmt_bytes(reserved)} of {fmt_bytes(device)} ({fmt_share(pressure)})"
    return message + (
        f". Checkpointing them frees about {fmt_bytes(freed)} for one more forward of the blocks per step "
        f"({fmt_ms(extra_ms)})"
    )


def _notes(
    ix: ProfileIndex, holders: list[Holder], saved: float, batchnorm: list[str], extra_ms: float | None
) -> list[str]:
    notes = [f"largest holders of activation memory: {_holders_words(holders, saved)}"]
    if batchnorm:
        notes.append(
            f"the blocks hold {', '.join(c.rpartition('.')[2] for c in batchnorm)}: the recomputation updates "
            "its running statistics a second time"
        )
    if extra_ms is not None and not ix.gpu:
        notes.append("CPU profile: the recompute cost is CPU op time; profile on a GPU for kernel time")
    return notes


def _fix(
    profile: Profile, members: list[ModuleCall], in_library: bool, batchnorm: list[str]
) -> tuple[str, str]:
    if in_library:
        caller = members[0].attrs.get("caller", "library code")
        if any(c.module_class.startswith("transformers.") for c in profile.module_calls if c.module == ""):
            return (
                "none",
                f"the blocks are called by transformers ({caller}): {HF_SWITCH} where the model is built",
            )
        return (
            "none",
            f"the blocks are called from library code ({caller}): use the library's checkpointing switch",
        )
    if all(SEQUENTIAL_FRAME in str(m.attrs.get("caller") or "") for m in members):
        advice = (
            "call the nn.Sequential through torch.utils.checkpoint.checkpoint_sequential(blocks, len(blocks), x, "
            "use_reentrant=False): only the blocks' inputs are kept, their forward runs again in backward"
        )
    else:
        advice = (
            "wrap the call of each block in torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False): "
            "only the blocks' inputs are kept, their forward runs again in backward"
        )
    return ("unsafe" if batchnorm else "safe"), advice


__all__ = ["FIX", "FIX_CAVEAT", "ID", "ON_REQUEST", "TITLE", "CheckpointFacts", "detect", "memory_saving"]
