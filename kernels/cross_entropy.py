"""`cross_entropy`: a drop-in for `torch.nn.functional.cross_entropy` that reads 16-bit logits in place.

Why: an LM head under bf16 autocast gives logits [tokens, vocab] (often a column slice of a GEMM output
padded to a multiple of 8, row stride 30528 for BERT's 30522 classes). `F.cross_entropy` there costs
2.8 ms fwd+bwd on an H200 at [8192, 30522]: log_softmax writes 16-bit log-probabilities, autocast copies
them to float32 (1 GB) for nll_loss, and the backward writes float32 gradients (zeros, then a scatter),
casts them back and runs log_softmax's backward. The kernels
here read the 16-bit logits once forward (per-row log-sum-exp in float32, loss = lse - x[target]) and once
backward (grad = (softmax - onehot) * g, written in the logits' dtype), saving only lse (float32 [N]).
The input is never modified (unlike Liger-Kernel's in-place gradient: the logits may be used elsewhere).

Layers: `_cross_entropy_triton` kernels -> `_forward` / `_backward` (launchers, through
`_launch.Launcher`) -> `CrossEntropyFunction` (eager autograd) and the custom ops
`opadvisor::cross_entropy_fwd` / `_bwd` (torch.compile with COMPILE_PATH "custom_op") -> `cross_entropy`.
`reference_cross_entropy` is the PyTorch version computed in float32 and the tests' oracle.

Semantics (those of `F.cross_entropy` with class-index targets): loss_i = logsumexp(x_i) - x_i[t_i];
rows with t_i == ignore_index give loss 0 and gradient 0; "mean" divides the sum by the number of rows
not ignored (NaN when there are none, as PyTorch), "sum" sums, "none" returns [N]. Dtypes: under autocast
for the input's device type the loss is float32 (autocast's policy for cross_entropy); otherwise it has
the input's dtype (computed in float32, rounded once). Values: float32 accurate, where eager PyTorch
(torch 2.11, CUDA, also under autocast) rounds the log-probabilities to the logits' 16-bit dtype first. The gradient has the input's dtype and shape, and
its row stride when the input's rows do not overlap (`grad_row_stride`), else it is contiguous. A target
outside [0, C) that is not ignore_index gives a NaN loss (and NaN gradients) on the kernel path instead of
PyTorch's error or device assert: checking would cost a host sync; the kernels never read out of bounds.

Dispatch (`cross_entropy_backend` says which, before the call):
- "triton" / "interpreter": input 2-D [N, C] float32/float16/bfloat16 with N, C > 0 and unit column
  stride (any row stride, read in place; another column stride is made contiguous first), target 1-D
  int64 or int32 [N] on the same device, weight None, label_smoothing 0, size_average and reduce None,
  reduction "mean", "sum" or "none". Int32 targets work here only: PyTorch's own path rejects them.
- "eager": CUDA inputs with fewer than SMALL_CLASSES classes: `F.cross_entropy` itself (launch-bound).
- "reference": everything else (weights, label smoothing, legacy arguments, class-probability targets,
  other ranks, float64, empty inputs, CPU without the interpreter, no Triton): `F.cross_entropy` with the
  arguments unchanged, so it behaves (and raises) exactly as PyTorch.
Under torch.compile, COMPILE_PATH "native" traces `F.cross_entropy` (inductor fuses it with its neighbours),
"custom_op" traces the custom op (the kernels).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from . import _backend, _dispatch
from . import _layout as layout
from ._launch import Launcher
from .softmax import triton_next_power_of_2

# CUDA inputs with fewer classes run F.cross_entropy ("eager"): at small C a row's work is too small for
# the kernel's host cost (autograd.Function, two launches, the reductions) to pay back. Measured on an
# H200 (bf16 under autocast, fwd+bwd per call from Python, synchronised; RESULTS.md "Fused cross-entropy"):
# ours 0.39-0.82 ms against eager's 0.22-0.45 ms up to 4096 classes, 0.77 vs 0.89 ms at [8192, 8192].
# After the host cost was cut (sixth session, do_bench from Python at [4096, C], ours / eager): 0.155 / 0.149
# ms at 2048 classes, 0.159 / 0.205 at 4096, 0.183 / 0.374 at 8192; kept at 8192 (fewer rows than 4096 make
# the kernel's fixed host cost count more, and the fused_cross_entropy rule keys on classes).
# The interpreter ignores it.
SMALL_CLASSES = 8192
# Classes per loop iteration of a program (at most; `_tiles` chooses per row length and alignment).
MAX_BLOCK = 4096
# Under torch.compile: "native" traces F.cross_entropy, which inductor fuses and schedules with the
# surrounding graph; "custom_op" traces opadvisor::cross_entropy_fwd (the kernels, opaque to inductor).
COMPILE_PATH = "native"

REDUCTIONS = ("mean", "sum", "none")
OP = "cross_entropy"  # its name in the dispatch record and in warnings
_TARGET_DTYPES = (torch.int64, torch.int32)


def cross_entropy_backend(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> str:
    """Which implementation `cross_entropy` runs for these arguments: "triton", "interpreter", "eager"
    (F.cross_entropy, CUDA inputs under SMALL_CLASSES classes) or "reference" (F.cross_entropy, for
    everything the kernels do not cover). See the module docstring."""
    issue = _argument_issue(
        input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
    )
    if issue is not None:
        return _backend.REFERENCE
    # for_tensor's size rule on numel N * C, with the threshold N * SMALL_CLASSES, is the rule C <
    # SMALL_CLASSES (N > 0 here), and keeps whatever else for_tensor decides (dtype, device, emptiness).
    return _backend.for_tensor(input, SMALL_CLASSES * input.shape[0])


def _argument_issue(
    input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
) -> str | None:
    """What in the arguments (all but the dtype and device rules of `_backend`) the kernels do not cover,
    or None."""
    if weight is not None:
        return "class weights"
    if label_smoothing != 0:
        return "label smoothing"
    if size_average is not None or reduce is not None:
        return "the legacy size_average / reduce arguments"
    if reduction not in REDUCTIONS or not isinstance(ignore_index, int):
        return f"reduction={reduction!r}, ignore_index={ignore_index!r}"
    if input.dim() != 2:
        return f"{input.dim()}-d logits (the kernels take [N, C])"
    if target.dim() != 1 or target.dtype not in _TARGET_DTYPES:
        return f"targets of shape {tuple(target.shape)} and dtype {target.dtype} (the kernels take class indices)"
    if target.shape[0] != input.shape[0] or target.device != input.device:
        return "targets whose length or device differ from the logits'"
    return None


def loss_dtype(input: torch.Tensor) -> torch.dtype:
    """The dtype F.cross_entropy's loss has: float32 under autocast for the input's device type (autocast
    runs cross_entropy in float32), else the input's."""
    if input.dtype != torch.float64 and torch.is_autocast_enabled(input.device.type):
        return torch.float32
    return input.dtype


