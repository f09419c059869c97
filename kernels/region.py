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

A compiled region computes the same function up to floating-point rounding (inductor may evaluate in a
different order, in float32 where the chain rounded to 16 bits in between). Random ops inside it
(dropout) draw from inductor's own stream: the same distribution, not the same numbers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

PENDING, COMPILED, FAILED = "pending", "compiled", "failed"


@dataclass
class _Region:
    fn: Callable[..., Any]
    compile_kwargs: dict[str, Any]
    compiled: Callable[..., Any] | None = None
    status: str = PENDING
    error: str | None = None

    def call(self, args: tuple, kwargs: dict) -> Any:
        if self.status == FAILED or torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
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

    def _give_up(self, exc: Exception) -> None:
        self.status = FAILED
        # the message's lines joined: inductor's "backend='inductor' raised:" puts the cause on the next line
        words = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
        self.error = f"{type(exc).__name__}: {words[:300]}"
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        print(
            f"opadvisor.kernels.compile_region: {name} runs uncompiled: torch.compile failed ({self.error})",
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
