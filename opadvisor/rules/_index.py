"""One pass over a Profile that every rule shares: ops indexed by step, thread, user function and cost.

Rules never scan `profile.ops` repeatedly (a profile holds tens of thousands of ops); they ask the index,
built once per profile in O(number of ops) and cached on the profile object:

    from opadvisor.rules._index import index_of
    ix = index_of(profile)
    for frame in ix.frames:              # the ops one user function ran, in order (see Frame)
        ...
    ix.sequences[(step, thread, run)]    # forward root ops of one step on one thread, in order (a run ends at an opadvisor fused op)
    ix.frame_of[op.id]                   # the Frame of a forward root op (absent: no user file)
    ix.cost_us(op)                       # this op's own time, GPU when the profile has it, else CPU
    ix.site_cost_us([op, ...])           # forward ops + the backward ops autograd ran for them
    ix.kernel_count(op)                  # kernels launched by op and everything under it (0 on a CPU profile)
    ix.step_ms                           # median step time (None when the profile recorded no step):
                                         # per step the longer of CPU wall time and GPU span
    ix.calibration                       # the plain step (timed without the profiler), the scale for
                                         # idle-based times, the step that shares are of (_calibration)

Vocabulary used across the helpers:

- *root op*: an op with `parent is None`, i.e. called directly from Python (forward) or by the autograd
  engine (backward). Only root ops are matched and costed, so nested ops (aten::linear -> aten::addmm)
  are never counted twice; their kernels and time are inside the root's inclusive numbers. A root op
  that is not an aten op but a wrapper (a user `torch.autograd.Function` such as DeBERTa's XSoftmax, a
  named range) is replaced by the ops it holds: those are what the user's code called.
- *frame*: the forward root ops, in the order they ran, that one user function (`op.file`, `op.function`)
  ran in one step on one thread, cut where the module of the calling code (`owner_module`) changes to a
  non-nested one (layer 0's `forward` and layer 1's `forward` are separate frames even when no other op
  runs between them).
- *time basis*: "gpu" when the profile has CUDA kernels (times are kernel times), "cpu" otherwise (times are
  the ops' inclusive CPU durations). Never mix: `ix.basis` says which one every cost is in.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from opadvisor.profile.model import Op, Profile
from opadvisor.rules._calibration import StepCalibration, step_calibration

__all__ = ["Frame", "ProfileIndex", "index_of", "median_step_ms", "module_related", "owner_module"]


@dataclass
class Frame:
    """The forward root ops that one call (or run of calls) of a user function made, in the order they ran.

    `ops` holds only forward root ops with a known user file; `positions[op.id]` is the op's index in `ops`.
    `module` is the shortest `owner_module` seen in the frame (the module whose code this is, when known).
    """

    step: int | None
    thread: int
    file: str
    function: str | None
    module: str | None
    ops: list[Op] = field(default_factory=list)
    positions: dict[int, int] = field(default_factory=dict)

    def append(self, op: Op) -> None:
        self.positions[op.id] = len(self.ops)
        self.ops.append(op)


# torch.nn's own module classes: an op run inside one of these (`self.proj(x)`) was called from the user
# function of the module that owns it, so that function's module is the parent path.
TORCH_NN_CLASSES: frozenset[str] = frozenset(
    """AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveLogSoftmaxWithLoss AdaptiveMaxPool1d
    AdaptiveMaxPool2d AdaptiveMaxPool3d AlphaDropout AvgPool1d AvgPool2d AvgPool3d BCELoss BCEWithLogitsLoss
    BatchNorm1d BatchNorm2d BatchNorm3d Bilinear CELU CTCLoss ChannelShuffle CircularPad1d CircularPad2d
    CircularPad3d ConstantPad1d ConstantPad2d ConstantPad3d Conv1d Conv2d Conv3d ConvTranspose1d
    ConvTranspose2d ConvTranspose3d CosineEmbeddingLoss CosineSimilarity CrossEntropyLoss CrossMapLRN2d
    Dropout Dropout1d Dropout2d Dropout3d ELU Embedding EmbeddingBag FeatureAlphaDropout Flatten Fold
    FractionalMaxPool2d FractionalMaxPool3d GELU GLU GRU GRUCell GaussianNLLLoss GroupNorm Hardshrink
    Hardsigmoid Hardswish Hardtanh HingeEmbeddingLoss HuberLoss Identity InstanceNorm1d InstanceNorm2d
    InstanceNorm3d KLDivLoss L1Loss LPPool1d LPPool2d LPPool3d LSTM LSTMCell LayerNorm LazyLinear LeakyReLU
    Linear LocalResponseNorm LogSigmoid LogSoftmax MSELoss MarginRankingLoss MaxPool1d MaxPool2d MaxPool3d
    Mish MultiLabelMarginLoss MultiLabelSoftMarginLoss MultiMarginLoss MultiheadAttention NLLLoss PReLU
    PairwiseDistance PixelShuffle PixelUnshuffle PoissonNLLLoss RMSNorm RNN RNNCell RReLU ReLU ReLU6
    ReflectionPad1d ReflectionPad2d ReflectionPad3d ReplicationPad1d ReplicationPad2d ReplicationPad3d SELU
    Sequential SiLU Sigmoid SmoothL1Loss SoftMarginLoss Softmax Softmax2d Softmin Softplus Softshrink
    Softsign SyncBatchNorm Tanh Tanhshrink Threshold TripletMarginLoss Unflatten Unfold Upsample
    UpsamplingBilinear2d UpsamplingNearest2d ZeroPad1d ZeroPad2d ZeroPad3d""".split()
)


def owner_module(op: Op) -> str | None:
    """The module path of the user code that called `op`.

    `op.module` is the innermost nn.Module running; when that is one of torch.nn's own classes (the op
    ran inside `self.proj(x)`), the user's code belongs to the module holding it: the parent path.
    """
    mod = op.module
    if mod is None or op.module_class not in TORCH_NN_CLASSES:
        return mod
    return mod.rpartition(".")[0]


def module_related(a: str | None, b: str | None) -> bool:
    """True when module paths a and b are the same module or one holds the other (dotted prefix)."""
    if a is None or b is None or a == b:
        return True
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return short == "" or long.startswith(short + ".")


class ProfileIndex:
    """Indexes of one profile, built once (use `index_of(profile)`). Read-only after construction."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.gpu: bool = profile.has_gpu
        self.basis: str = "gpu" if self.gpu else "cpu"
        ops = profile.ops
        self._index_tree(ops)
        self.steps_recorded: int = profile.step_count
        self.step_ms: float | None = median_step_ms(profile)
        # the plain step (timed without the profiler) and the scale for idle-based times
        self.calibration: StepCalibration = step_calibration(profile, self.step_ms)
        in_window = (lambda o: o.step is not None) if profile.steps else (lambda o: True)
        self._in_window = in_window
        self._index_backward(ops)
        self._index_frames(ops)

    def _index_tree(self, ops: list[Op]) -> None:
        """children, root_id and the kernels under each op (its own and its descendants')."""
        n = len(ops)
        self.children: list[list[int]] = [[] for _ in range(n)]
        self.root_id: list[int] = list(range(n))
        # ops are in start order, so a parent always comes before its children
        for op in ops:
            if op.parent is not None and 0 <= op.parent < n:
                self.children[op.parent].append(op.id)
                self.root_id[op.id] = self.root_id[op.parent]
        self._kernels: list[int] = [len(op.kernels) for op in ops]
        for op in reversed(ops):  # children after parents: accumulate bottom-up
            if op.parent is not None and 0 <= op.parent < n:
                self._kernels[op.parent] += self._kernels[op.id]

    def _index_backward(self, ops: list[Op]) -> None:
        """Backward root ops per forward root op (autograd links backward ops to their forward op)."""
        n, in_window = len(ops), self._in_window
        self.backward_of: dict[int, list[int]] = defaultdict(list)
        pending_fwd: dict[int, int | None] = {}
        for op in ops:
            if not op.is_backward or not in_window(op):
                continue
            rid = self.root_id[op.id]
            if op.forward_op is not None and pending_fwd.get(rid) is None and 0 <= op.forward_op < n:
                pending_fwd[rid] = self.root_id[op.forward_op]
            else:
                pending_fwd.setdefault(rid, None)
        for bwd_root, fwd_root in pending_fwd.items():
            if fwd_root is not None:
                self.backward_of[fwd_root].append(bwd_root)

    def _index_frames(self, ops: list[Op]) -> None:
        """Frames: forward root ops by (step, thread, file, function), cut at unrelated module paths; and
        the forward root ops in sequences (step, thread, run)."""
        in_window = self._in_window
        self.frames: list[Frame] = []
        self.frame_of: dict[int, Frame] = {}
        open_frames: dict[tuple, Frame] = {}
        self.forward_root_ops: list[Op] = []
        # (step, thread, run) -> roots in order; a run ends where an opadvisor fused op ran, whose own ops
        # (its plain chain below its size threshold) hold no pattern of the model's and join none
        self.sequences: dict[tuple[int | None, int, int], list[Op]] = defaultdict(list)
        runs: dict[tuple[int | None, int], int] = defaultdict(int)  # (step, thread) -> its current run
        wrappers: set[int] = set()
        for op in ops:
            if op.is_backward or not in_window(op):
                continue
            if op.parent is not None and op.parent not in wrappers:
                continue
            if "::" not in op.name and self.children[op.id]:
                wrappers.add(op.id)  # an autograd.Function / named range: its ops are the calls
                continue
            self.forward_root_ops.append(op)
            if op.fused_op is not None:
                runs[(op.step, op.thread)] += 1  # the ops after it start a new run
                continue
            self.sequences[(op.step, op.thread, runs[(op.step, op.thread)])].append(op)
            if op.file is None:
                continue
            key = (op.step, op.thread, op.file, op.function)
            frame = open_frames.get(key)
            owner = owner_module(op)
            if frame is None or not module_related(frame.module, owner):
                frame = Frame(op.step, op.thread, op.file, op.function, owner)
                open_frames[key] = frame
                self.frames.append(frame)
            elif owner is not None and (frame.module is None or len(owner) < len(frame.module)):
                frame.module = owner
            frame.append(op)
            self.frame_of[op.id] = frame

    # ---- costs ---------------------------------------------------------------------------------
    def cost_us(self, op: Op) -> float:
        """Inclusive time of one op in the index's basis: GPU kernel time (0 when it launched none) or CPU."""
        if self.gpu:
            return op.gpu_time_us or 0.0
        return op.duration_us

    def kernel_count(self, op: Op) -> int:
        """Kernels launched by op and its descendants (always 0 on a CPU profile)."""
        return self._kernels[op.id]

    def backward_ops(self, op: Op) -> list[Op]:
        """The backward root ops autograd ran for forward root op `op` (empty when none were linked)."""
        return [self.profile.ops[i] for i in self.backward_of.get(op.id, ())]

    def site_cost_us(self, ops: Iterable[Op], *, backward: bool = True) -> float:
        """Summed cost of forward root ops and (by default) the backward ops linked to them."""
        total = 0.0
        for op in ops:
            total += self.cost_us(op)
            if backward:
                total += sum(self.cost_us(b) for b in self.backward_ops(op))
        return total

    def site_kernels(self, ops: Iterable[Op], *, backward: bool = True) -> int:
        """Kernels launched by forward root ops and (by default) their backward ops."""
        total = 0
        for op in ops:
            total += self.kernel_count(op)
            if backward:
                total += sum(self.kernel_count(b) for b in self.backward_ops(op))
        return total

    def per_step_ms(self, total_us: float) -> float:
        """A total over the recorded window, in ms per step."""
        return total_us / 1000.0 / self.steps_recorded

    def share_of_step(self, ms_per_step: float | None) -> float | None:
        """ms per step as a fraction of the median step: the plain one on a calibrated GPU profile
        (see `_calibration`), else the profiled one (None when unknown)."""
        base = self.calibration.share_base_ms
        if ms_per_step is None or not base:
            return None
        return ms_per_step / base

    # ---- navigation ----------------------------------------------------------------------------
    def descendants(self, op: Op) -> list[Op]:
        """Every op nested under `op`, depth first, in start order."""
        out: list[Op] = []
        stack = list(reversed(self.children[op.id]))
        while stack:
            cur = self.profile.ops[stack.pop()]
            out.append(cur)
            stack.extend(reversed(self.children[cur.id]))
        return out

    def root(self, op: Op) -> Op:
        return self.profile.ops[self.root_id[op.id]]

    def in_window(self, op: Op) -> bool:
        """True for ops inside a recorded step (every op when the profile has no steps)."""
        return self._in_window(op)

    def module_ops(self, module: str, module_class: str) -> list[Op]:
        """Forward root ops run while `module` (its path, and its class: two models may both have a
        "cell") was the innermost module running; `module_class` qualified or short."""
        short = module_class.rpartition(".")[2]
        return [
            op
            for op in self.forward_root_ops
            if op.module == module and (op.module_class is None or op.module_class == short)
        ]

    def forward_roots(self, names: Sequence[str] | None = None) -> list[Op]:
        """Forward root ops in the window, optionally only those with one of `names`, in start order."""
        wanted = set(names) if names else None
        return [op for op in self.forward_root_ops if wanted is None or op.name in wanted]


def median_step_ms(profile: Profile) -> float | None:
    """Median step time: per step the longer of the CPU wall time and the GPU's span for that step.

    On a GPU the CPU runs ahead of the device (kernels of step N may run during step N+1), so a step's
    CPU wall time can be far shorter than the GPU work it queued; the GPU span is the honest length then.
    """
    times = sorted(max(s.wall_ms, s.gpu_span_ms or 0.0) for s in profile.steps)
    if not times:
        return None
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2


def index_of(profile: Profile) -> ProfileIndex:
    """The (cached) index of `profile`. Build it once; every rule calls this."""
    ix = profile.__dict__.get("_opadvisor_index")
    if ix is None or ix.profile is not profile or len(profile.ops) != ix._ops_len:
        ix = ProfileIndex(profile)
        ix._ops_len = len(profile.ops)
        profile.__dict__["_opadvisor_index"] = ix
    return ix
