"""How much of the step ran inside torch.compile graphs, which the rules cannot see into.

Ops that run inside a compiled graph have no Python frame of the user's code around them (inductor's
kernels, or the graph's own aten calls), so no rule can tie them to a source line. The profile shows each
graph call as one op: `Torch-Compiled Region: <frame>/<recompile>` forward and, for training,
`CompiledFunctionBackward` run by autograd. `compiled_regions(profile)` sums their time:

    {"ms_per_step": 41.2, "share_of_step": 0.72, "basis": "cpu" | "gpu", "graphs": 2}

or None when nothing ran compiled. `opadvisor profile --eager` switches torch.compile off for the run, so
the same code is recorded op by op and its patterns can be found and fixed.
"""

from __future__ import annotations

from typing import Any

from opadvisor.profile.compiled import BOOKKEEPING, CACHE_LOOKUP, GRAPH_FUNCTION, REGION_PREFIX
from opadvisor.profile.model import CompiledFrame, Construction, Op, Profile
from opadvisor.rules._index import index_of

BACKWARD_SUFFIX = "CompiledFunctionBackward"


def compiled_regions(profile: Profile) -> dict[str, Any] | None:
    ix = index_of(profile)
    regions = [
        op
        for op in profile.ops
        if op.parent is None
        and ix.in_window(op)
        and (op.name.startswith(REGION_PREFIX) or op.is_backward and op.name.endswith(BACKWARD_SUFFIX))
    ]
    if not regions:
        return None
    ms = ix.per_step_ms(sum(ix.cost_us(op) for op in regions))
    if ix.gpu:
        spans = [s.gpu_span_ms or s.wall_ms for s in profile.steps]
        step = sum(spans) / len(spans) if spans else None
    else:
        step = ix.step_ms
    return {
        "ms_per_step": round(ms, 4),
        "share_of_step": round(min(1.0, ms / step), 4) if step else None,
        "basis": ix.basis,
        "graphs": graphs_per_step(profile)
        or len({op.name for op in regions if op.name.startswith(REGION_PREFIX)}),
        **compile_times(profile.compiled_frames),
    }


def compile_times(frames: list[CompiledFrame]) -> dict[str, Any]:
    """Seconds torch.compile spent compiling the model (the user's code and the libraries'): in all and in
    the first step (the rest is recompiles); None where the run recorded no compiles (older runs)."""
    if not frames:
        return {"compile_s": None, "compile_s_first_step": None}
    total = sum(f.compile_s or 0.0 for f in frames)
    first = sum(f.compile_s or 0.0 for f in frames if f.step == 0)
    return {"compile_s": round(total, 3), "compile_s_first_step": round(first, 3)}


# ---- torch.compile's own record (profile.compiled_frames): graph breaks and recompiles (issue 33) ----

RESUME_PREFIX = "torch_dynamo_resume_in_"  # dynamo names the code it resumes after a break so
GRAPH_OPS = (GRAPH_FUNCTION, REGION_PREFIX)  # an op under these ran inside a graph
_BREAK_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("scalar_read", ("Tensor.item", "capture_scalar_outputs", "Tensor.tolist", "item()")),
    ("print", ("`print`", "builtin print", "logging function")),
    ("tensor_branch", ("Data-dependent branching", "data dependent", "generic_jump", "dynamic control flow")),
    (
        "unsupported_call",
        (
            "marked as skipped",
            "skip function",
            "numpy",
            "non-Tensor",
            "Unsupported function call",
            "C extension",
            "Attempted to call function",
            "inline",
            "builtin",
        ),
    ),
)


def user_frames(profile: Profile) -> list[CompiledFrame]:
    """The frames of the user's own code (a library's, such as a transformers model's, are compiled too)."""
    return [f for f in profile.compiled_frames if f.file in profile.sources]


def break_kind(reason: str, explanation: str) -> str:
    """One of compile_facts.BREAK_KINDS, from dynamo's words."""
    text = f"{reason}\n{explanation}"
    for kind, words in _BREAK_KINDS:
        if any(w.lower() in text.lower() for w in words):
            return kind
    return "other"


