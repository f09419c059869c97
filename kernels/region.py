"""`compile_region`: compile one function (a hot chain of memory-bound ops) with torch.compile, and only it.

    from opadvisor.kernels import compile_region

    class Attention(nn.Module):
        @compile_region
        def relative_bias(self, q, k, rel):      # its elementwise ops, gathers and casts become fused kernels
            ...

`opadvisor apply --rule fuse_region` writes the decorator onto the function a finding names. Compiling
only that function fuses its chain even where compiling the whole model fails (a model whose forward holds
something dynamo cannot trace) or costs too much compile time. The decorated function keeps the original:

- The first call compiles (`torch.compile(fn)`, the default inductor backend; keyword arguments of the
  decorator go to `torch.compile`). When the compiled call raises and the original, run on the same
  arguments, does not, compilation is what failed: one line goes to stderr naming the function and the
  error, and from then on the original runs. An error the original raises too is the caller's own: it
  propagates, and compilation stays on.
- Inside an outer torch.compile (the whole model compiled as well) the original runs, so the outer graph
  traces through it rather than nesting a second compiled region.
- `fn.__wrapped__` is the original function; `region_state(fn)` says whether it compiled, failed or has
  not run yet.

Under a CUDA graph capture (`cuda_graphed`, `torch.cuda.graph`) nothing compiles: compiling, and the first
run of newly compiled code, copy from the host, allocate and load kernels, which a capture forbids (it breaks,
or inductor fails and the region would stay uncompiled). Compiled code that fits the call runs; a call that
would need new code (library code often takes another path under capture: transformers builds the attention
mask it skips otherwise) runs the original, uncompiled, and is recorded. `take_capture_misses` hands those
records to the capturer, and `compile_missed` compiles them afterwards (forward and backward, on zero
tensors shaped like the call's, under the capture's grad and autocast state), so a second capture runs
compiled code: `cuda_graphed` does both.

A compiled region computes the same function up to floating-point rounding (inductor may evaluate in a
different order, in float32 where the chain rounded to 16 bits in between). Random ops inside it
(dropout) draw from inductor's own stream: the same distribution, not the same numbers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from ._backend import cuda_graph_capturing

F = TypeVar("F", bound=Callable[..., Any])

PENDING, COMPILED, FAILED = "pending", "compiled", "failed"


@dataclass
class _Region:
    fn: Callable[..., Any]
    compile_kwargs: dict[str, Any]
    compiled: Callable[..., Any] | None = None
    status: str = PENDING
    error: str | None = None

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def call(self, args: tuple, kwargs: dict) -> Any:
        if self.status == FAILED or torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        if cuda_graph_capturing():
            return self._call_capturing(args, kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, **self.compile_kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:
            out = self.fn(*args, **kwargs)  # raises here when the error is the caller's, not the compiler's
            self._give_up(exc)
            return out
        self.status = COMPILED
        return out

    def _call_capturing(self, args: tuple, kwargs: dict) -> Any:
        """Compiled code where some fits the call (dynamo may not compile: "fail_on_recompile"), else the
        original, with the call recorded for `compile_missed`."""
        if self.compiled is not None:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    return self.compiled(*args, **kwargs)
            except RuntimeError as exc:
                if "fail_on_recompile" not in str(exc):
                    raise
        _MISSES.append(CaptureMiss.of(self, args, kwargs))
        return self.fn(*args, **kwargs)

    def _give_up(self, exc: Exception) -> None:
        self.status = FAILED
        # the message's lines joined: inductor's "backend='inductor' raised:" puts the cause on the next line
        words = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
        self.error = f"{type(exc).__name__}: {words[:300]}"
        print(
            f"opadvisor.kernels.compile_region: {self.name} runs uncompiled: torch.compile failed ({self.error})",
            file=sys.stderr,
        )


def compile_region(fn: F | None = None, **compile_kwargs: Any) -> F | Callable[[F], F]:
    """Decorate `fn` so that it runs compiled by `torch.compile(fn, **compile_kwargs)`, falling back to
    the original (with one line on stderr) when compilation fails. Usable as `@compile_region` or
    `@compile_region(mode="max-autotune-no-cudagraphs")`. See the module doc."""
    if fn is None:
        return functools.partial(compile_region, **compile_kwargs)  # type: ignore[return-value]
    region = _Region(fn, dict(compile_kwargs))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return region.call(args, kwargs)

    wrapper.__opadvisor_region__ = region  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def region_state(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """(status, error) of a function decorated with `compile_region`: status "pending" (not called yet),
    "compiled" or "failed" (error says why)."""
    region = getattr(fn, "__opadvisor_region__", None)
    if region is None:
        raise TypeError(f"{fn!r} is not decorated with opadvisor.kernels.compile_region")
    return region.status, region.error


# -- calls that met no compiled code while a CUDA graph was being captured ----------------------------------


@dataclass(frozen=True)
class _TensorSpec:
    """What dynamo's guards check of a tensor argument: a zero tensor like it passes them."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def zeros(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).zero_()
        return t.requires_grad_(self.requires_grad)


