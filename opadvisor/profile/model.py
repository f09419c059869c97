"""The profile model: what `opadvisor profile` measured, as plain dataclasses.

This is the contract between `opadvisor/profile` (which writes it) and `opadvisor/rules` (which reads it).
On disk it is `profile.json` in a run folder, versioned by `SCHEMA_VERSION`; `load_profile` reads it back
with no pickle and no exec. Times are microseconds relative to the start of the recorded window unless
a field says otherwise; GPU fields are None in a profile taken without CUDA.

Field reference (schema 1)
--------------------------
Profile
    schema            int, SCHEMA_VERSION
    run_id            folder name of the run
    created           ISO-8601 UTC time the run was written
    script            absolute path of the profiled script (under `-m`, the module's file)
    module            the dotted name it ran as, as `python -m` runs it (package context), or None for a
                      plain script: `profile -m pkg.train`, or a script inside a package that imports
                      relatively (a package's `__main__` is named `pkg.__main__`)
    import_root       sys.path[0] while a module ran (the folder `-m` was given in, or the one above the
                      outermost package); None for a plain script (its own folder)
    argv              the script's own argv (argv[0] is the script path as given; the module's file under -m)
    cwd               working directory of the profiled process
    environment       Environment
    sources           {absolute path: sha256 hex} of every user source file that appears in `ops`
    step_detection    "optimizer_hook" | "explicit" | "time_window" | "callback" (a Trainer's step events:
                      opadvisor.integrations)
    warmup_steps      steps run before the window
    steps_requested   steps the window was asked to record
    complete          False when the script ended or failed before the window was recorded in full
    stopped           why an incomplete window stopped: "script_error" | "script_exit" | "ended_early" |
                      "interrupted" (Ctrl-C); None for a complete run or one written before issue 30
    steps_seen        steps the script completed in all, warm-up included (0 in runs written before
                      issue 30); a run that stopped in its warm-up keeps what it knew, with no steps
    eager             True when torch.compile was switched off for the run (`opadvisor profile --eager`)
    steps             [Step]  the recorded steps, in order
    ops               [Op]    every op kept from the window: thread by thread (the tree torch records per
                      thread), in start order within a thread; parents before their children
    annotations       [Annotation]  user/record_function ranges (DataLoader __next__, Optimizer.step ...)
    syncs             [SyncEvent]   host<-device synchronisations (CUDA only)
    memcpys           [Memcpy]      host<->device copies (CUDA only)
    constructions     [Construction]  where the script built its optimizers, DataLoaders and the
                      nn.Linear / nn.Embedding modules (file:line of the constructor call, settings), and
                      the model whose forward it calls (kind "model")
    rank / world_size distributed rank of this profile (0 / 1 for a single process)
    module_calls      [ModuleCall]  every module called inside the window (where from, how often, the
                      activation memory it saved for backward); added with issue 22, [] in older runs
    memory_notes      [str]  why some memory could not be measured (e.g. the script's own saved-tensor
                      hooks were active)
    memory_requested  True when the run was profiled with `--memory` (report memory findings whatever
                      the peak)
    libraries         {package: {"version": str | None, "root": folder holding the package}} of every
                      installed package whose code ops ran in (see Op.lib_file; {} when none)
    library_sources   {path within site-packages: sha256 hex} of those library files (as profiled)
    modules           {module path: qualified class} of the modules the script called
                      ("bert.encoder.layer.0.attention.self": "transformers.models.bert.modeling_bert.
                      BertSelfAttention"); the first module called is "" (its submodules by their names)
    compiled_frames   [CompiledFrame]  every frame torch.compile compiled while the script ran (warm-up
                      included): its graph break, its recompiles, its compile time (issue 33; [] when
                      nothing was compiled, under --eager, or in older runs)
    calibration       Calibration | None: steps timed without the profiler just before the window (None
                      when none were: fewer than 2 warm-up steps, `--calibrate 0`, a time window, or a
                      profile.json written before this field existed)

Calibration (the plain step: what the step costs when nothing is recorded)
    step_ms           [float] each timed step in ms, in order: the last `--calibrate` warm-up steps (never
                      the first warm-up step), each from the end of the step before it to its own end
                      (opadvisor's module hooks, NVTX ranges, still run: a few us per module call)
    method            "cuda_sync": torch.cuda.synchronize() at each step end before reading the clock (the
                      way `verify` times steps); "wall": the wall clock alone (no CUDA in use)

On disk, op and kernel fields equal to their default are left out, each kernel's `name` is an index
into the top-level `kernel_names` list, and an op's `lib_file`, `lib_function`, `module_type` and `fused_op`
are indices into the top-level `op_strings` list; `load_profile` restores them. Non-finite scalars are strings
("inf", "-inf", "nan"). Read profile.json through `load_profile`, not as raw JSON.

Step (one recorded training step)
    index, start_us, end_us, wall_ms, gpu_busy_ms, gpu_span_ms, kernel_count, idle_gaps: see `Step`.
    Memory (issue 22; None where not measured, as in older runs):
    peak_allocated_bytes   CUDA: the allocator's peak of bytes in live tensors during the step (the peak
                           counter is reset when the step starts)
    peak_reserved_bytes    CUDA: the peak of bytes the allocator held from the device (what an
                           out-of-memory error runs out of)
    allocated_at_start_bytes  CUDA: bytes in live tensors when the step started (weights, gradients,
                           optimizer state, whatever the script keeps between steps)
    saved_bytes            any device: bytes of the distinct storages autograd saved for backward during
                           the step (parameters and buffers left out; see opadvisor/profile/memory.py)

ModuleCall (one module called inside the window)
    module (path in the model, "" the model itself), module_class (qualified, "torch.nn.LSTMCell",
    "__main__.Block"), calls (forward calls in the whole window), file / line / function (where its first
    call in the window came from: the calling line when that is user code, else the innermost user frame,
    and attrs["caller"] names the library or torch frame that made the call), input_bytes (bytes of the
    tensor arguments of that first call), saved_bytes / saved_tensors (activation memory: mean bytes and
    storages per step first saved for backward while this module was the innermost one running; its
    children's are theirs; None when not measured), attrs (facts of its class: for nn.LSTM / nn.GRU /
    nn.RNN `kind`, sizes, `calls_not_flat` (calls whose weights were not one contiguous buffer),
    `weight_dtype`, `input_dtype`, `input_shape`, `autocast`, `device`, `cudnn_enabled`, `cudnn_tf32`;
    for nn.LSTMCell / nn.GRUCell / nn.RNNCell `kind`, sizes, `bias`, `nonlinearity`, `input_shape`,
    `input_dtype`, `weight_dtype`, `state_given`; see opadvisor/profile/modules.py).
    Activation memory saved outside every module (a loss computed in the training loop) is the step's
    `saved_bytes` minus the modules' sum.

Op (one aten op or autograd node; nested ops point at their parent)
    id, name ("aten::softmax"), step (index into steps, None outside any step),
    start_us, duration_us (CPU, inclusive), thread (OS thread id; backward runs on the autograd thread),
    input_shapes [[int] | None per input], input_dtypes [str | None per input],
    scalars [number | bool | str | None per input: the value of non-tensor scalar inputs such as a fill
    value or a single dim; int lists (e.g. the dims of a reduction) are not recorded by torch: None],
    input_kinds [str | None per input, or [] (the default) when it would say nothing the shapes do not:
    "number" (a Python number the op got as a 0-dim tensor, `x / 8.0`), "param" (an nn.Parameter of the
    model that requires grad), "frozen" (a parameter that does not), "buffer" (a module buffer),
    "tensor" (any other tensor), None (not a tensor, or a 0-dim tensor that cannot be told from a
    number); added in place of nothing, so older profiles load with [] (unknown)],
    file, line (1-based, the innermost frame in user code: outside torch and opadvisor), line_exact (False
    when the op was not reached through a Python call on that line, e.g. `a @ b`, and `line` is the last
    known line of that frame), function, module (module path such as "encoder.layers.0.attn"),
    module_class (its class name), module_type (its qualified class: "transformers.models.bert.
    modeling_bert.BertSelfAttention"; None when unknown),
    lib_file, lib_line, lib_line_exact, lib_function: when the user's code called into an installed
    library and the op was issued there, the innermost library frame inside the user frame: the path within
    site-packages ("transformers/models/bert/modeling_bert.py"), the 1-based line (lib_line_exact as for
    `line`) and the function's qualified name ("BertSelfOutput.forward", "eager_attention_forward"); all
    None when the op was issued by user code (torch's operator layer, e.g. F.softmax, is neither: see
    opadvisor/profile/userframes.py),
    fused_op: the opadvisor.kernels function the op was issued inside ("dropout_add.bias_dropout_add":
    the fused op's own work, e.g. the plain chain it runs below its size threshold; its backward ops carry
    it too), None for the model's own ops; rules read no pattern into these (added in place of nothing:
    older profiles load with None),
    parent (id of the enclosing kept op, None at top level), depth (0 = called from Python
    or the autograd engine), seq (autograd sequence number, -1 when none), is_backward, forward_op (for
    backward ops: the id of the forward op with the same sequence number; file/line are copied from it),
    kernels [Kernel] launched by this op itself, gpu_time_us (kernels of this op and its descendants;
    None without CUDA).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


class ProfileFormatError(ValueError):
    """profile.json is missing, corrupt, truncated, or of an unknown schema version."""


@dataclass
class Environment:
    python: str = ""
    platform: str = ""
    torch: str = ""
    cuda: str | None = None
    device: str = "cpu"  # "cpu" or "cuda"
    gpu_name: str | None = None
    sm_count: int | None = None
    capability: list[int] | None = None  # [major, minor]
    gpu_memory_bytes: int | None = None
    cpu_count: int | None = None
    # Measured after the window: bytes read + written per second (GB/s) by one large device-to-device copy,
    # the memory roofline that memory-bound kernels are judged against (None on CPU, or not measured).
    copy_bandwidth_gbps: float | None = None


@dataclass
class Kernel:
    name: str
    start_us: float
    duration_us: float
    stream: int | None = None
    device: int | None = None
    grid: list[int] | None = None
    block: list[int] | None = None


@dataclass
class Op:
    id: int
    name: str
    step: int | None
    start_us: float
    duration_us: float
    thread: int = 0
    input_shapes: list[list[int] | None] = field(default_factory=list)
    input_dtypes: list[str | None] = field(default_factory=list)
    scalars: list[Any] = field(default_factory=list)
    input_kinds: list[str | None] = field(default_factory=list)
    file: str | None = None
    line: int | None = None
    line_exact: bool = True
    function: str | None = None
    module: str | None = None
    module_class: str | None = None
    module_type: str | None = None
    lib_file: str | None = None
    lib_line: int | None = None
    lib_line_exact: bool = True
    lib_function: str | None = None
    fused_op: str | None = None
    parent: int | None = None
    depth: int = 0
    seq: int = -1
    is_backward: bool = False
    forward_op: int | None = None
    kernels: list[Kernel] = field(default_factory=list)
    gpu_time_us: float | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclass
class Gap:
    """A stretch inside a step where no kernel ran on the GPU."""

    start_us: float
    duration_us: float


@dataclass
class Step:
    index: int
    start_us: float
    end_us: float
    wall_ms: float
    gpu_busy_ms: float | None = None  # union of kernel intervals attributed to this step
    gpu_span_ms: float | None = None  # from the end of the previous step's GPU work to the end of this one's
    kernel_count: int | None = None
    idle_gaps: list[Gap] = field(default_factory=list)  # gaps of at least IDLE_GAP_MIN_US
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    allocated_at_start_bytes: int | None = None
    saved_bytes: int | None = None


@dataclass
class Annotation:
    """A named CPU range: record_function / user annotations such as `enumerate(DataLoader)#...__next__`."""

    name: str
    start_us: float
    duration_us: float
    step: int | None = None
    thread: int = 0
    file: str | None = None
    line: int | None = None


@dataclass
class SyncEvent:
    """A host-side wait for the device (cudaStreamSynchronize, cudaDeviceSynchronize, ...)."""

    name: str
    start_us: float
    duration_us: float
    step: int | None = None
    op: int | None = None  # id of the op that caused it (e.g. aten::_local_scalar_dense for .item())


@dataclass
class Memcpy:
    name: str  # e.g. "Memcpy HtoD (Pageable -> Device)"
    start_us: float
    duration_us: float
    bytes: int | None = None
    step: int | None = None
    op: int | None = None


@dataclass
class Construction:
    """Where the script built an object the rules care about, recorded while the script ran.

    kind "optimizer": cls like "torch.optim.AdamW"; attrs: fused, foreach (None when not given),
        lr, param_count, param_devices (sorted device types), param_dtypes (sorted dtype names).
    kind "dataloader": cls "torch.utils.data.DataLoader"; attrs: batch_size, num_workers, pin_memory,
        persistent_workers, dataset (class name), dataset_len (None when unsized).
    kind "module": cls "torch.nn.Linear" / "torch.nn.Embedding"; `module` is its path in the model
        (None when never called inside the window); attrs: in_features, out_features, bias (Linear) or
        num_embeddings, embedding_dim, padding_idx (Embedding).
    kind "model": the top-level module whose forward the script calls (the first module called; unwrapped
        from torch.compile and DistributedDataParallel), `cls` its qualified class, file/line where the
        user's script built or loaded it, `module` "" ; attrs: how ("constructor", "from_pretrained",
        "from_config"), package (the library of its class, None for the user's own), attn_implementation
        (HuggingFace models: the config's, e.g. "eager" or "sdpa"), supports_sdpa (with it: whether the
        class can run transformers' SDPA attention).
    kind "ddp" (issue 34; opadvisor/profile/parallel.py): cls "torch.nn.parallel.DistributedDataParallel";
        attrs: find_unused_parameters, bucket_cap_mb, gradient_as_bucket_view, static_graph, given (the
        keywords the script passed), param_tensors / grad_bytes (parameters that require grad), world_size,
        backend; after the run: unused_params (the most parameters that require grad still without a
        .grad at an optimizer step), unused_checked_steps, post_forward_ms (median host time of DDP's
        `_post_forward` per forward: with find_unused_parameters=True its autograd-graph traversal).
    kind "fsdp": one per `fully_shard(module, ...)` call, cls "torch.distributed.fsdp.fully_shard",
        `module` the path of the module it wrapped ("" the model); attrs: own_params / own_param_bytes /
        own_param_tensors (the parameters this unit owns: not those of units inside it), param_dtypes,
        module_params, units_inside (units already inside it when it was called), reshard_after_forward
        (as given, None: the default), mp_param_dtype / mp_reduce_dtype (its MixedPrecisionPolicy's, None:
        none), given, grouped (the number of modules of a list call, else None), blocks (the module's
        repeated blocks, as in a "compile" construction, when it had no unit inside), world_size, backend,
        root (it wrapped the module whose forward the script calls).
    On the construction of the module whose forward the script calls (the DDP wrapper, the root unit):
        grad_sync {"steps", "backward", "synced", "per_step": [[backward passes, synced], ...]} counted
        between optimizer steps (warm-up included); autocast (the autocast dtype of its first forward with
        grad, None without autocast); forward_at / step_at ([file, line] of that forward's call and of
        the optimizer step).

    file/line/function are the innermost user frame at the construction; lib_file/lib_line/lib_function
    the innermost library frame inside it when a library built the object (an nn.Linear built in
    `BertSelfAttention.__init__` while the user's line ran `BertForMaskedLM(config)`), as for Op.
    """

    kind: str
    cls: str
    file: str | None = None
    line: int | None = None
    function: str | None = None
    module: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    lib_file: str | None = None
    lib_line: int | None = None
    lib_function: str | None = None


@dataclass
class CompiledFrame:
    """One compilation of one frame by torch.compile (dynamo), recorded while the script ran (issue 33).

    compile_id: dynamo's "frame/compile" id ("0/0" the first compile of frame 0, "0/1" its first
    recompile). function / file / line: the code compiled (a frame resumed after a graph break is named
    "torch_dynamo_resume_in_forward_at_14"); step: the steps the script had completed when it compiled (0:
    in the first step); compile_s: dynamo's and the backend's time for it; graph_ops: ops in its graph.
    recompile_reasons: the guard failures that made dynamo compile the frame again ([] on a first compile).
    break_reason / break_explanation / break_file / break_line: the graph break that ended this graph, as
    dynamo words it and at the user's line (None when it ended without one). failed: dynamo gave up on the
    frame ("Unsupported: ... recompile limit ...": it then runs eagerly).
    """

    compile_id: str = ""
    function: str = ""
    file: str | None = None
    line: int | None = None
    step: int = 0
    compile_s: float | None = None
    graph_ops: int | None = None
    recompile_reasons: list[str] = field(default_factory=list)
    break_reason: str | None = None
    break_explanation: str | None = None
    break_file: str | None = None
    break_line: int | None = None
    failed: str | None = None

    @property
    def frame_id(self) -> str:
        """Dynamo's frame id ("0" of "0/1"): every compile of one piece of code shares it."""
        return self.compile_id.split("/", 1)[0]


@dataclass
class ModuleCall:
    """A module called inside the recorded window (see the field reference above)."""

    module: str
    module_class: str
    calls: int = 0
    file: str | None = None
    line: int | None = None
    function: str | None = None
    input_bytes: int | None = None
    saved_bytes: float | None = None
    saved_tensors: float | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Calibration:
    """Steps timed without the profiler, in the same process, just before the window (see the module doc)."""

    step_ms: list[float] = field(default_factory=list)
    method: str = "wall"  # "cuda_sync" | "wall"

    def median_ms(self) -> float | None:
        times = sorted(self.step_ms)
        if not times:
            return None
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


@dataclass
class Profile:
    schema: int = SCHEMA_VERSION
    run_id: str = ""
    created: str = ""
    script: str = ""
    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    environment: Environment = field(default_factory=Environment)
    sources: dict[str, str] = field(default_factory=dict)
    step_detection: str = "optimizer_hook"
    warmup_steps: int = 0
    steps_requested: int = 0
    complete: bool = True
    eager: bool = False
    steps: list[Step] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    annotations: list[Annotation] = field(default_factory=list)
    syncs: list[SyncEvent] = field(default_factory=list)
    memcpys: list[Memcpy] = field(default_factory=list)
    constructions: list[Construction] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    module_calls: list[ModuleCall] = field(default_factory=list)
    memory_notes: list[str] = field(default_factory=list)
    memory_requested: bool = False
    module: str | None = None
    import_root: str | None = None
    libraries: dict[str, dict[str, Any]] = field(default_factory=dict)
    library_sources: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    calibration: Calibration | None = None
    stopped: str | None = None
    steps_seen: int = 0
    compiled_frames: list[CompiledFrame] = field(default_factory=list)

    # ---- queries the rules share -------------------------------------------------------------
    @property
    def has_gpu(self) -> bool:
        return self.environment.device == "cuda"

    @property
    def step_count(self) -> int:
        return max(len(self.steps), 1)

    def median_step_ms(self) -> float | None:
        walls = sorted(s.wall_ms for s in self.steps)
        if not walls:
            return None
        mid = len(walls) // 2
        return walls[mid] if len(walls) % 2 else (walls[mid - 1] + walls[mid]) / 2

    def peak_memory(self) -> tuple[int | None, int | None]:
        """(allocated, reserved): the largest per-step CUDA peaks of the window; None where not measured."""
        alloc = [s.peak_allocated_bytes for s in self.steps if s.peak_allocated_bytes is not None]
        reserved = [s.peak_reserved_bytes for s in self.steps if s.peak_reserved_bytes is not None]
        return (max(alloc) if alloc else None), (max(reserved) if reserved else None)

    def plain_step_ms(self) -> float | None:
        """Median step time measured without the profiler (None when the run did not calibrate)."""
        return self.calibration.median_ms() if self.calibration is not None else None

    def op(self, op_id: int) -> Op:
        return self.ops[op_id]

    def children(self, op_id: int) -> list[Op]:
        return [o for o in self.ops if o.parent == op_id]

    def top_level_ops(self, *, backward: bool = False) -> list[Op]:
        """Ops called directly from Python (or, with backward=True, from the autograd engine)."""
        return [o for o in self.ops if o.parent is None and o.is_backward == backward]


# ---- JSON round trip -------------------------------------------------------------------------


_DEFAULTS: dict[type, list[tuple[str, Any]]] = {}
_INTERNED_OP_FIELDS = ("lib_file", "lib_function", "module_type", "fused_op")  # long strings repeated per op
_REQUIRED = object()  # equal to no value: required fields are always written


def _field_defaults(cls: type) -> list[tuple[str, Any]]:
    if cls not in _DEFAULTS:
        defaults = []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                defaults.append((f.name, f.default))
            elif f.default_factory is not dataclasses.MISSING:
                defaults.append((f.name, f.default_factory()))
            else:
                defaults.append((f.name, _REQUIRED))
        _DEFAULTS[cls] = defaults
    return _DEFAULTS[cls]


def _without_defaults(obj: Any) -> dict[str, Any]:
    """A flat dataclass as a dict, leaving out fields equal to their default (loading fills them back)."""
    out: dict[str, Any] = {}
    for name, default in _field_defaults(type(obj)):
        value = getattr(obj, name)
        if value != default:
            out[name] = value
    return out


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON form. Ops and kernels leave out default-valued fields, and kernel names (long C++
    template names, repeated every step) are stored once in `kernel_names` and referenced by index."""
    data = dataclasses.asdict(dataclasses.replace(profile, ops=[]))
    names: dict[str, int] = {}
    strings: dict[str, int] = {}
    ops = []
    for op in profile.ops:
        entry = _without_defaults(op)
        for key in _INTERNED_OP_FIELDS:
            if key in entry:
                entry[key] = strings.setdefault(entry[key], len(strings))
        if op.kernels:
            kernels = []
            for k in op.kernels:
                kd = _without_defaults(k)
                kd["name"] = names.setdefault(k.name, len(names))
                kernels.append(kd)
            entry["kernels"] = kernels
        ops.append(entry)
    data["ops"] = ops
    data["kernel_names"] = list(names)
    if strings:
        data["op_strings"] = list(strings)
    return data


def save_profile(profile: Profile, path: Path) -> None:
    """Write profile.json atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(profile_to_dict(profile), fh, separators=(",", ":"))
    tmp.replace(path)


# Keys every profile.json has had since schema 1 began (fields added later have defaults and may be absent).
REQUIRED_KEYS = ("script", "argv", "cwd", "environment", "steps", "ops")


def profile_from_dict(data: Any) -> Profile:
    """The Profile of a JSON object; ProfileFormatError (one line) for anything this file does not describe:
    every field is checked against its annotation as it is read."""
    if not isinstance(data, dict):
        raise ProfileFormatError("profile.json does not hold a JSON object")
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise ProfileFormatError(
            f"profile.json has schema version {schema!r}; this opadvisor reads version {SCHEMA_VERSION}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ProfileFormatError(f"profile.json is malformed: it has no {', '.join(map(repr, missing))}")
    try:
        prof = _build_profile(data)
    except _Malformed as exc:
        raise ProfileFormatError(f"profile.json is malformed: {exc}") from None
    if not prof.script:
        raise ProfileFormatError("profile.json is malformed: its 'script' is empty")
    return prof


class _Malformed(Exception):
    """Where a profile.json departs from the model, in words (`profile_from_dict` words the rest)."""


def _build_profile(data: dict[str, Any]) -> Profile:
    prof: Profile = _build(Profile, data, "")
    prof.environment = _build(Environment, prof.environment, "environment")
    prof.steps = [_build(Step, s, f"steps[{i}]") for i, s in enumerate(prof.steps)]
    for i, s in enumerate(prof.steps):
        s.idle_gaps = [_build(Gap, g, f"steps[{i}].idle_gaps[{j}]") for j, g in enumerate(s.idle_gaps)]
    prof.ops = [_build(Op, o, f"ops[{i}]") for i, o in enumerate(prof.ops)]
    names = data.get("kernel_names", [])
    if type(names) is not list or not all(type(n) is str for n in names):
        raise _Malformed("kernel_names is not a list of strings")
    for i, o in enumerate(prof.ops):
        if o.id != i:
            raise _Malformed(f"op {i} has id {o.id}")
        o.kernels = [_build(Kernel, k, f"ops[{i}].kernels[{j}]") for j, k in enumerate(o.kernels)]
        for j, k in enumerate(o.kernels):
            if type(k.name) is int:
                if not 0 <= k.name < len(names):
                    raise _Malformed(f"ops[{i}].kernels[{j}].name {k.name} is not an index into kernel_names")
                k.name = names[k.name]
    _restore_op_strings(prof.ops, data.get("op_strings", []))
    prof.annotations = [_build(Annotation, a, f"annotations[{i}]") for i, a in enumerate(prof.annotations)]
    prof.syncs = [_build(SyncEvent, s, f"syncs[{i}]") for i, s in enumerate(prof.syncs)]
    prof.memcpys = [_build(Memcpy, m, f"memcpys[{i}]") for i, m in enumerate(prof.memcpys)]
    prof.constructions = [
        _build(Construction, c, f"constructions[{i}]") for i, c in enumerate(prof.constructions)
    ]
    prof.module_calls = [_build(ModuleCall, m, f"module_calls[{i}]") for i, m in enumerate(prof.module_calls)]
    if prof.calibration is not None:
        prof.calibration = _build(Calibration, prof.calibration, "calibration")
    prof.compiled_frames = [
        _build(CompiledFrame, f, f"compiled_frames[{i}]") for i, f in enumerate(prof.compiled_frames)
    ]
    return prof


def _restore_op_strings(ops: list[Op], strings: Any) -> None:
    """Ops' interned fields (`lib_file`, `lib_function`, `module_type`, `fused_op`) from indices into `op_strings`."""
    if type(strings) is not list or not all(type(x) is str for x in strings):
        raise _Malformed("op_strings is not a list of strings")
    for i, o in enumerate(ops):
        for key in _INTERNED_OP_FIELDS:
            value = getattr(o, key)
            if type(value) is int:
                if not 0 <= value < len(strings):
                    raise _Malformed(f"ops[{i}].{key} {value} is not an index into op_strings")
                setattr(o, key, strings[value])


def _build(cls: type, data: Any, where: str) -> Any:
    """An instance of `cls` from a JSON object, each value checked against its field's annotation (nested
    dataclasses stay raw: the caller builds them). Unknown keys are ignored (a newer writer's fields)."""
    if type(data) is not dict:
        raise _Malformed(f"{where or 'the top level'} is {_shown(data)}, not an object")
    checks, required = _checks(cls)
    kwargs = {}
    for key, value in data.items():
        entry = checks.get(key)
        if entry is None:
            continue
        if not entry[0](value):
            raise _Malformed(
                f"{where}{'.' if where else ''}{key} is {_shown(value)}, not {_hint_words(entry[1])}"
            )
        kwargs[key] = value
    for key in required:
        if key not in kwargs:
            raise _Malformed(f"{where} has no {key!r}")
    return cls(**kwargs)


def _shown(value: Any) -> str:
    return json.dumps(value)[:40]


# ---- the check of each field's JSON value against its annotation ------------------------------------------

# As on disk, where that differs from the loaded model: a kernel's name is an index into `kernel_names`.
_ON_DISK: dict[tuple[type, str], Any] = {
    (Kernel, "name"): int | str,
    **{(Op, key): int | str | None for key in _INTERNED_OP_FIELDS},  # indices into `op_strings`
}
_CHECKS: dict[type, tuple[dict[str, tuple[Callable[[Any], bool], Any]], list[str]]] = {}
_SCALARS: dict[Any, tuple[type, ...]] = {
    str: (str,),
    bool: (bool,),
    int: (int,),
    float: (int, float),  # JSON writes 2.0 as 2
    type(None): (type(None),),
}


def _checks(cls: type) -> tuple[dict[str, tuple[Callable[[Any], bool], Any]], list[str]]:
    """({field: (check, annotation)}, required fields) of a dataclass, made once."""
    if cls not in _CHECKS:
        hints = typing.get_type_hints(cls)
        checks = {}
        for f in dataclasses.fields(cls):
            hint = _ON_DISK.get((cls, f.name), hints[f.name])
            checks[f.name] = (_json_check(hint), hint)
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        _CHECKS[cls] = (checks, required)
    return _CHECKS[cls]


def _json_check(hint: Any) -> Callable[[Any], bool]:
    """A predicate telling whether a value loaded from JSON fits the annotation `hint`; a dataclass-typed
    value need only be an object here (it is built, and checked, in turn). Exact types (`type(v) in ...`):
    a bool is no int here, and the check stays cheap on large profiles."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v: True
    if dataclasses.is_dataclass(hint):
        return lambda v: type(v) is dict
    scalar = _scalar_types(hint)
    if scalar is not None:
        return lambda v: type(v) in scalar
    if origin in (typing.Union, types.UnionType):
        alternatives = [_json_check(a) for a in args]
        return lambda v: any(check(v) for check in alternatives)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return lambda v: type(v) is list  # each item is built, and checked, in turn
    if origin is list:
        item_types = _scalar_types(args[0])
        if item_types is not None:
            return lambda v: type(v) is list and all(type(x) in item_types for x in v)
        item = _json_check(args[0])
        return lambda v: type(v) is list and all(item(x) for x in v)
    if origin is dict:
        key, value = _json_check(args[0]), _json_check(args[1])
        return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())
    raise TypeError(f"no JSON check for {hint!r}")  # a new field type: teach this function about it


def _scalar_types(hint: Any) -> frozenset[type] | None:
    """The exact types a scalar annotation (`int`, `str | None`, ...) allows; None for anything else."""
    if hint in _SCALARS:
        return frozenset(_SCALARS[hint])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_scalar_types(a) for a in typing.get_args(hint)]
        if all(p is not None for p in parts):
            return frozenset().union(*parts)  # type: ignore[arg-type]
    return None


def _hint_words(hint: Any) -> str:
    """An annotation as a reader writes it: `float`, `list[int] | None`, `dict[str, str]`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_hint_words(a) for a in args)
    if args:
        return f"{typing.get_origin(hint).__name__}[{', '.join(_hint_words(a) for a in args)}]"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def load_profile(path: Path) -> Profile:
    """Read profile.json; raise ProfileFormatError with a one-line reason when it cannot be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFormatError(f"{path} does not exist") from None
    except OSError as exc:
        raise ProfileFormatError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:  # opadvisor writes UTF-8: another file, or a damaged one
        raise ProfileFormatError(f"{path} is not a profile.json (not UTF-8 text: byte {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFormatError(
            f"{path} is corrupt or truncated (invalid JSON at line {exc.lineno}, column {exc.colno})"
        ) from None
    except RecursionError:
        raise ProfileFormatError(f"{path} is not a profile.json (its JSON nests too deeply)") from None
    try:
        return profile_from_dict(data)
    except ProfileFormatError as exc:
        raise ProfileFormatError(str(exc).replace("profile.json", str(path), 1)) from None
