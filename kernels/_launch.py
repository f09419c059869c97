"""Launch a Triton kernel that has run before without Triton's per-call binding of every argument.

`kernel[grid](*args, **meta)` (Triton's `JITFunction.run`) binds the arguments, specialises each one (dtype,
16-byte alignment, integer value classes), hashes that into a cache key and only then launches: about 30 us
of host time per launch on the H200 host we measured, more than many of our kernels take on the GPU. In a
training step whose host is the bottleneck that time is the step's.

The ops build a plan per layout (cached), and the plan holds a `Launch` (`Launcher(kernel).prepare(grid,
meta)`): one kernel on one grid with its constexprs. Everything Triton specialises on except the tensors'
16-byte alignment is fixed by the plan's key (the layout integers, the dtypes, the constexprs, the
specialised integers such as cross-entropy's ignore_index); so a `Launch` keeps the `CompiledKernel` that
Triton returned per alignment of its tensor arguments and launches it directly through the compiled kernel's
launcher afterwards (the call `JITFunction.run` itself makes): per call, the alignment bits, a dict lookup,
the current stream. The first launch of each alignment goes through `kernel[grid]` (compiling if needed), so
a new dtype, alignment or block size is always compiled by Triton itself. With `CHECK_KEYS` set (the GPU
tests set it) every direct launch also computes Triton's specialisation of its arguments (`specialisation`)
and checks that it is the one the kernel was compiled for: a plan key that missed something fails there.

The direct path is used only where its calling convention is known (Triton 3.4 or newer, whose launcher
takes every argument in signature order, constexprs included), on CUDA tensors, and when no launch hook is
installed (a profiler such as proton sets one and expects `kernel[grid]`); everywhere else, including
Triton's interpreter, every launch goes through `kernel[grid]`. `direct_launch_available()` says which.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
CHECK_KEYS = False  # tests: check each direct launch's specialisation against its compiled kernel's


@functools.cache
def direct_launch_available() -> bool:
    """True when this Triton's compiled-kernel launcher has the calling convention `Launch` uses."""
    import triton

    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 4) and hasattr(triton, "knobs")


def _hook_set(hook: Any) -> bool:
    """A launch hook is set: not None and, for Triton 3.5+'s HookChain, with a function in its chain."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    import triton

    rt = triton.knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


class Launcher:
    """One Triton kernel: what its signature says about its parameters, `prepare` for a plan's `Launch`,
    and `launcher(grid, args, meta)` for call sites without a plan (the compiled kernel looked up by the
    launch's full specialisation, computed per call: a few microseconds more than a `Launch`)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # An interpreted kernel (TRITON_INTERPRET=1) has no `params`: it always goes through kernel[grid].
        params = getattr(kernel, "params", None) or []
        self.direct = bool(params)
        self.interpreted = not params
        self.n_params = len(params)
        self.constexpr_names = tuple(p.name for p in params if p.is_constexpr)
        # Per runtime argument: whether its value takes part in the specialisation (ints only).
        self.specialised = tuple(not p.do_not_specialize for p in params if not p.is_constexpr)
        self.compiled: dict[tuple, Any] = {}  # per specialisation, for __call__

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> None:
        """`kernel[grid](*args, **meta)`, directly once this specialisation has been launched."""
        first = args[0]
        if not (self.direct and first.is_cuda and direct_launch_available()) or _hooks_installed():
            self.kernel[grid](*args, **meta)
            return
        device = first.get_device()
        key = self.specialisation(device, args, meta)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **meta)
            if self.takes_every_argument(compiled):
                self.compiled[key] = compiled
            return
        g0, g1, g2 = (*grid, 1, 1)[:3]
        constexprs = [meta[name] for name in self.constexpr_names]
        compiled.run(
            g0, g1, g2, torch._C._cuda_getCurrentRawStream(device), compiled.function, compiled.packed_metadata,
            None, None, None, *args, *constexprs,
        )  # fmt: skip

    def prepare(self, grid: tuple[int, ...], meta: dict[str, Any]) -> Launch:
        """A `Launch` of this kernel on `grid` with `meta` (constexprs and launch options), for a plan whose
        key fixes everything else Triton specialises on but alignment."""
        return Launch(self, grid, meta)

    def takes_every_argument(self, compiled: Any) -> bool:
        """Whether the compiled kernel's signature lists every parameter, constexprs included (so its
        launcher expects them all, in order); otherwise this kernel keeps launching through Triton."""
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        return signature is not None and len(signature) == self.n_params

    def specialisation(self, device: int, args: tuple, meta: dict[str, Any]) -> tuple:
        """What Triton specialises a launch on: the device, the constexprs, each argument's type, each
        tensor's dtype and 16-byte alignment, the values of the specialised integers and whether the other
        integers fit in int32."""
        if len(args) != len(self.specialised):
            raise TypeError(f"expected {len(self.specialised)} runtime arguments, got {len(args)}")
        kinds = tuple(map(type, args))
        ints = [i for i, k in enumerate(kinds) if issubclass(k, int)]
        return (
            device,
            kinds,
            tuple(meta.items()),
            tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor)),
            tuple(args[i] for i in ints if self.specialised[i]),
            all(_I32_MIN <= args[i] <= _I32_MAX for i in ints if not self.specialised[i]),
        )


class Launch:
    """`launch(args)` runs `kernel[grid](*args, **meta)` for one plan's layout, directly once seen.

    `args` are the runtime arguments in signature order (tensors, ints, floats)."""

    __slots__ = (
        "compiled",
        "constexprs",
        "grid",
        "grid3",
        "launcher",
        "meta",
        "specialisations",
        "tensor_pos",
    )

    def __init__(self, launcher: Launcher, grid: tuple[int, ...], meta: dict[str, Any]) -> None:
        self.launcher = launcher
        self.grid = grid
        self.grid3 = (*grid, 1, 1)[:3]
        self.meta = meta
        self.constexprs = tuple(meta[name] for name in launcher.constexpr_names)
        self.compiled: dict[tuple[bool, ...], Any] = {}  # per alignment of the tensor arguments
        self.specialisations: dict[tuple[bool, ...], tuple] = {}  # with CHECK_KEYS
        self.tensor_pos: tuple[int, ...] | None = None

    def __call__(self, args: tuple) -> None:
        launcher = self.launcher
        first = args[0]
        if not (launcher.direct and first.is_cuda and direct_launch_available()) or _hooks_installed():
            launcher.kernel[self.grid](*args, **self.meta)
            return
        pos = self.tensor_pos
        if pos is None:
            pos = self.tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        aligned = tuple([args[i].data_ptr() & 15 == 0 for i in pos])
        if CHECK_KEYS:
            self._check(first.get_device(), args, aligned)
        compiled = self.compiled.get(aligned)
        if compiled is None:
            compiled = launcher.kernel[self.grid](*args, **self.meta)
            if launcher.takes_every_argument(compiled):
                self.compiled[aligned] = compiled
            return
        g0, g1, g2 = self.grid3
        stream = torch._C._cuda_getCurrentRawStream(first.get_device())
        compiled.run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *self.constexprs,
        )  # fmt: skip

    def _check(self, device: int, args: tuple, aligned: tuple[bool, ...]) -> None:
        seen = self.launcher.specialisation(device, args, self.meta)
        first = self.specialisations.setdefault(aligned, seen)
        if seen != first:
            raise AssertionError(f"a plan's launch changed Triton's specialisation: {first} -> {seen}")
