"""Turn what torch.profiler recorded in-process into the Profile model.

The source is `kineto_results.experimental_event_tree()`: per thread, a tree of Python calls (with the
exact caller line), aten ops (with input shapes, dtypes and scalar values), CUDA runtime calls and,
beneath each runtime call, the device activity it caused (kernels, memcpys, syncs) — so GPU time is
attributed to ops by correlation, never by timestamps. Ops run by the autograd engine take the source
line of the forward op with the same sequence number.

Each op gets two places: the innermost frame of user code (`file`, `line`), and, when the user's code
called into an installed library (transformers, timm, torch's own attention modules) and the op was
issued there, the innermost library frame inside it (`lib_file`, `lib_line`, `lib_function`): the place
where the pattern is written. See userframes.py for what counts as library code.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from opadvisor.profile.compiled import REGION_PREFIX, compile_structure
from opadvisor.profile.model import (
    Annotation,
    Gap,
    Kernel,
    Memcpy,
    Op,
    Step,
    SyncEvent,
)
from opadvisor.profile.userframes import LibraryFile, fused_op_module, library_site, resolve_user_file

IDLE_GAP_MIN_US = 10.0

# Ops that only describe memory (no kernel, no arithmetic): dropped when nested, kept when called directly.
_METADATA_OPS = frozenset(
    "aten::" + n
    for n in (
        "view as_strided empty empty_like empty_strided t transpose expand reshape _reshape_alias "
        "resolve_conj resolve_neg detach detach_ alias lift_fresh unsqueeze squeeze permute slice select "
        "_unsafe_view contiguous to _to_copy result_type size stride is_nonzero"
    ).split()
)
GEMM_OPS = frozenset(
    "aten::" + n
    for n in "mm addmm bmm baddbmm matmul linear _scaled_mm addbmm mv dot einsum conv2d convolution".split()
)
_SYNC_CALLS = frozenset(
    (
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuStreamSynchronize",
    )
)
_ANNOTATION_PREFIX = "ProfilerStep#"
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"


@dataclass
class _Loc:
    file: str | None = None
    line: int | None = None
    function: str | None = None
    exact: bool = True


@dataclass
class _Frame:
    """A user function on the Python stack: the last line seen executing in it."""

    file: str
    function: str
    last_line: int


@dataclass
class _Where:
    """Where the code running now is written: the user's line, and the library's line inside it.

    `frame` is the user function on the stack (its last line seen); `lib` / `lib_frame` the same for the
    innermost library frame called from it (None when user code is the innermost non-torch code);
    `fused_op` the opadvisor.kernels function running below them, if any (`module.function`).
    """

    loc: _Loc
    frame: _Frame | None = None
    lib: _Loc | None = None
    lib_frame: _Frame | None = None
    fused_op: str | None = None


@dataclass
class Extracted:
    ops: list[Op] = field(default_factory=list)
    annotations: list[Annotation] = field(default_factory=list)
    syncs: list[SyncEvent] = field(default_factory=list)
    memcpys: list[Memcpy] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    user_files: set[str] = field(default_factory=set)
    library_files: dict[str, LibraryFile] = field(default_factory=dict)  # rel path -> file
    unattributed_kernels: int = 0


def _tag(event: Any) -> str:
    return type(event.extra_fields).__name__.replace("_ExtraFields_", "")


def _text(frame_state: Any, attr: str) -> str | None:
    """A string field of a profiled Python frame; None when torch hands back undecodable bytes (seen on
    torch 2.13 for a frame of torch/profiler/_cupti_monitor.py: the name is garbage, not ours to read)."""
    try:
        return getattr(frame_state, attr)
    except UnicodeDecodeError:
        return None


def _dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def _scalar(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan: "inf", "-inf", "nan"
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in value):
        return [_scalar(v) for v in value]
    return None


def _inputs(event: Any) -> tuple[list, list, list, list]:
    shapes, dtypes, scalars, metas = [], [], [], []
    for value in event.extra_fields.inputs:
        sizes = getattr(value, "sizes", None)
        if sizes is not None and hasattr(value, "dtype"):
            shapes.append(list(sizes))
            dtypes.append(_dtype_name(value.dtype))
            scalars.append(None)
            metas.append(value)
        elif isinstance(value, list) and value and hasattr(value[0], "sizes"):
            shapes.append(None)  # a TensorList (foreach ops): keep the first tensor's dtype
            dtypes.append(_dtype_name(getattr(value[0], "dtype", None)))
            scalars.append(None)
            metas.append(None)
        else:
            shapes.append(None)
            dtypes.append(None)
            scalars.append(_scalar(value))
            metas.append(None)
    return shapes, dtypes, scalars, metas


# A Python number in a tensor op (`x / 8.0`, `x + 1`) reaches the op as a 0-dim tensor of these dtypes,
# on the CPU whatever the other operand's device.
_WRAPPED_DTYPES = frozenset({"float64", "int64", "bool", "complex128"})


def input_kinds(metas: list[Any], tensors: dict[int, str]) -> list[str | None]:
    """What each tensor input is (see `Op.input_kinds`); [] when that says nothing beyond the shapes.

    `tensors` maps the TensorImpl address of the model's parameters and buffers to "param" (requires
    grad), "frozen" (a parameter that does not) or "buffer". A 0-dim input of a wrapped-number dtype is a
    Python number when another tensor input has a different dtype or device (a 0-dim tensor the script
    made would have to be on the CPU in float64 for that: we accept the ambiguity); a 0-dim input we cannot
    tell apart stays None.
    """
    kinds: list[str | None] = []
    informative = False
    for i, meta in enumerate(metas):
        if meta is None:
            kinds.append(None)
            continue
        known = tensors.get(getattr(meta, "impl_ptr", None) or 0)
        if known is not None:
            kinds.append(known)
            informative = True
        elif len(meta.sizes) > 0:
            kinds.append("tensor")
        else:
            kinds.append(_zero_dim_kind(meta, [m for j, m in enumerate(metas) if m is not None and j != i]))
            informative = True
    return kinds if informative else []


def _zero_dim_kind(meta: Any, others: list[Any]) -> str | None:
    dtype = _dtype_name(meta.dtype)
    if dtype not in _WRAPPED_DTYPES:
        return "tensor"  # a Python float is wrapped as float64, an int as int64: this one is a real tensor
    for other in others:
        if _dtype_name(other.dtype) != dtype or str(other.device) != str(meta.device):
            return "number"
    return None


class TreeReader:
    """Walks the event tree once and collects ops, kernels, annotations, syncs and copies."""

    def __init__(
        self,
        origin_ns: int,
        module_paths: dict[int, str],
        cuda: bool,
        module_types: dict[int, str] | None = None,
        tensors: dict[int, str] | None = None,
    ):
        self.origin_ns = origin_ns
        self.module_paths = module_paths
        self.module_types = module_types or {}
        self.cuda = cuda
        self.tensors = tensors or {}  # TensorImpl address -> "param" | "frozen" | "buffer"
        self.out = Extracted()
        self._by_seq: dict[int, int] = {}  # autograd sequence number -> last forward op id with it
        self._library_files: dict[str, LibraryFile] = {}  # every library file seen (ops or not)

    def us(self, t_ns: int) -> float:
        return (t_ns - self.origin_ns) / 1000.0

    # ---- walk ------------------------------------------------------------------------------------
    def read(self, roots: list[Any]) -> Extracted:
        for root in sorted(roots, key=lambda e: e.start_time_ns):
            self._visit(root, _Where(_Loc()), None, None, False, None)
        return self.out

    def _visit(
        self,
        event: Any,
        where: _Where,
        module: tuple[str | None, str | None, str | None] | None,
        parent_op: int | None,
        backward: bool,
        forward_op: int | None,
    ) -> None:
        tag = _tag(event)
        if tag in ("PyCall", "PyCCall"):
            self._visit_python(event, tag, where, module, parent_op, backward, forward_op)
        elif tag == "TorchOp":
            self._visit_torch_op(event, where, module, parent_op, backward, forward_op)
        elif tag == "Kineto":
            self._visit_runtime(event, parent_op)
        else:
            for child in event.children:
                self._visit(child, where, module, parent_op, backward, forward_op)

    def _visit_python(self, event, tag, where, module, parent_op, backward, forward_op) -> None:
        fields = event.extra_fields
        inner = self._called_from(fields.caller, where)
        if tag == "PyCall":
            info = fields.module
            if info is not None:
                module = (
                    self.module_paths.get(info.self_ptr),
                    info.cls_name,
                    self.module_types.get(info.self_ptr),
                )
            self._enter(fields.callsite, info is not None, inner)
        for child in event.children:
            child_where = inner
            if _tag(child) == "TorchOp":
                child_where = _ops_in_new_frames(inner, where)
            self._visit(child, child_where, module, parent_op, backward, forward_op)

    def _called_from(self, caller: Any, where: _Where) -> _Where:
        """The place of a call made at `caller` (a line in the user's code, a library's, or torch's)."""
        file_name = _text(caller, "file_name")
        caller_file = resolve_user_file(file_name) if file_name else None
        if where.frame is not None and caller_file == where.frame.file:
            where.frame.last_line = caller.line_number
        if caller_file is not None:  # user code called: no library frame inside it (yet)
            loc = _Loc(caller_file, caller.line_number, _text(caller, "function_name"), True)
            return _Where(loc, where.frame, None, where.lib_frame, where.fused_op)
        site = library_site(file_name, caller.line_number) if file_name else None
        if site is None:
            return _Where(where.loc, where.frame, where.lib, where.lib_frame, where.fused_op)
        self._library_files.setdefault(site.file.rel, site.file)
        if where.lib_frame is not None and site.file.rel == where.lib_frame.file:
            where.lib_frame.last_line = caller.line_number
        lib = _Loc(site.file.rel, caller.line_number, site.function or _text(caller, "function_name"), True)
        return _Where(where.loc, where.frame, lib, where.lib_frame, where.fused_op)

    def _enter(self, callsite: Any, module_call: bool, inner: _Where) -> None:
        """Update `inner` for the code of the function being entered (a user's, a library's, torch's)."""
        file_name = _text(callsite, "file_name")
        callsite_file = resolve_user_file(file_name) if file_name else None
        if callsite_file is not None:
            function = _text(callsite, "function_name") or "?"
            inner.frame = _Frame(callsite_file, function, callsite.line_number)
            inner.lib = inner.lib_frame = None
            inner.fused_op = None  # user code called back (a compiled region, a graphed model): its own ops
            return
        if module_call:
            return  # nn.Module's call machinery: the frames of the code that called the module stay
        fused = fused_op_module(file_name) if file_name else None
        if fused is not None and inner.fused_op is None:  # the outermost: the op the caller called
            inner.fused_op = f"{fused}.{_text(callsite, 'function_name') or '?'}"
        inner.frame = None  # not user code: ops below take the user's line of the call into it
        site = library_site(file_name, callsite.line_number) if file_name else None
        if site is None:  # torch's own code: ops below take the library's line of the call into it
            inner.lib_frame = None
            return
        self._library_files.setdefault(site.file.rel, site.file)
        function = site.function or _text(callsite, "function_name") or "?"
        inner.lib_frame = _Frame(site.file.rel, function, callsite.line_number)

    def _visit_torch_op(self, event, where, module, parent_op, backward, forward_op) -> None:
        name = event.name
        fields = event.extra_fields
        if name.startswith(_ANNOTATION_PREFIX):
            return  # step ranges come from the session's own marks
        scope = str(fields.scope)
        if scope.endswith("USER_SCOPE") or "#" in name and not name.startswith("aten::"):
            self._add_annotation(event, where.loc)
            for child in event.children:
                self._visit(child, where, module, parent_op, backward, forward_op)
            return
        if name.startswith(_BACKWARD_PREFIX):
            backward = True
            forward_op = self._by_seq.get(fields.sequence_number)
        op_id = parent_op
        if self._keep(event, parent_op, backward):
            op_id = self._add_op(event, where, module, parent_op, backward, forward_op)
        for child in event.children:
            self._visit(child, where, module, op_id, backward, forward_op)

    def _keep(self, event: Any, parent_op: int | None, backward: bool) -> bool:
        """Keep what rules read: ops called from Python or autograd, GEMMs, and ops that launch work.

        On CUDA a nested op matters only if it launched device work; on CPU (no kernels to tell) the
        first level below a top-level op is kept, minus pure metadata ops.
        """
        name = event.name
        if parent_op is None or name in GEMM_OPS or self._launches_device_work(event):
            return True
        parent = self.out.ops[parent_op]
        if compile_structure(name) or parent.name.startswith(REGION_PREFIX):
            return True  # a compiled frame's structure and the ops it runs eagerly between graphs
        if backward and parent.depth == 0:
            return True  # the autograd node itself ("SoftmaxBackward0") under evaluate_function
        return not self.cuda and parent.depth == 0 and name not in _METADATA_OPS

    def _launches_device_work(self, event: Any) -> bool:
        return self.cuda and any(_tag(c) == "Kineto" for c in event.children)

    def _add_op(self, event, where, module, parent_op, backward, forward_op) -> int:
        fields = event.extra_fields
        shapes, dtypes, scalars, metas = _inputs(event)
        op = Op(
            id=len(self.out.ops),
            name=event.name,
            step=None,
            start_us=self.us(event.start_time_ns),
            duration_us=event.duration_time_ns / 1000.0,
            thread=event.start_tid,
            input_shapes=shapes,
            input_dtypes=dtypes,
            scalars=scalars,
            input_kinds=input_kinds(metas, self.tensors),
            parent=parent_op,
            depth=0 if parent_op is None else self.out.ops[parent_op].depth + 1,
            seq=fields.sequence_number,
            is_backward=backward,
            forward_op=forward_op,
            gpu_time_us=0.0 if self.cuda else None,
        )
        loc, lib = where.loc, where.lib
        if backward and forward_op is not None:
            src = self.out.ops[forward_op]
            op.file, op.line, op.line_exact, op.function = src.file, src.line, src.line_exact, src.function
            op.lib_file, op.lib_line, op.lib_line_exact = src.lib_file, src.lib_line, src.lib_line_exact
            op.lib_function = src.lib_function
            op.module, op.module_class, op.module_type = src.module, src.module_class, src.module_type
            op.fused_op = src.fused_op
        elif loc.file is not None:
            op.file, op.line, op.line_exact, op.function = loc.file, loc.line, loc.exact, loc.function
            self.out.user_files.add(loc.file)
        if lib is not None and not backward:
            op.lib_file, op.lib_line, op.lib_line_exact, op.lib_function = (
                lib.file,
                lib.line,
                lib.exact,
                lib.function,
            )
            self.out.library_files.setdefault(lib.file, self._library_files[lib.file])
        if module is not None and not backward:
            op.module, op.module_class, op.module_type = module
        if not backward:
            op.fused_op = where.fused_op
        if not backward and fields.sequence_number >= 0:
            self._by_seq[fields.sequence_number] = op.id
        self.out.ops.append(op)
        return op.id

    def _add_annotation(self, event: Any, loc: _Loc) -> None:
        self.out.annotations.append(
            Annotation(
                name=event.name,
                start_us=self.us(event.start_time_ns),
                duration_us=event.duration_time_ns / 1000.0,
                thread=event.start_tid,
                file=loc.file,
                line=loc.line,
            )
        )

    # ---- CUDA runtime calls and the device work beneath them ------------------------------------------
    def _visit_runtime(self, event: Any, op_id: int | None) -> None:
        name = event.name
        if name in _SYNC_CALLS or name.endswith("Synchronize"):
            self.out.syncs.append(
                SyncEvent(name, self.us(event.start_time_ns), event.duration_time_ns / 1000.0, op=op_id)
            )
        for child in event.children:
            if _tag(child) != "Kineto" or child.correlation_id != event.correlation_id:
                continue  # time-nested neighbours, not activity caused by this call
            self._add_device_activity(child, op_id)

    def _add_device_activity(self, event: Any, op_id: int | None) -> None:
        name = event.name
        start, dur = self.us(event.start_time_ns), event.duration_time_ns / 1000.0
        if name.endswith("Sync"):  # "Stream Sync" / "Context Sync": the wait itself, already recorded
            return
        if name.startswith("Memcpy"):
            self.out.memcpys.append(Memcpy(name, start, dur, op=op_id))
        if op_id is None:
            self.out.unattributed_kernels += 1
            return
        self.out.ops[op_id].kernels.append(Kernel(name=name, start_us=start, duration_us=dur))


def profiler_step_ranges(roots: list) -> dict[int, tuple[int, int]]:
    """{i: (start_ns, end_ns)} of the `ProfilerStep#i` ranges in the event tree.

    Only ops' names are read: torch 2.13's Python tracer sometimes names a Python event with bytes that
    are not UTF-8 (reading it raises UnicodeDecodeError), and the step ranges are record_function ops.
    """
    found: dict[int, tuple[int, int]] = {}
    stack = list(roots)
    while stack:
        event = stack.pop()
        if _tag(event) == "TorchOp" and event.name.startswith(_ANNOTATION_PREFIX):
            index = int(event.name.split("#", 1)[1])
            found[index] = (event.start_time_ns, event.start_time_ns + event.duration_time_ns)
        stack.extend(event.children)
    return found


def _ops_in_new_frames(inner: _Where, outer: _Where) -> _Where:
    """The place of an op issued directly in a function just entered, without a Python call on its line
    (`a @ b`): the last line seen in that function, marked inexact."""
    if (inner.frame is None or inner.frame is outer.frame) and (
        inner.lib_frame is None or inner.lib_frame is outer.lib_frame
    ):
        return inner
    where = _Where(inner.loc, inner.frame, inner.lib, inner.lib_frame, inner.fused_op)
    if inner.frame is not None and inner.frame is not outer.frame:
        f = inner.frame
        where.loc = _Loc(f.file, f.last_line, f.function, False)
    if inner.lib_frame is not None and inner.lib_frame is not outer.lib_frame:
        f = inner.lib_frame
        where.lib = _Loc(f.file, f.last_line, f.function, False)
    return where


def assign_steps(extracted: Extracted, marks: list[tuple[float, float]], cuda: bool) -> None:
    """Give every op, annotation, sync and copy its step (by CPU start); compute GPU busy time and gaps."""
    import bisect

    starts = [m[0] for m in marks]

    def step_of(t_us: float) -> int | None:
        i = bisect.bisect_right(starts, t_us) - 1
        if i >= 0 and t_us <= marks[i][1]:
            return i
        return None

    for op in extracted.ops:
        op.step = step_of(op.start_us)
    for item in (*extracted.annotations, *extracted.syncs, *extracted.memcpys):
        item.step = step_of(item.start_us)
    for op in reversed(extracted.ops):  # children come after parents: accumulate bottom-up
        if cuda:
            op.gpu_time_us = (op.gpu_time_us or 0.0) + sum(k.duration_us for k in op.kernels)
            if op.parent is not None:
                parent = extracted.ops[op.parent]
                parent.gpu_time_us = (parent.gpu_time_us or 0.0) + op.gpu_time_us
    extracted.steps = [
        Step(index=i, start_us=s, end_us=e, wall_ms=(e - s) / 1000.0) for i, (s, e) in enumerate(marks)
    ]
    if cuda:
        _gpu_timeline(extracted)


def _gpu_timeline(extracted: Extracted) -> None:
    """Per step: the GPU's span (from the end of the previous step's work), busy time, and idle gaps."""
    per_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for op in extracted.ops:
        if op.step is not None:
            per_step[op.step].extend((k.start_us, k.start_us + k.duration_us) for k in op.kernels)
    previous_end: float | None = None
    for step in extracted.steps:
        intervals = sorted(per_step.get(step.index, []))
        step.kernel_count = len(intervals)
        if not intervals:
            step.gpu_busy_ms = 0.0
            continue
        span_start = step.start_us if previous_end is None else min(previous_end, intervals[0][0])
        busy, gaps, cursor = 0.0, [], span_start
        for start, end in intervals:
            if start > cursor:
                if start - cursor >= IDLE_GAP_MIN_US:
                    gaps.append(Gap(cursor, start - cursor))
                busy += end - start
                cursor = end
            elif end > cursor:
                busy += end - cursor
                cursor = end
        step.gpu_busy_ms = busy / 1000.0
        step.gpu_span_ms = (cursor - span_start) / 1000.0
        step.idle_gaps = gaps
        previous_end = cursor
