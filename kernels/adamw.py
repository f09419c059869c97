"""`AdamW`: `torch.optim.AdamW` whose step updates all of a group's tensors in one Triton launch.

torch's fused AdamW (`fused=True`) moves 28 bytes per float32 parameter a step (parameter, gradient and
both moments read, three written). This optimizer's kernel does the same arithmetic (float32 math, IEEE
square root and divisions, torch's order of operations) over flat blocks of every tensor, finding the tensors
from tables of their offsets from one of them (see `_adamw_triton`: 16-byte loads and stores where the
tensors are aligned, as allocated tensors are): one launch per group, no copies, the tensors where the model
keeps them. Measured on an H200 (benchmarks/adamw.py, the kernels' GPU time alone): issue 31's Llama (1.24B
parameters) 9.85 ms a step against fused=True's 12.09 (4.26 against 3.47 TB/s), GPT-2 124M 0.83 against
1.02 ms, DeBERTa-v3-base 1.23 against 1.48 ms. Its host work per step is checks and tables made once per
layout of the tensors, the step counters added in one op, one launch. Gradients set to None are made anew by
each backward, and the small ones land at other addresses from step to step (GPT-2 under `cuda_graphed` on
an H200: 8 layouts in 15 steps): their row of the tables is written in place, through pinned buffers, without
checking or making anything again.

Everything else is torch's AdamW, which this class subclasses: the constructor and its arguments, the
parameter groups, `state_dict` / `load_state_dict` (the same state: `step`, `exp_avg`, `exp_avg_sq`), so a
checkpoint moves between the two both ways, learning-rate schedulers, hooks. A step the kernel does not
cover runs torch's own step (`fused`, `foreach` as given) and warns once why: options the kernel does not
implement (amsgrad, maximize, capturable, differentiable, tensor hyperparameters), parameters that are not
float32 / float16 / bfloat16, complex, sparse or non-contiguous gradients or parameters, moments in another
layout. CPU parameters run torch's step without a warning (the CPU's implementation, as for the other
kernels), or the kernel under Triton's interpreter with `TRITON_INTERPRET=1`.

GradScaler: the step does not take the scaler's inverse scale itself (`_step_supports_amp_scaling` is
False, also where `fused=True` was passed), so `scaler.step(opt)` unscales the gradients and skips the
step on inf or NaN, as for torch's default AdamW.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from . import _backend, _dispatch

OP = "adamw"  # its name in the dispatch record and in warnings
BLOCK = 1024  # elements a program updates: the fastest of benchmarks/adamw.py --sweep on an H200 for
NUM_WARPS = 4  # GPT-2, DeBERTa and Llama alike (4096 with 8 warps: 24% slower on Llama)
_UNSUPPORTED_OPTIONS = ("amsgrad", "maximize", "capturable", "differentiable")


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` (same arguments, same state) whose step is one Triton launch per group."""

    def __init__(self, params, *args, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        # GradScaler unscales the gradients itself and skips the step on inf (see the module docstring)
        self._step_supports_amp_scaling = False
        # per (group index, bucket members), for the tensors where `_checked_layout` found them: made again
        # only when a parameter or a moment moved (the gradients' row is rewritten where they moved)
        self._tables: dict[tuple, _Tables] = {}
        self._checked_layout: tuple | None = None  # the tensors' layout `_path` last found the kernel covers
        self._step_views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # per group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step of every parameter with a gradient (`closure` as torch's optimizers take it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        runs_kernel, reason = self._path()
        if not runs_kernel:
            _dispatch.record_reference(OP, None if reason is None else f"{reason}: torch's AdamW step runs")
            _torch_step(self)
            return loss
        states_made = False
        for index, group in enumerate(self.param_groups):
            states_made |= self._step_group(index, group)
        if states_made:  # the moments made this step are where this step's tables found them
            self._checked_layout = self._layout()
        return loss

    # ---- what the kernel covers ---------------------------------------------------------------------------
    def _path(self) -> tuple[bool, str | None]:
        """(whether the kernel runs this step, why not where that is a fallback). CPU parameters without
        Triton's interpreter run torch's step without a word: that is the CPU's implementation, as for the
        other kernels. The tensors are checked again only when one of them moved or changed dtype, layout
        or presence (a steady training loop checks them once: the check costs host time every step)."""
        for group in self.param_groups:
            reason = group_reason(group)
            if reason is not None:
                return False, reason
        layout = self._layout()
        if layout == self._checked_layout:
            return True, None
        on_cpu = False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                reason = tensor_reason(p, p.grad)
                state = self.state.get(p)
                if reason is None and state:
                    reason = state_reason(p, state["exp_avg"], state["exp_avg_sq"])
                if reason is not None:
                    return False, reason
                on_cpu = on_cpu or _backend.backend(p) == _backend.REFERENCE
        if on_cpu:
            return False, None
        self._checked_layout = layout
        self._tables.clear()  # made for the tensors where they were
        return True, None

    def _layout(self) -> tuple:
        """What the checks of `_path` and the launch tables read, per parameter: where it and its moments are,
        its shape, its and its gradient's dtypes and whether the gradient is contiguous (parameters and moments
        keep their layout in place), and whether Triton's interpreter is asked for (CPU tensors run the
        kernel only then). Not where the gradient is: `_refresh_gradients` follows that every step."""
        out: list = [_backend.interpret_requested()]
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    out.append(None)
                    continue
                state = self.state.get(p)
                moments = (state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr()) if state else None
                out.append((p.data_ptr(), p.dtype, p.shape, g.dtype, g.is_contiguous(), moments))
        return tuple(out)

    # ---- one group ----------------------------------------------------------------------------------------
    def _step_group(self, index: int, group: dict) -> bool:
        """Step one group; whether a parameter's state was made (its first step)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return False
        made = any(not self.state.get(p) for p in params)
        states = [self._state_of(p) for p in params]
        counts = self._count_steps(index, states)
        for (_, _, step), members in _buckets(params, counts).items():
            tensors = [
                (params[i], params[i].grad, states[i]["exp_avg"], states[i]["exp_avg_sq"]) for i in members
            ]
            key = (index, tuple(members))
            tables = self._tables.get(key)
            if tables is None:
                tables = self._tables[key] = make_tables(tensors)
            else:
                _refresh_gradients(tables, tensors)
            self._launch(group, step, tensors, tables)
        return made

    def _count_steps(self, index: int, states: list[dict]) -> list[float]:
        """Add one to each parameter's `step` counter (a CPU tensor, as torch's AdamW keeps it) and return
        the new counts. The counters are made views of one tensor per group, so that the addition is one
        op, not one per parameter (torch's foreach step adds them with one op per parameter on the host);
        a counter not among those views (a new parameter, a loaded state) makes the views again."""
        steps = [state["step"] for state in states]
        flat, members = self._step_views.get(index, (None, ()))
        if (
            flat is None
            or len(members) != len(steps)
            or any(a is not b for a, b in zip(members, steps, strict=True))
        ):
            flat = torch.stack([s.detach().reshape(()) for s in steps]).to(_step_dtype())
            views = tuple(flat[i] for i in range(len(steps)))
            for state, view in zip(states, views, strict=True):
                state["step"] = view
            self._step_views[index] = (flat, views)
        flat.add_(1)
        return flat.tolist()

    def _state_of(self, p: torch.Tensor) -> dict:
        """The parameter's state, made as torch's AdamW makes it at a first step (a CPU `step` counter)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":
            state["step"] = state["step"].cpu()  # loaded from a fused or capturable optimizer's state
        return state

    def _launch(
        self, group: dict, step: float, tensors: list[tuple[torch.Tensor, ...]], tables: _Tables
    ) -> None:
        """One launch of the kernel over `tensors` ((parameter, gradient, exp_avg, exp_avg_sq) each, one
        dtype and step count) through their tables."""
        if tables.blocks == 0:
            return
        from . import _adamw_triton

        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        first = tensors[0][0]
        _backend.check_launch_device(first.device)
        with torch.cuda.device(first.device) if first.device.type == "cuda" else contextlib.nullcontext():
            _adamw_triton.adamw_kernel[(tables.blocks,)](
                tables.base, tables.offsets, tables.numel, tables.first_block, tables.block_tensor,
                len(tensors), lr * wd, beta1, beta2, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), eps,
                BLOCK=BLOCK, VEC=16 // first.element_size(), ALIGNED=tables.aligned,
                RNE=_backend.emulate_rne(first), num_warps=NUM_WARPS,
            )  # fmt: skip
        # in-place updates, as torch's step makes them: autograd then refuses a backward through a graph
        # that saved one of these tensors before the step (the kernel's stores do not count as writes)
        torch.autograd.graph.increment_version([t for p, _, m, v in tensors for t in (p, m, v)])
        _dispatch.record(OP, _backend.backend(first.device))