@dataclass
class CaptureMiss:
    """A call of a compiled region under a CUDA graph capture that found no compiled code for its
    arguments: the call's layout (tensors as `_TensorSpec`, the same object where one tensor was passed
    twice) and the grad / autocast state it ran under."""

    region: _Region
    args: tuple
    kwargs: dict
    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    key: tuple = field(default=(), repr=False)

    @classmethod
    def of(cls, region: _Region, args: tuple, kwargs: dict) -> CaptureMiss:
        specs: dict[int, _TensorSpec] = {}

        def spec(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in specs:
                specs[id(value)] = _TensorSpec(
                    tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad
                )
            return specs[id(value)]

        args, kwargs = pytree.tree_map(spec, (args, kwargs))
        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu")
        )
        grad = torch.is_grad_enabled()
        cache = torch.is_autocast_cache_enabled()
        key = (id(region), _layout_key((args, kwargs)), grad, autocast, cache)
        return cls(region, args, kwargs, grad, autocast, cache, key)

    @contextlib.contextmanager
    def state(self) -> Iterator[None]:
        """The grad and autocast state the call ran under (dynamo guards on both)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for dev, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
                )
            yield

    def rebuild(self) -> tuple[tuple, dict]:
        """(args, kwargs) like the recorded call's, with zero tensors (aliases kept)."""
        made: dict[int, torch.Tensor] = {}

        def build(value: Any) -> Any:
            if not isinstance(value, _TensorSpec):
                return value
            if id(value) not in made:
                made[id(value)] = value.zeros()
            return made[id(value)]

        return pytree.tree_map(build, (self.args, self.kwargs), is_leaf=lambda v: isinstance(v, _TensorSpec))


def _layout_key(tree: Any) -> tuple:
    """A hashable key of a recorded call: specs by value, anything else by identity (modules, flags)."""
    leaves = pytree.tree_leaves(tree, is_leaf=lambda v: isinstance(v, _TensorSpec))
    return tuple(v if isinstance(v, _TensorSpec) else (type(v).__name__, id(v)) for v in leaves)


_MISSES: list[CaptureMiss] = []


def take_capture_misses() -> list[CaptureMiss]:
    """The calls recorded since the last take (see the module doc), one per distinct call; clears them."""
    unique = {miss.key: miss for miss in _MISSES}
    _MISSES.clear()
    return list(unique.values())


def compile_missed(misses: list[CaptureMiss]) -> list[str]:
    """Compile, outside any capture, the code each recorded call needs: its forward on zero tensors like
    the call's and, where it has a gradient, its backward (dynamo compiles a backward on its first run).
    Parameter gradients are not touched (torch.autograd.grad). Returns the names of the functions that
    compiled; a failure is `compile_region`'s usual one line, and that region runs its original from then on."""
    names = []
    for miss in misses:
        region = miss.region
        if region.status == FAILED or cuda_graph_capturing():
            continue
        with miss.state():
            args, kwargs = miss.rebuild()
            out = region.call(args, kwargs)
            if region.status == COMPILED:
                _run_backward(region, out, (args, kwargs))
        if region.status == COMPILED:
            names.append(region.name)
    return sorted(set(names))


def _run_backward(region: _Region, out: Any, inputs: Any) -> None:
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    modules = [m for m in pytree.tree_leaves(inputs) if isinstance(m, nn.Module)]
    wrt += [p for m in modules for p in m.parameters() if p.requires_grad]
    if not outs or not wrt:
        return
    try:
        torch.autograd.grad(outs, wrt, [torch.zeros_like(t) for t in outs], allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - a compiled backward that fails: the region runs uncompiled
        region._give_up(exc)
