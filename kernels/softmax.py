"""`masked_softmax`: scale -> mask -> softmax -> (zero masked) -> dropout in one kernel, forward and backward.

Layers, from the inside out (Liger-Kernel's naming):
`_softmax_triton.masked_softmax_fwd_kernel` / `..._bwd_kernel` (Triton) -> `_forward` / `_backward`
(launchers) -> `MaskedSoftmaxFunction` (autograd, eager mode) and the custom ops
`opadvisor::masked_softmax_fwd` / `opadvisor::masked_softmax_bwd` (what torch.compile traces, without a graph
break) -> `masked_softmax` (the public function). `reference_masked_softmax` is the PyTorch version in
float32: it runs where the kernels do not (CPU, float64, no Triton; see `masked_softmax_backend`) and is the
test oracle. `eager_masked_softmax` is the chain a user writes, in the input's dtype: it runs on CUDA under
SMALL_NUMEL elements, where a kernel call costs more host time than it saves on the GPU.

Host cost of a kernel call: the per-layout plan (grid, integers, the compiled kernel per alignment) is cached
(`_launch`), the forward also prepares the backward's launch, and the backward (which autograd runs on its
device thread, where Python is slow) checks dy's strides and launches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from . import _backend, _dispatch, _rng
from . import _layout as layout
from ._launch import Launcher

# Rows up to MAX_BLOCK columns are held in registers by one program (one read of x); longer rows loop
# over tiles of LOOP_BLOCK columns (two reads of x; the second mostly from L2). On an H200, bf16 rows of
# 8192 and 16384 ran 1.4x and 1.5x faster in one program than looped. Tests lower both to exercise the
# looped kernels on small inputs.
MAX_BLOCK = 16384
LOOP_BLOCK = 4096
# True: one Philox call per 4 columns, its words interleaved in registers; False: one call per element,
# same bits. True is what the softmax benchmark measured; bias_dropout_add measured False faster.
RNG_INTERLEAVE = True
# True: the forward holds a row of a power of two columns, more than one warp's lanes cover with 16-byte
# vectors, in SPLIT pieces per thread, so that each warp has whole rows and the row max and sum need no
# barrier (_softmax_triton._fwd_tile_split; `_row_split` says where). Measured on an H200 (tenth session,
# benchmarks/softmax_sweep.py, GPU time), split / not: [32,16,512,512] bf16 pad mask fwd 0.143 / 0.160 ms
# (88% / 79% of copy), fwd+bwd 0.326 / 0.351; BERT's [16,12,512,512] add mask + scale + dropout fwd 0.097 /
# 0.102, fwd+bwd 0.178 / 0.185; bf16 rows of 1024 and float32 rows of 512 faster too. Same dropout mask;
# y and dx differ from the unsplit kernel's in float32 rounding only (24 of 6.3M y elements by one step).
ROW_SPLIT = True
# On CUDA, tensors with fewer elements run the plain chain (`eager_masked_softmax`) instead. From Python a
# kernel call costs more host time than the chain's few ops (an autograd.Function whose backward runs Python
# on the autograd engine's device thread: ~0.2 ms fwd+bwd against the chain's ~0.15-0.19 ms on an H200
# host), which the kernel's GPU saving covers only from ~16M elements: fwd+bwd from Python at [B,12,128,128]
# with an additive mask, scale and dropout, kernel / chain: 0.21 / 0.18 ms at 8.3M elements, 0.20 / 0.25 at
# 16.7M, 0.15 / 0.47 at 33M (benchmarks/RESULTS.md, "Dispatch").
SMALL_NUMEL = 1 << 24


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How the forward kernel covers rows held whole in registers (rows up to MAX_BLOCK columns).

    rows, warps: rows per tile and warps per program. share_mask: load a mask row that the whole tile shares
    once (where the layout allows, see `_plan`). programs_per_sm: 0 runs one tile per program; n runs n
    programs per multiprocessor, each looping over tiles, `stages` pipelining the loop's loads. (Streaming
    cache hints, x loaded "evict first" and y stored ".cs", were measured too: slower in every configuration
    of benchmarks/softmax_sweep.py on an H200, so not offered.)"""

    rows: int
    warps: int
    share_mask: bool = True
    programs_per_sm: int = 0
    stages: int = 1

    def __post_init__(self) -> None:
        # On the H200 (eighth session) a one-warp forward (rows=2, warps=1) gave other bits than the default
        # launch: y with dropout, and dx without, though y was equal there; the cause is not found, so no
        # one-warp launch is offered until it is (the default `_config` never picks fewer than 4 warps).
        if self.warps < 2:
            raise ValueError(
                f"ForwardConfig: warps={self.warps}: one-warp forwards are not offered (see its code)"
            )