@dataclass
class _Tables:
    base: torch.Tensor  # the tensor the offsets count from (a parameter)
    offsets: torch.Tensor  # int64 [4, tensors]: p, g, m, v, in elements from base
    numel: torch.Tensor  # int64 [tensors]
    first_block: torch.Tensor  # int32 [tensors]
    block_tensor: torch.Tensor  # int32 [blocks]
    blocks: int
    aligned: bool  # every tensor starts on 16 bytes
    others_aligned: bool  # the parameters and moments start on 16 bytes
    gradients: tuple[int, ...]  # the gradients' addresses the offsets hold
    staging: list = field(default_factory=list)  # CUDA: [pinned int64 [tensors], its copy's event or None]
    next_stage: int = 0


def make_tables(tensors: Sequence[tuple[torch.Tensor, ...]]) -> _Tables:
    """The tables of one launch (see `_adamw_triton`), copied to the device once."""
    base = tensors[0][0]
    size = base.element_size()
    addresses = [[four[k].data_ptr() for four in tensors] for k in range(4)]
    numels = [four[0].numel() for four in tensors]
    counts = torch.tensor([-(-n // BLOCK) for n in numels])
    host = (
        torch.tensor([[(a - base.data_ptr()) // size for a in row] for row in addresses], dtype=torch.int64),
        torch.tensor(numels, dtype=torch.int64),
        (torch.cumsum(counts, 0) - counts).to(torch.int32),
        torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32), counts),
    )
    device = base.device
    on_device = tuple(  # pinned: copied without waiting for the work queued before the copy
        t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t for t in host
    )
    others_aligned = all(a % 16 == 0 for k in (0, 2, 3) for a in addresses[k])
    aligned = others_aligned and all(a % 16 == 0 for a in addresses[1])
    return _Tables(
        base, *on_device, blocks=int(counts.sum()), aligned=aligned, others_aligned=others_aligned,
        gradients=tuple(addresses[1]),
    )  # fmt: skip


# Pinned buffers per table that the gradients' row is copied from, used in turn: a buffer is written again
# only after its last copy ran (waiting for it only where the host is this many steps ahead of the GPU)
STAGING_BUFFERS = 4


def _refresh_gradients(tables: _Tables, tensors: Sequence[tuple[torch.Tensor, ...]]) -> None:
    """Point the tables' gradient row at where the gradients are now, where any of them moved."""
    addresses = tuple(four[1].data_ptr() for four in tensors)
    if addresses == tables.gradients:
        return
    base, size = tables.base.data_ptr(), tables.base.element_size()
    row = torch.tensor([(a - base) // size for a in addresses], dtype=torch.int64)
    target = tables.offsets[1]
    if target.device.type == "cuda":
        _copy_staged(tables, row, target)
    else:
        target.copy_(row)
    tables.gradients = addresses
    tables.aligned = tables.others_aligned and all(a % 16 == 0 for a in addresses)


def _copy_staged(tables: _Tables, row: torch.Tensor, target: torch.Tensor) -> None:
    """`target.copy_(row)` without waiting for the GPU: through the table's next pinned buffer, written once
    the copy that last read it ran."""
    if len(tables.staging) < STAGING_BUFFERS:  # the buffers are made in turn: next_stage is the new one
        tables.staging.append([_pinned_like(row), None])
    slot = tables.staging[tables.next_stage]
    if slot[1] is not None:
        slot[1].synchronize()
    slot[0].copy_(row)
    target.copy_(slot[0], non_blocking=True)
    slot[1] = _recorded_event(target.device)
    tables.next_stage = (tables.next_stage + 1) % STAGING_BUFFERS


def _pinned_like(row: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(row, pin_memory=True)


def _recorded_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _buckets(params: list[torch.Tensor], counts: list[float]) -> dict[tuple, list[int]]:
    """Indices of the parameters per (device, dtype, step count): one launch each (one in a steady state)."""
    out: dict[tuple, list[int]] = {}
    for i, (p, step) in enumerate(zip(params, counts, strict=True)):
        out.setdefault((p.device, p.dtype, step), []).append(i)
    return out


def group_reason(group: dict) -> str | None:
    """Why the kernel does not take this parameter group's options, or None."""
    for name in _UNSUPPORTED_OPTIONS:
        if group.get(name):
            return f"{name}=True"
    for name in ("lr", "weight_decay", "eps"):
        if isinstance(group[name], torch.Tensor):
            return f"a tensor {name}"
    if any(isinstance(b, torch.Tensor) for b in group["betas"]):
        return "tensor betas"
    return None


def tensor_reason(p: torch.Tensor, grad: torch.Tensor) -> str | None:
    """Why the kernel does not take this parameter and its gradient, or None."""
    if p.is_complex():
        return "a complex parameter"
    if grad.is_sparse:
        return "a sparse gradient"
    device_reason = _backend.fallback_reason_for(p.device.type, p.dtype, 1)
    if device_reason is not None:
        return device_reason.split(":")[0]
    if grad.dtype != p.dtype:
        return f"a {grad.dtype} gradient of a {p.dtype} parameter"
    if not (p.is_contiguous() and grad.is_contiguous()):
        return "a non-contiguous parameter or gradient"
    return None


def state_reason(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why this parameter's moments cannot be updated beside it in place, or None."""
    for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
        if t.dtype != p.dtype or t.shape != p.shape or t.device != p.device or not t.is_contiguous():
            return f"its {name} is a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}, its parameter a {p.dtype} {tuple(p.shape)} on {p.device}"
    return None


def _torch_step(optimizer: AdamW) -> None:
    """torch's AdamW step on this optimizer, without the hooks `Optimizer` wraps every `step` in a second
    time (this class's own step is wrapped already)."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


def _step_dtype() -> torch.dtype:
    """The dtype of torch's `step` counters (float64 where the default dtype is)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