def reference_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """F.cross_entropy on the input (and weight, and class-probability target) cast to float32 (float64
    for float64 input); the loss is returned in `loss_dtype(input)`, as `cross_entropy` returns it.
    Int32 class targets are widened to int64 (PyTorch rejects them; the kernels take them)."""
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    if target.is_floating_point():
        target = target.to(compute)
    elif target.dtype == torch.int32:
        target = target.long()
    w = None if weight is None else weight.to(compute)
    loss = F.cross_entropy(
        input.to(compute), target, w, size_average, ignore_index, reduce, reduction, label_smoothing
    )
    return loss.to(loss_dtype(input))


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How the kernels walk a row of classes: the forward's and the backward's classes per loop iteration
    and warps, and the forward's classes per running max / sum (`group`, 0: one per class)."""

    fwd_block: int
    fwd_warps: int
    group: int
    bwd_block: int
    bwd_warps: int


@functools.cache
def _tiles(n_cols: int, max_block: int, aligned: bool) -> Tiles:
    """The Tiles for rows of n_cols classes (one compiled variant per power of two), `aligned`: the row
    stride is a multiple of 16 bytes (each row loads in 16-byte vectors; a padded head's column slice).

    Measured on the H200 (ninth session, benchmarks/ce_sweep.py and kernels.py, bf16, GPU time alone, %
    of copy bandwidth), aligned rows: the grouped forward (groups of 8) at 2048 classes x 4 warps runs at
    93% at [8192,30528][:, :30522] (the per-class forward at 4096 x 8, the eighth session's: 67%) and at
    1024 x 2 at 79% at [4096,8192] (47%); the backward at 4096 x 16 warps, 92% on the long rows (4096 x 8:
    90%), at 2048 x 8, 89% at [4096,8192] (4096 x 8: 85%). Fwd+bwd 0.388 ms (91%, was 0.442) and 0.059 ms
    (80%, was 0.075). Unaligned rows (BERT's 30522 and GPT-2's 50257 classes contiguous: scalar loads) keep
    the eighth session's tiling: the grouped forward was 11-15% slower there (its groups then span
    threads)."""
    block = min(max(16, triton_next_power_of_2(n_cols)), max_block)
    warps = min(8, max(1, block // 512))
    if not aligned:
        return Tiles(block, warps, 0, block, warps)
    if n_cols > 8192:
        fwd_block, fwd_warps, bwd_warps = min(block, 2048), 4, 16
    else:
        fwd_block, fwd_warps, bwd_warps = min(block, 1024), 2, 8
    fwd = (fwd_block, min(fwd_warps, max(1, fwd_block // 512)), min(8, fwd_block))
    bwd_block = block if n_cols > 8192 else min(block, 2048)
    return Tiles(*fwd, bwd_block, min(bwd_warps, max(1, bwd_block // 256)))


@functools.cache
def _reduce_config(n_rows: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of `cross_entropy_reduce_kernel` for n_rows rows: all rows in one load up to
    8192 (H200, ninth session: 2.1 us at 8192 rows, 3.4 us looping over blocks of 2048)."""
    block = min(max(512, triton_next_power_of_2(n_rows)), 8192)
    return block, min(16, block // 512)


def grad_row_stride(shape: tuple[int, ...], x_strides: tuple[int, ...]) -> int:
    """Row stride of the gradient w.r.t. logits of `shape` [N, C] with row stride x_strides[0]: the
    logits' own when their rows do not overlap (a column slice of a padded GEMM output gives a gradient
    laid out like it, rows 16-byte aligned, so its stores vectorise), else C (contiguous)."""
    return x_strides[0] if x_strides[0] >= shape[1] else shape[1]


def _empty_grad(x: torch.Tensor) -> torch.Tensor:
    stride = grad_row_stride(tuple(x.shape), x.stride())
    return torch.empty_strided(x.shape, (stride, 1), dtype=x.dtype, device=x.device)


@functools.lru_cache(maxsize=1024)
def _plan(shape, x_strides, t_stride, max_block, aligned):
    """(grid, (n_cols, sx0, sdx0, st0), forward meta, backward meta) for logits of `shape` [N, C], row
    stride x_strides[0] (`aligned`: a multiple of 16 bytes)."""
    n_rows, n_cols = shape
    tiles = _tiles(n_cols, max_block, aligned)
    sdx0 = grad_row_stride(shape, x_strides)
    i64 = layout.needs_int64(shape, [x_strides, (sdx0, 1)]) or layout.needs_int64((n_rows,), [(t_stride,)])
    ints = (n_cols, x_strides[0], sdx0, t_stride)
    fwd = {"BLOCK": tiles.fwd_block, "I64": i64, "GROUP": tiles.group, "num_warps": tiles.fwd_warps}
    bwd = {"BLOCK": tiles.bwd_block, "I64": i64, "num_warps": tiles.bwd_warps}
    return (n_rows,), ints, fwd, bwd


@functools.cache
def _launchers() -> tuple[Launcher, Launcher, Launcher]:
    from . import _cross_entropy_triton as k

    return (
        Launcher(k.cross_entropy_fwd_kernel),
        Launcher(k.cross_entropy_bwd_kernel),
        Launcher(k.cross_entropy_reduce_kernel),
    )


@functools.lru_cache(maxsize=1024)
def _launch_plan(backward, shape, x_strides, t_stride, call, device, flag, max_block):
    """(Launch, integer args) of the forward or backward kernel for logits of `shape` [N, C]. call: what
    else Triton specialises the launch on, (logits dtype, target dtype, ignore_index), and for the backward
    also (upstream gradient dtype, its stride); flag: COUNT (forward) or MEAN (backward), both: reduction
    "mean". Cached: the per-call work is the lookup."""
    aligned = x_strides[0] * call[0].itemsize % 16 == 0
    grid, (n_cols, sx0, sdx0, st0), fwd, bwd = _plan(shape, x_strides, t_stride, max_block, aligned)
    launcher = _launchers()[1 if backward else 0]
    _backend.check_launch_device(device)
    if backward:
        rne = launcher.interpreted and call[0] == torch.bfloat16
        return launcher.prepare(grid, {"RNE": rne, "MEAN": flag, **bwd}), (n_cols, sx0, sdx0, st0)
    return launcher.prepare(grid, {"COUNT": flag, **fwd}), (n_cols, sx0, st0)


@functools.lru_cache(maxsize=256)
def _reduce_launch(n_rows, mean, out_dtype, device):
    """The Launch that reduces `_forward`'s rows to the loss ("mean" or "sum") for N = n_rows."""
    launcher = _launchers()[2]
    rne = launcher.interpreted and out_dtype == torch.bfloat16
    block, warps = _reduce_config(n_rows)
    return launcher.prepare((1,), {"BLOCK": block, "MEAN": mean, "RNE": rne, "num_warps": warps})


def _forward(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, count: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per row [N] loss, or with `count` [2, N]: the loss and 1.0 where the row is not ignored; lse per
    row [N]), all float32. x: [N, C] with unit column stride, N, C > 0."""
    n = x.shape[0]
    rows = torch.empty((2, n) if count else (n,), dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    call = (x.dtype, target.dtype, ignore_index)
    launch, ints = _launch_plan(
        False, x.shape, x.stride(), target.stride(0), call, x.device, count, MAX_BLOCK
    )
    loss = rows[0] if count else rows
    launch((x, target, loss, lse, rows[1] if count else loss, *ints, ignore_index))
    return rows, lse


def _backward(
    x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, count: torch.Tensor | None,
    ignore_index: int, prepared: tuple | None = None,
) -> torch.Tensor:  # fmt: skip
    """dx [N, C] in x's dtype (row stride `grad_row_stride`); g: the gradient per row, [N] (any stride)
    or 0-d (shared by all rows), divided by `count` (0-d) for "mean". `prepared`: `_prepare_backward`'s
    launch, used when g is what it was prepared for."""
    mean = count is not None
    sg0 = g.stride(0) if g.dim() == 1 else 0
    if prepared is not None and prepared[0] == (g.dtype, sg0):
        _, launch, ints, grad_strides = prepared
    else:
        call = (x.dtype, target.dtype, ignore_index, g.dtype, sg0)
        launch, ints = _launch_plan(
            True, x.shape, x.stride(), target.stride(0), call, x.device, mean, MAX_BLOCK
        )
        grad_strides = (grad_row_stride(tuple(x.shape), x.stride()), 1)
    dx = torch.empty_strided(x.shape, grad_strides, dtype=x.dtype, device=x.device)
    launch((x, target, lse, g, count if mean else g, dx, *ints, sg0, ignore_index))
    return dx


def _prepare_backward(x, target, ignore_index, reduction, out_dtype) -> tuple:
    """((gradient dtype, its stride), Launch, integer args, dx strides) of the backward for the upstream
    gradient autograd passes a loss of `out_dtype` (0-d; [N] contiguous for "none"): prepared while the
    forward runs, so the backward (on the autograd engine's device thread) only checks and launches."""
    sg0 = 1 if reduction == "none" and x.shape[0] > 1 else 0
    call = (x.dtype, target.dtype, ignore_index, out_dtype, sg0)
    mean = reduction == "mean"
    launch, ints = _launch_plan(True, x.shape, x.stride(), target.stride(0), call, x.device, mean, MAX_BLOCK)
    return (out_dtype, sg0), launch, ints, (grad_row_stride(tuple(x.shape), x.stride()), 1)


def _reduce(rows: torch.Tensor, reduction: str, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss in out_dtype, the count of rows not ignored as float32 0-d for "mean", else an empty tensor)
    from `_forward`'s rows ([2, N] for "mean"). Sums run in float32 and round once, in one launch; no host
    sync (0 / 0 gives "mean"'s NaN for all-ignored)."""
    if reduction == "none":
        return rows.to(out_dtype), rows.new_empty(0)
    mean = reduction == "mean"
    n_rows = rows.shape[-1]
    loss = torch.empty((), dtype=out_dtype, device=rows.device)
    count = torch.empty((), dtype=torch.float32, device=rows.device) if mean else rows.new_empty(0)
    _reduce_launch(n_rows, mean, out_dtype, rows.device)((rows, loss, count if mean else loss, n_rows))
    return loss, count


# ---------------------------------------------------------------------------------------------------
# Autograd (eager) and custom ops (torch.compile)
# ---------------------------------------------------------------------------------------------------


class CrossEntropyFunction(torch.autograd.Function):
    """Eager-mode autograd around the kernels. The forward also prepares the backward's launch, so the
    backward does little but launch."""

    @staticmethod
    def forward(ctx, x, target, ignore_index, reduction, out_dtype):
        mean = reduction == "mean"
        rows, lse = _forward(x, target, ignore_index, mean)
        loss, count = _reduce(rows, reduction, out_dtype)
        ctx.save_for_backward(x, target, lse, count)
        ctx.args = (ignore_index, mean, _prepare_backward(x, target, ignore_index, reduction, out_dtype))
        return loss

    @staticmethod
    def backward(ctx, dloss):
        x, target, lse, count = ctx.saved_tensors
        ignore_index, mean, prepared = ctx.args
        dx = _backward(x, target, lse, dloss, count if mean else None, ignore_index, prepared)
        return dx, None, None, None, None


@torch.library.custom_op("opadvisor::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd_op(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse float32 [N], count of rows not ignored: float32 0-d for "mean", else empty).

    out_dtype is an argument, decided where the call is traced: autocast is not in effect where the
    compiled graph later runs the op."""
    rows, lse = _forward(x, target, ignore_index, reduction == "mean")
    loss, count = _reduce(rows, reduction, out_dtype)
    return loss, lse, count


@cross_entropy_fwd_op.register_fake
def _(x, target, ignore_index, reduction, out_dtype):
    n = x.shape[0]
    loss = x.new_empty((n,) if reduction == "none" else (), dtype=out_dtype)
    count = x.new_empty(() if reduction == "mean" else (0,), dtype=torch.float32)
    return loss, x.new_empty((n,), dtype=torch.float32), count


@torch.library.custom_op("opadvisor::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd_op(
    x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, count: torch.Tensor,
    ignore_index: int, mean: bool,
) -> torch.Tensor:  # fmt: skip
    """dx in x's dtype; g as `_backward` takes it, divided by `count` when `mean`."""
    return _backward(x, target, lse, g, count if mean else None, ignore_index)


@cross_entropy_bwd_op.register_fake
def _(x, target, lse, g, count, ignore_index, mean):
    return _empty_grad(x)


def _setup_context(ctx, inputs, output):
    x, target, ignore_index, reduction, _ = inputs
    _, lse, count = output
    ctx.save_for_backward(x, target, lse, count)
    ctx.args = (ignore_index, reduction == "mean")


def _op_backward(ctx, dloss, _dlse, _dcount):
    x, target, lse, count = ctx.saved_tensors
    ignore_index, mean = ctx.args
    return cross_entropy_bwd_op(x, target, lse, dloss, count, ignore_index, mean), None, None, None, None


torch.library.register_autograd(cross_entropy_fwd_op, _op_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """`F.cross_entropy(input, target, ...)`, same arguments and results; fused kernels for class-index
    targets on 2-D float32/float16/bfloat16 logits.

    Args: as `torch.nn.functional.cross_entropy`. The kernels take input [N, C] with any row stride (a
    column slice of a padded tensor is read in place) and target [N] int64 or int32; other cases run
    `F.cross_entropy` itself (`cross_entropy_backend` says which, see the module docstring).

    Returns the loss: [] for "mean" / "sum", [N] for "none"; float32 under autocast, else input's dtype.
    On the kernel path a target outside [0, C) (other than ignore_index) gives NaN instead of an error.
    """
    backend = cross_entropy_backend(
        input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
    )
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(
            OP,
            _fallback_reason(
                input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
            ),
        )
    elif backend == _backend.EAGER or (torch.compiler.is_compiling() and COMPILE_PATH == "native"):
        _dispatch.record(OP, _dispatch.CHAIN)
    else:
        _dispatch.record(OP, _dispatch.KERNEL)
        return _run_kernel(input, target, ignore_index, reduction)
    return F.cross_entropy(
        input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing
    )


def _fallback_reason(input, target, *args) -> str | None:
    """Why a call the kernels' backend could take runs F.cross_entropy instead (None: the documented CPU
    path, or an empty input)."""
    if _backend.backend(input) == _backend.REFERENCE:
        return _backend.fallback_reason(input)
    issue = _argument_issue(input, target, *args)
    if issue is not None:
        return f"{issue}: F.cross_entropy runs"
    return _backend.fallback_reason(input)


def _run_kernel(input, target, ignore_index, reduction):
    x = input
    if input.stride(1) != 1 and input.shape[1] != 1:
        _dispatch.warn_fallback(OP, "logits whose column stride is not 1 are copied first")
        x = input.contiguous()
    out_dtype = loss_dtype(input)
    if torch.compiler.is_compiling():
        return cross_entropy_fwd_op(x, target, ignore_index, reduction, out_dtype)[0]
    return CrossEntropyFunction.apply(x, target, ignore_index, reduction, out_dtype)
