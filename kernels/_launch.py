"""Launch a Triton kernel that has run before without Triton's per-call binding of every argument.

`kernel[grid](*args, **meta)` (Triton's `JITFunction.run`) binds the arguments, specialises each one (dtype,
16-byte alignment, integer value classes), hashes that into a cache key and only then launches: about 30 us
of host time per launch on the H200 host we measured, more than many of our kernels take on the GPU. In a
training step whose host is the bottleneck that time is the step's.

`Launcher` keeps, per kernel, the `CompiledKernel` that Triton returned for a given specialisation, under a
key made of the same facts Triton specialises on, computed cheaply, and launches it directly through the
compiled kernel's launcher afterwards (the call `JITFunction.run` itself makes). The first launch of each
specialisation goes through `kernel[grid]` (compiling if needed), so a new dtype, alignment or block size is
always compiled by Triton itself.

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


@functools.cache
def direct_launch_available() -> bool:
    """True when this Triton's compiled-kernel launcher has the calling convention `Launcher` uses."""
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
    """`Launcher(kernel)(grid, args, meta)` launches `kernel[grid](*args, **meta)`, directly once seen.

    `args` are the runtime arguments in signature order (tensors, ints, floats); `meta` the constexprs and
    launch options (num_warps ...) by name.
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # An interpreted kernel (TRITON_INTERPRET=1) has no `params`: it always goes through kernel[grid].
        params = getattr(kernel, "params", None) or []
        self.direct = bool(params)
        self.n_params = len(params)
        self.constexpr_names = tuple(p.name for p in params if p.is_constexpr)
        # Per runtime argument: whether its value takes part in the specialisation (ints only).
        self.specialised = tuple(not p.do_not_specialize for p in params if not p.is_constexpr)
        self.compiled: dict[tuple, Any] = {}
        self._roles: dict[tuple[type, ...], tuple[tuple[int, ...], ...]] = {}

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> None:
        first = args[0]
        if not (self.direct and first.is_cuda and direct_launch_available()) or _hooks_installed():
            self.kernel[grid](*args, **meta)
            return
        device = first.get_device()
        key = self._key(device, args, meta)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **meta)
            if self._takes_every_argument(compiled):
                self.compiled[key] = compiled
            return
        g = (*grid, 1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        constexprs = [meta[name] for name in self.constexpr_names]
        compiled.run(
            g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
            *args, *constexprs,
        )  # fmt: skip

    def _takes_every_argument(self, compiled: Any) -> bool:
        """Whether the compiled kernel's signature lists every parameter, constexprs included (so its
        launcher expects them all, in order); otherwise this kernel keeps launching through Triton."""
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        return signature is not None and len(signature) == self.n_params

    def _key(self, device: int, args: tuple, meta: dict[str, Any]) -> tuple:
        """What Triton would specialise this launch on: the device, the constexprs, each tensor's dtype and
        16-byte alignment, each scalar's type, the values of the specialised integers (our launch sites
        pass layout integers, fixed per layout) and whether the other integers fit in int32."""
        if len(args) != len(self.specialised):
            raise TypeError(f"expected {len(self.specialised)} runtime arguments, got {len(args)}")
        kinds = tuple(map(type, args))
        roles = self._roles.get(kinds)
        if roles is None:
            roles = self._roles[kinds] = self._positions(kinds)
        tensors, spec_ints, free_ints = roles
        return (
            device,
            kinds,
            tuple(meta.items()),
            tuple([(args[i].dtype, args[i].data_ptr() % 16 == 0) for i in tensors]),
            tuple([args[i] for i in spec_ints]),
            all(_I32_MIN <= args[i] <= _I32_MAX for i in free_ints),
        )

    def _positions(self, kinds: tuple[type, ...]) -> tuple[tuple[int, ...], ...]:
        """(tensor positions, specialised int positions, other int positions) for arguments of `kinds`."""
        tensors = tuple(i for i, k in enumerate(kinds) if issubclass(k, torch.Tensor))
        ints = [i for i, k in enumerate(kinds) if issubclass(k, int)]
        spec = tuple(i for i in ints if self.specialised[i])
        free = tuple(i for i in ints if not self.specialised[i])
        return tensors, spec, free