# The forward's configuration per row block (the row length rounded up to a power of two), where
# benchmarks/softmax_sweep.py measured one better than `_config`'s (which the backward always keeps).
FORWARD_CONFIGS: dict[int, ForwardConfig] = {}

_NO_SEED = (0, 0, 0)
OP = "masked_softmax"  # its name in the dispatch record and in warnings


def _representable(fill_value: float, dtype: torch.dtype) -> float:
    """`fill_value` clamped to `dtype`'s finite range (-1e9 in float16 would overflow; -inf stays): the
    kernels apply it in float32, and exp() of either is 0 next to any unmasked score."""
    if math.isinf(fill_value) or not dtype.is_floating_point:
        return fill_value
    info = torch.finfo(dtype)
    return min(max(fill_value, info.min), info.max)


def masked_softmax_backend(x: torch.Tensor) -> str:
    """Which implementation `masked_softmax(x, ...)` runs: "triton", "interpreter", "reference", or "eager"
    (CUDA tensors under SMALL_NUMEL elements: `eager_masked_softmax`, the plain chain)."""
    return _backend.for_tensor(x, SMALL_NUMEL)


def eager_masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dim: int = -1,
    scale: float | None = None,
    fill_value: float = float("-inf"),
    zero_masked: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """The chain a user writes, as PyTorch ops in x's dtype: scale, mask, softmax, zero masked, dropout.

    What `masked_softmax` runs where a kernel would cost more than it saves (the size dispatch), with the
    chain's own results: a row whose scores are all -inf gives NaN here, as it did in the code the rewrite
    replaced (the kernels and the reference give zeros)."""
    s = x if scale is None else x * scale
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(mask, _representable(fill_value, s.dtype))
    elif mask is not None:
        s = s + mask
    y = torch.softmax(s, dim)
    if zero_masked and mask is not None:
        y = y.masked_fill(mask, 0.0)
    if training and dropout_p > 0:
        y = F.dropout(y, dropout_p)
    return y if y.dtype == x.dtype else y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Reference (plain PyTorch)
# ---------------------------------------------------------------------------------------------------


def reference_masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dim: int = -1,
    scale: float | None = None,
    fill_value: float = float("-inf"),
    zero_masked: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The function `masked_softmax` computes, in float32 (float64 for float64 input), with PyTorch ops.

    Rows whose scores are all -inf (where the original chain gives NaN) give zeros. Dropout uses
    PyTorch's own generator, unless `keep` (a bool mask of x's shape) is given: the tests pass the
    kernels' Philox mask there to compare bit for bit.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = x.to(compute)
    if scale is not None:
        s = s * scale
    if mask is not None:
        s = s.masked_fill(mask, fill_value) if mask.dtype == torch.bool else s + mask.to(compute)
    if s.numel() > 0 and s.shape[dim] > 0:
        dead = s.amax(dim, keepdim=True) == float("-inf")
        p = torch.softmax(s.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)
    else:
        p = torch.softmax(s, dim)
    if zero_masked and mask is not None:
        p = p.masked_fill(mask, 0.0)
    if training and dropout_p > 0:
        if keep is None:
            p = F.dropout(p, dropout_p)
        else:
            p = torch.where(keep, p * _rng.keep_scale(dropout_p), 0.0)
    return p.to(x.dtype)


