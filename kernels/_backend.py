"""Which implementation runs: the Triton kernels, the same kernels under Triton's interpreter, or PyTorch.

The choice is explicit (no try/except fallback) and every public op exposes it as a function, so a
test or a user can ask which code path a call will take before making it:

- CUDA tensors, Triton installed               -> ``"triton"`` (compiled kernels)
- any tensor with ``TRITON_INTERPRET=1`` set    -> ``"interpreter"`` (the same kernels, run by Triton's
  interpreter on the CPU; Triton reads the variable when it is first imported, so set it before that)
- everything else (CPU without the interpreter, no Triton, other devices) -> ``"reference"`` (plain
  PyTorch, also the test oracle)
- CUDA tensors too small for a kernel to pay for its host cost -> ``"eager"``: the op runs the plain chain
  it replaces in the inputs' dtype (`cross_entropy`: F.cross_entropy). Not while a CUDA graph is being
  captured: a replay costs no host time per kernel, so there the kernel's GPU saving is all that counts

Per op, shapes and dtypes the kernels do not cover (float64, empty tensors) or where they measured slower
than eager PyTorch on the GPU (tiny tensors: launch overhead dominates) also give ``"reference"``; see
``masked_softmax_backend`` and ``bias_dropout_add_backend``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch

TRITON = "triton"
INTERPRETER = "interpreter"
REFERENCE = "reference"
EAGER = "eager"  # small CUDA tensors: the PyTorch chain the kernel replaces (launch-bound work)

# Found once at import: `find_spec` does not import triton (importing it would fix its interpret mode).
HAS_TRITON = importlib.util.find_spec("triton") is not None

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks Triton to interpret kernels (read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend(device: torch.device | str | torch.Tensor) -> str:
    """The implementation the ops use for tensors on `device`, before any per-shape choice.

    Returns "triton", "interpreter" or "reference" (see the module docstring).
    """
    if isinstance(device, torch.Tensor):
        kind = device.device.type
    else:
        kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if not HAS_TRITON:
        return REFERENCE
    if kind in ("cpu", "cuda") and interpret_requested():
        _require_numpy()
        return INTERPRETER
    return TRITON if kind == "cuda" else REFERENCE


class InterpreterNeedsNumpy(ModuleNotFoundError):
    """TRITON_INTERPRET=1 asked for Triton's interpreter, which imports numpy, and numpy is missing."""


def _require_numpy() -> None:
    """Say in one line what to install, rather than fail inside `import triton` (its interpreter imports
    numpy). Only the interpreter needs numpy: the kernels' CPU reference path never does."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise InterpreterNeedsNumpy(
            "TRITON_INTERPRET=1 runs opadvisor's kernels in Triton's interpreter, which needs numpy: "
            "pip install numpy (or unset TRITON_INTERPRET: on the CPU the kernels then run their PyTorch "
            "reference)",
            name="numpy",
        ) from None


def for_tensor(x: torch.Tensor, small_numel: int) -> str:
    """`backend(x)` narrowed per tensor: "reference" for dtypes and shapes the kernels do not cover
    (float64, 0-d, empty) and "eager" on the GPU for tensors under `small_numel` elements (launch-bound
    work: each op says what it runs then) unless the current stream is capturing a CUDA graph. Under
    torch.compile small tensors always go to "eager": the traced graph must not depend on the capture state
    of the stream it was traced on, and asking dynamo about it breaks the graph."""
    if x.is_cuda and HAS_TRITON and not interpret_requested():  # `backend(x)` for the usual GPU case
        be = TRITON
    else:
        be = backend(x)
        if be == REFERENCE:
            return be
    if x.dtype not in KERNEL_DTYPES or x.dim() == 0:
        return REFERENCE
    n = x.numel()
    if n == 0:
        return REFERENCE
    if be == TRITON and n < small_numel:
        if torch.compiler.is_compiling() or not cuda_graph_capturing():
            return EAGER
    return be


def fallback_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot take `x` where they otherwise would, or None: None too where the reference is
    the documented path (a CPU tensor without Triton's interpreter: the PyTorch ops are the CPU
    implementation; an empty tensor: nothing to compute)."""
    return fallback_reason_for(x.device.type, x.dtype, x.dim())