def original_function(name: str) -> str:
    """`torch_dynamo_resume_in_forward_at_16` -> `forward` (the function a resumed frame belongs to)."""
    if not name.startswith(RESUME_PREFIX):
        return name
    inner = name[len(RESUME_PREFIX) :]
    head, sep, tail = inner.rpartition("_at_")
    return original_function(head) if sep and tail.isdigit() else inner


def resumed_frame_ids(profile: Profile, path: str, line: int) -> set[str]:
    """Dynamo's frame ids of the code resumed after the break at path:line."""
    suffix = f"_at_{line}"
    return {
        f.frame_id
        for f in profile.compiled_frames
        if f.file == path and f.function.startswith(RESUME_PREFIX) and f.function.endswith(suffix)
    }


def site_host_us(profile: Profile, path: str, line: int, resumed: set[str]) -> tuple[float, float]:
    """(eager, overhead): host time in the window of the ops that ran outside every graph at path:line,
    and of entering and leaving the graphs resumed after it (their cache lookups, the regions' own time
    and their bookkeeping ops)."""
    ix = index_of(profile)
    ops = profile.ops
    regions = {f"{REGION_PREFIX}: {fid}/" for fid in resumed}
    eager = overhead = 0.0
    for op in ops:
        if op.is_backward or not ix.in_window(op):
            continue
        if op.name.startswith(REGION_PREFIX) and any(op.name.startswith(r) for r in regions):
            kids = [ops[c] for c in ix.children[op.id]]
            own = op.duration_us - sum(k.duration_us for k in kids)
            overhead += max(0.0, own) + sum(k.duration_us for k in kids if k.name in BOOKKEEPING)
        elif op.file == path and op.line == line:
            if op.name == CACHE_LOOKUP:
                overhead += op.duration_us
            elif _outside_graphs(ops, op) and not _parent_at(ops, op, path, line):
                eager += op.duration_us
    return eager, overhead


def _outside_graphs(ops: list[Op], op: Op) -> bool:
    if op.name.startswith(GRAPH_OPS) or op.name in BOOKKEEPING:
        return False
    cur = op
    for _ in range(64):  # bounded: trees are shallow
        if cur.parent is None:
            return True
        cur = ops[cur.parent]
        if cur.name == GRAPH_FUNCTION:
            return False
    return True


def _parent_at(ops: list[Op], op: Op, path: str, line: int) -> bool:
    """Whether the op's parent is counted already (an op at the same line, outside graphs)."""
    if op.parent is None:
        return False
    parent = ops[op.parent]
    return parent.file == path and parent.line == line and not parent.name.startswith(GRAPH_OPS)


def graphs_per_step(profile: Profile) -> int | None:
    """Graphs one call runs: one per distinct compiled frame, the user's or a library's (each break adds
    one)."""
    ids = {f.frame_id for f in profile.compiled_frames if not f.failed}
    return len(ids) or None


def compiled_function_of(profile: Profile, frame: CompiledFrame) -> tuple[str, int | None]:
    """The user's function whose compilation this frame belongs to, and its first line (a resumed
    frame's original function: the first compile of that name in the same file)."""
    name = original_function(frame.function)
    if name == frame.function:
        return name, frame.line
    same = [f for f in profile.compiled_frames if f.file == frame.file and f.function == name]
    return name, (same[0].line if same else None)


def compile_call_for(profile: Profile, file: str | None, line: int | None) -> Construction | None:
    """The `torch.compile(...)` call that compiled the code at file:line (its def line), or the only one."""
    calls = [c for c in profile.constructions if c.kind == "compile" and c.file in profile.sources]
    exact = [c for c in calls if c.attrs.get("code_file") == file and c.attrs.get("code_line") == line]
    if exact:
        return exact[-1]
    return calls[0] if len(calls) == 1 else None