def philox_keep_like(x: torch.Tensor, dim: int, seed: _rng.Seed, p: float) -> torch.Tensor:
    """The keep mask the kernels draw for `x` (softmax over `dim`) and `seed`, as a bool tensor like x."""
    moved = x.movedim(dim, -1).shape
    n_cols = moved[-1]
    keep = _rng.philox_keep_mask(_rng.host_seed(seed), x.numel() // max(n_cols, 1), n_cols, p, x.device)
    return keep.reshape(moved).movedim(-1, dim)


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


@functools.cache
def _config(n_cols: int, max_block: int, loop_block: int) -> tuple[int, int, bool, int]:
    """(ROWS, BLOCK, LOOPED, num_warps) for a row length: one compiled variant per power of two."""
    if n_cols > max_block:
        return 1, loop_block, True, 8 if loop_block >= 2048 else 4
    block = max(16, triton_next_power_of_2(n_cols))
    rows = max(1, 4096 // block)
    warps = min(16, max(4, rows * block // 1024))  # 32 values a thread: measured best at [32,16,512,512]
    return rows, block, False, warps


def triton_next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _mask_kind(mask: torch.Tensor | None) -> int:
    if mask is None:
        return 0
    return 1 if mask.dtype == torch.bool else 2


def _mask_meta(mask: torch.Tensor | None):
    return None if mask is None else (tuple(mask.shape), mask.stride())


def _mask_arg(mask: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """The mask pointer for the kernel (bool read as uint8); any tensor when there is no mask."""
    if mask is None:
        return fallback
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _forward_config(n_cols: int) -> ForwardConfig | None:
    """FORWARD_CONFIGS' entry for rows of `n_cols` held whole (None: `_config`'s choice)."""
    return FORWARD_CONFIGS.get(max(16, triton_next_power_of_2(n_cols))) if FORWARD_CONFIGS else None


@functools.lru_cache(maxsize=4096)
def _plan(shape, strides, mask_meta, dim, max_block, loop_block, forward: ForwardConfig | None = None):
    """(grid, integer args, launch meta) for tensors of `shape` (strides: x or dy, then the outputs,
    which are contiguous), or None when the layout needs a copy first. Cached per layout. `forward`
    overrides `_config` for rows held whole (the forward kernel's FORWARD_CONFIGS entry)."""
    out = layout.contiguous_strides(shape)
    mask_strides = out if mask_meta is None else layout.expanded_strides(*mask_meta, shape)
    got = layout.row_layout(shape, [strides, mask_strides, out], dim)
    if got is None:
        return None
    n_rows, n_cols, (_, d1, d2), (s_in, s_mask, s_out) = got
    rows, block, looped, warps = _config(n_cols, max_block, loop_block)
    if forward is not None and not looped:
        rows, warps = forward.rows, forward.warps
    i64 = layout.needs_int64(shape, [strides, mask_strides, out])
    # A program's rows lie in one run of D2 rows when ROWS divides D2; if the mask does not move along D2
    # (a [B,1,1,S] padding mask), they all read one mask row, which the kernel then loads once.
    shared = mask_meta is not None and rows > 1 and s_mask[2] == 0 and d2 % rows == 0
    shared = shared and (forward is None or forward.share_mask)
    meta = {
        "ROWS": rows,
        "BLOCK": block,
        "LOOPED": looped,
        "I64": i64,
        "MASK_SHARED": shared,
        "num_warps": warps,
    }
    return (triton_cdiv(n_rows, rows),), (n_rows, n_cols, d1, d2, *s_in, *s_mask, *s_out), meta


def _plan_for(x: torch.Tensor, mask: torch.Tensor | None, dim: int):
    """The launch plan and the tensors to launch on (copies only for layouts with > 3 batch dims)."""
    plan = _plan(x.shape, x.stride(), _mask_meta(mask), dim, MAX_BLOCK, LOOP_BLOCK)
    if plan is None:
        x = x.contiguous()
        mask = None if mask is None else mask.expand(x.shape).contiguous()
        plan = _plan(x.shape, x.stride(), _mask_meta(mask), dim, MAX_BLOCK, LOOP_BLOCK)
    return plan, x, mask


@functools.cache
def _launchers() -> tuple[Launcher, Launcher]:
    from . import _softmax_triton as k

    return Launcher(k.masked_softmax_fwd_kernel), Launcher(k.masked_softmax_bwd_kernel)


@functools.lru_cache(maxsize=4096)
def _launch_plan(
    backward, shape, strides, mask_meta, dim, dtypes, device, flags, max_block, loop_block, forward=None
):  # fmt: skip
    """(Launch, integer args) of the forward (strides: x's) or backward (strides: dy's) kernel for one
    layout, or None when it needs a copy first. dtypes: (x, x) or (dy, the saved probabilities); flags:
    (MASK, ZERO_MASKED, DROPOUT, SEED_PTR, INTERLEAVE, ROW_SPLIT, scale != 1); mask_meta: (shape, strides,
    dtype) or None; forward: the forward's ForwardConfig or None. Cached: the per-call work is the lookup."""
    mask_sh = None if mask_meta is None else mask_meta[:2]
    plan = _plan(shape, strides, mask_sh, dim, max_block, loop_block, None if backward else forward)
    if plan is None:
        return None
    grid, ints, meta = plan
    if backward:  # the kernel reads P (contiguous, like the output), dy, the mask, and writes dx
        n_rows, n_cols, d1, d2, *st = ints
        ints = (n_rows, n_cols, d1, d2, *st[8:12], *st[0:4], *st[4:8], *st[8:12])
    else:
        grid, meta = _forward_grid(grid, meta, forward, device)
        meta.update(_split_meta(ints[0], ints[1], dtypes[0], meta, flags, max_block, loop_block))
    launcher = _launchers()[1 if backward else 0]
    _backend.check_launch_device(device)
    mask_kind, zero_masked, dropout, seed_ptr, interleave, _, _ = flags
    full = {
        "MASK": mask_kind, "ZERO_MASKED": zero_masked, "DROPOUT": dropout, "INTERLEAVE": interleave,
        "RNE": launcher.interpreted and dtypes[1] == torch.bfloat16, "SEED_PTR": seed_ptr, **meta,
    }  # fmt: skip
    return launcher.prepare(grid, full), ints


def _split_meta(n_rows, n_cols, dtype, meta, flags, max_block, loop_block) -> dict:
    """The forward's SPLIT, EVEN and SCALED constexprs (see _softmax_triton._fwd_tile_split; with SPLIT = 1
    the other two are fixed, the plain tile not using them)."""
    split = _row_split(n_cols, dtype, max_block, loop_block) if flags[5] and not meta["LOOPED"] else 1
    if split == 1:
        return {"SPLIT": 1, "EVEN": False, "SCALED": True}
    even = n_rows % meta["ROWS"] == 0 and n_cols == meta["BLOCK"]
    return {"SPLIT": split, "EVEN": even, "SCALED": flags[6]}


def _row_split(n_cols: int, dtype: torch.dtype, max_block: int, loop_block: int) -> int:
    """The forward's SPLIT for rows of `n_cols` held whole: BLOCK over the columns one warp covers in
    16-byte vectors, for rows of a power of two columns (rows of other lengths load less than 16 bytes at a
    time unless their strides allow it; not measured) where `_config` gives at least a row per warp; else 1.
    Configurations with no more warps than rows keep the warps along the rows and sum a row in one order."""
    rows, block, looped, warps = _config(n_cols, max_block, loop_block)
    warp_cols = 32 * max(1, 16 // dtype.itemsize)
    if looped or n_cols != block or rows < warps or block <= warp_cols:
        return 1
    return block // warp_cols


def _forward_grid(grid, meta, forward: ForwardConfig | None, device: torch.device):
    """The forward kernel's grid and its constexprs beyond `_plan`'s: a persistent grid (at most
    `programs_per_sm` programs per multiprocessor) when the config asks for one and rows are held whole."""
    persistent = forward is not None and forward.programs_per_sm > 0 and not meta["LOOPED"]
    if persistent:
        grid = (max(1, min(grid[0], forward.programs_per_sm * _backend.multiprocessors(device))),)
    return grid, {**meta, "PERSISTENT": persistent, "STAGES": forward.stages if persistent else 1}


def _launch_for(backward, t, mask, dim, zero_masked, p, seed, out_dtype, scaled=True):
    """(Launch, integer args, t, mask): t is x (forward) or dy (backward), out_dtype the dtype of y / saved
    and dx, scaled whether the forward's scale is not 1; t and mask copied to contiguous first when their
    layout needs it (warned once)."""
    flags = (_mask_kind(mask), zero_masked and mask is not None, p > 0, isinstance(seed, torch.Tensor),
             RNG_INTERLEAVE, ROW_SPLIT, scaled)  # fmt: skip
    mask_meta = None if mask is None else (tuple(mask.shape), mask.stride(), mask.dtype)
    forward = None if backward else _forward_config(t.shape[dim])
    key = (t.shape, t.stride(), mask_meta, dim, (t.dtype, out_dtype), t.device, flags, MAX_BLOCK, LOOP_BLOCK)
    got = _launch_plan(backward, *key, forward)
    if got is None:
        _dispatch.warn_fallback(OP, "inputs whose batch dimensions do not merge into three are copied first")
        t = t.contiguous()
        mask = None if mask is None else mask.expand(t.shape).contiguous()
        return _launch_for(backward, t, mask, dim, zero_masked, p, seed, out_dtype, scaled)
    return (*got, t, mask)


def _forward(x, mask, dim, scale, fill_value, zero_masked, p, seed):
    """Launch the forward kernel: (y, saved) where saved holds p before dropout (None without dropout)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    saved = torch.empty(x.shape, dtype=x.dtype, device=x.device) if p > 0 else None
    if x.numel() == 0:
        return y, saved
    launch, ints, x, mask = _launch_for(False, x, mask, dim, zero_masked, p, seed, x.dtype, scale != 1.0)
    launch(
        (x, _mask_arg(mask, x), y, y if saved is None else saved, *ints,
         scale, fill_value, *_rng.dropout_scalars(p), *_rng.seed_args(seed, y))
    )  # fmt: skip
    return y, saved


def _backward_kernel(dy, saved, mask, dim, scale, zero_masked, p, seed, prepared=None):
    """Launch the backward kernel: dx (gradient w.r.t. x times `scale`). `prepared`: `_prepare_backward`'s
    launch for a dy laid out like the output, used when dy is (no plan lookup then)."""
    dx = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    if dx.numel() == 0:
        return dx
    if prepared is not None and dy.stride() == prepared[0]:
        _, launch, ints, mask_arg = prepared
    else:
        launch, ints, dy, mask = _launch_for(True, dy, mask, dim, zero_masked, p, seed, saved.dtype)
        mask_arg = _mask_arg(mask, dy)
    launch(
        (saved, dy, mask_arg, dx, *ints,
         scale, *_rng.dropout_scalars(p), *_rng.seed_args(seed, dx))
    )  # fmt: skip
    return dx


def _prepare_backward(y, mask, dim, zero_masked, p, seed):
    """(dy strides it is for, Launch, integer args, mask argument) of the backward kernel for a dy laid out
    like the output `y` (as autograd usually passes it), or None: prepared while the forward runs, so the
    backward (on the autograd engine's device thread) only checks dy's strides and launches."""
    if y.numel() == 0:
        return None
    launch, ints, dy_like, mask = _launch_for(True, y, mask, dim, zero_masked, p, seed, y.dtype)
    if dy_like is not y:  # a layout that is copied first: the backward looks its plan up
        return None
    return y.stride(), launch, ints, _mask_arg(mask, y)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _grads(mask, need_dx, need_dmask, scale, run_kernel, *run_args):
    """(dx, dmask); `run_kernel(*run_args, scale)` runs the backward kernel. dmask only for an additive mask
    that requires grad: the kernel then runs unscaled (ds), dx = ds * scale, dmask = ds summed to the mask."""
    if not need_dmask:
        return run_kernel(*run_args, scale), None
    ds = run_kernel(*run_args, 1.0)
    return (ds * scale if need_dx else None), ds.sum_to_size(mask.shape).to(mask.dtype)


def _kernel_backward(dy, saved, mask, dim, zero_masked, p, seed, prepared, scale):
    return _backward_kernel(dy, saved, mask, dim, scale, zero_masked, p, seed, prepared)


# ---------------------------------------------------------------------------------------------------
# Autograd (eager) and custom ops (torch.compile)
# ---------------------------------------------------------------------------------------------------


class MaskedSoftmaxFunction(torch.autograd.Function):
    """Eager-mode autograd around the kernels (lower call overhead than going through the custom op). The
    forward also prepares the backward's launch, so the backward does little but launch."""

    @staticmethod
    def forward(ctx, x, mask, dim, scale, fill_value, zero_masked, p):
        seed = _rng.draw_seed(x.device) if p > 0 else _NO_SEED
        y, saved = _forward(x, mask, dim, scale, fill_value, zero_masked, p, seed)
        ctx.save_for_backward(y if saved is None else saved, mask)
        need_dx, need_dmask = ctx.needs_input_grad[:2]
        prepared = _prepare_backward(y, mask, dim, zero_masked, p, seed)
        ctx.args = (dim, scale, zero_masked, p, seed, prepared, need_dx, mask is not None and need_dmask)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved, mask = ctx.saved_tensors
        dim, scale, zero_masked, p, seed, prepared, need_dx, need_dmask = ctx.args
        dx, dmask = _grads(
            mask, need_dx, need_dmask, scale,
            _kernel_backward, dy, saved, mask, dim, zero_masked, p, seed, prepared,
        )  # fmt: skip
        return dx, dmask, None, None, None, None, None


@torch.library.custom_op("opadvisor::masked_softmax_fwd", mutates_args=())
def masked_softmax_fwd_op(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    dim: int,
    scale: float,
    fill_value: float,
    zero_masked: bool,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, saved p or empty, seed as a CPU int64 tensor [3])."""
    seed = _rng.draw_op_seed(x.device, "opadvisor::masked_softmax_fwd") if dropout_p > 0 else _NO_SEED
    y, saved = _forward(x, mask, dim, scale, fill_value, zero_masked, dropout_p, seed)
    return y, y.new_empty(0) if saved is None else saved, torch.tensor(seed, dtype=torch.int64)


@masked_softmax_fwd_op.register_fake
def _(x, mask, dim, scale, fill_value, zero_masked, dropout_p):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    saved = torch.empty_like(y) if dropout_p > 0 else y.new_empty(0)
    return y, saved, torch.empty(3, dtype=torch.int64, device="cpu")


@torch.library.custom_op("opadvisor::masked_softmax_bwd", mutates_args=())
def masked_softmax_bwd_op(
    dy: torch.Tensor,
    saved: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor,
    dim: int,
    scale: float,
    zero_masked: bool,
    dropout_p: float,
) -> torch.Tensor:
    k0, k1, stream = (int(v) for v in seed.tolist())
    return _backward_kernel(dy, saved, mask, dim, scale, zero_masked, dropout_p, (k0, k1, stream))


@masked_softmax_bwd_op.register_fake
def _(dy, saved, mask, seed, dim, scale, zero_masked, dropout_p):
    return torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)


def _setup_context(ctx, inputs, output):
    x, mask, dim, scale, fill_value, zero_masked, p = inputs
    y, saved, seed = output
    ctx.save_for_backward(saved if p > 0 else y, mask, seed)
    ctx.args = (dim, scale, zero_masked, p)


def _op_backward(ctx, dy, _dsaved, _dseed):
    saved, mask, seed = ctx.saved_tensors
    dim, scale, zero_masked, p = ctx.args
    need = ctx.needs_input_grad
    dx, dmask = _grads(
        mask, need[0], mask is not None and need[1], scale,
        _op_kernel_backward, dy, saved, mask, seed, dim, zero_masked, p,
    )  # fmt: skip
    return dx, dmask, None, None, None, None, None


def _op_kernel_backward(dy, saved, mask, seed, dim, zero_masked, p, scale):
    return masked_softmax_bwd_op(dy, saved, mask, seed, dim, scale, zero_masked, p)


torch.library.register_autograd(masked_softmax_fwd_op, _op_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------------


def _broadcasts_to(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))


def masked_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dim: int = -1,
    scale: float | None = None,
    fill_value: float = float("-inf"),
    zero_masked: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
) -> torch.Tensor:
    """softmax(x * scale with `mask` applied, dim), masked positions zeroed if asked, then dropout.

    Args:
        x: scores (float32, float16, bfloat16 run the kernels; float64 runs the reference).
        mask: None; bool (True = masked: the score becomes `fill_value`); or floating point (added to the
            scores: HF's extended attention mask). Any shape that broadcasts to x ([B,1,1,S], [1,1,S,S]),
            read in place without being expanded in memory. An additive mask that requires grad gets one.
        dim: the softmax dimension.
        scale: multiplies x before the mask (None: 1).
        fill_value: the score of masked positions (-inf, -1e9, torch.finfo(dtype).min ...), applied in
            float32, so it does not overflow in float16.
        zero_masked: zero the probabilities of masked positions afterwards (DeBERTa's XSoftmax); bool mask.
        dropout_p, training: dropout on the probabilities (when training and dropout_p > 0), random
            stream following torch.manual_seed.

    Returns a tensor of x's shape and dtype. Rows whose scores are all -inf (where
    `x.masked_fill(mask, -inf).softmax(dim)` gives NaN) give zeros, and so do their gradients; except on
    CUDA under SMALL_NUMEL elements, where the plain chain runs (`eager_masked_softmax`: NaN there, as in
    the code the rewrite replaced). `masked_softmax_backend(x)` says which runs.
    """
    if mask is not None:
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"mask must be bool or floating point, got {mask.dtype}")
        if not _broadcasts_to(mask.shape, x.shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x's {tuple(x.shape)}")
        if zero_masked and mask.dtype != torch.bool:
            raise ValueError("zero_masked needs a bool mask")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    p = float(dropout_p) if training else 0.0
    backend = masked_softmax_backend(x)
    if backend == _backend.EAGER:
        _dispatch.record(OP, _dispatch.CHAIN)
        kw = dict(dim=dim, scale=scale, fill_value=fill_value, zero_masked=zero_masked, dropout_p=p)
        return eager_masked_softmax(x, mask, **kw)
    if backend == _backend.REFERENCE or _tensor_scale_with_grad(scale):
        reason = _backend.fallback_reason(x) if backend == _backend.REFERENCE else _GRAD_SCALE
        _dispatch.record_reference(OP, reason)
    else:
        _dispatch.record(OP, _dispatch.KERNEL)
        return _run_kernel(x, mask, dim, scale, fill_value, zero_masked, p)
    return reference_masked_softmax(
        x, mask, dim=dim, scale=scale, fill_value=fill_value, zero_masked=zero_masked, dropout_p=p
    )


_GRAD_SCALE = "a tensor scale that requires grad: the PyTorch reference runs, so that it gets its gradient"


def _tensor_scale_with_grad(scale) -> bool:
    return isinstance(scale, torch.Tensor) and scale.requires_grad


def _run_kernel(x, mask, dim, scale, fill_value, zero_masked, p):
    dim = dim % x.dim()
    scale_f = 1.0 if scale is None else float(scale)
    fill = float(fill_value)
    if math.isnan(fill):
        raise ValueError("fill_value must not be NaN")
    if torch.compiler.is_compiling():
        return masked_softmax_fwd_op(x, mask, dim, scale_f, fill, zero_masked, p)[0]
    return MaskedSoftmaxFunction.apply(x, mask, dim, scale_f, fill, zero_masked, p)