def fallback_reason_for(device_type: str, dtype: torch.dtype, dim: int) -> str | None:
    """`fallback_reason` for a tensor of this device type, dtype and rank."""
    if not HAS_TRITON:
        return "Triton is not installed: the PyTorch reference runs" if device_type == "cuda" else None
    if device_type not in ("cpu", "cuda"):
        return f"no kernels for {device_type} tensors: the PyTorch reference runs"
    if device_type == "cpu" and not interpret_requested():
        return None
    if dtype not in KERNEL_DTYPES:
        return f"the kernels take float32, float16 and bfloat16, not {dtype}: the PyTorch reference runs"
    if dim == 0:
        return "a 0-d tensor: the PyTorch reference runs"
    return None


@functools.lru_cache(maxsize=64)
def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessor count (1 elsewhere: the interpreter runs programs one by one), for
    launchers that size a grid to the device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def direct_apply(function: type[torch.autograd.Function]) -> Callable:
    """`function.apply`, minus torch.autograd.Function.apply's Python wrapper when no functorch transform
    is active: the wrapper then only unwraps dead functorch wrappers from the arguments (a Function
    without setup_context binds no defaults) and calls the C apply, which this calls directly (~2-5 us of
    host time less per call). Under a functorch transform (vmap, grad ...) it is the wrapper itself."""
    c_apply = super(torch.autograd.Function, function).apply
    wrapped = function.apply
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        if transforms_active():
            return wrapped(*args)
        return c_apply(*args)

    return apply


def is_kv_cache(value: object) -> bool:
    """Whether `value` is a transformers KV cache (a `transformers.cache_utils.Cache`: DynamicCache, ...),
    told by its classes' names so that transformers is never imported here."""
    return _is_cache_class(type(value))


def _is_cache_class(cls: type) -> bool:
    return _cache_class_answer(cls)


@functools.cache
def _cache_class_answer(cls: type) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in cls.__mro__)


# A constant of the trace under torch.compile (as kernels/_dispatch.py marks its own): dynamo cannot iterate a
# class's __mro__ and broke the graph at every attention call that read its arguments for a cache (a Llama
# layer's rotary patch: one graph per layer, its residual stream's gradients summed eagerly between them).
# The plain function is marked, not the functools.cache wrapper: dynamo traces into the wrapper.
_is_cache_class._dynamo_marked_constant = True  # type: ignore[attr-defined]


def cuda_graph_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on builds without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def emulate_rne(t: torch.Tensor) -> bool:
    """Whether kernels writing `t` must round to bfloat16 themselves (the interpreter truncates)."""
    return t.dtype == torch.bfloat16 and interpret_requested()


def check_launch(t: torch.Tensor) -> None:
    """Before a kernel launch on `t`: under the interpreter, check that Triton was imported in interpret
    mode (a cheap test on the GPU path: one environment read)."""
    check_launch_device(t.device)


def check_launch_device(device: torch.device) -> None:
    """`check_launch` for a launch plan's device (the ops with cached plans check once per plan)."""
    if device.type == "cpu" or interpret_requested():
        _check_interpreter_ready()


def _check_interpreter_ready() -> None:
    """Fail loudly when the interpreter was asked for after Triton was imported in compiled mode.

    Triton decides at import time whether `@triton.jit` compiles or interprets; a kernel decorated in
    compiled mode cannot run on CPU tensors. The error says how to fix it instead of a confusing one.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from . import _common_triton

    if not isinstance(_common_triton.philox4x32, InterpretedFunction):
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported; set it before the first "
            "`import triton` (e.g. in the environment of the process) to run the kernels on the CPU."
        )
