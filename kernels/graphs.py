"""`cuda_graphed(module)`: a module's forward and backward replayed from CUDA graphs, per input shape.

A training step of a mid-sized transformer launches about two thousand kernels; when most of them are short,
the GPU waits for the host to launch the next one (the BERT-base example after `opadvisor apply`: the GPU
busy 18 ms of a 29 ms step, the rest launch time). A CUDA graph launches all of a forward's (or a
backward's) kernels at once. `cuda_graphed` captures them with `torch.cuda.make_graphed_callables` (the
forward and backward as one autograd node) the first time it sees a call signature, and replays them
afterwards; everything else in the step (data, loss, optimizer) stays as written.

Returns the same module object with its `forward` replaced (an instance attribute): parameters, buffers,
`state_dict`, `isinstance` and attribute access are unchanged.

Calls: positional and keyword arguments (`model(**batch)` with input_ids / attention_mask / labels, say).
CUDA tensors are the graph's inputs (copied into its input buffers at each replay); every other argument
(None, flags such as `return_dict=True`, numbers, strings) is static: it is part of the signature, with the
tensors' shapes, strides, dtypes and requires_grad, the module's training flag and the autocast state, so
another value captures another graph. Outputs: tensors, and tuples, lists, dicts and dict-like objects of them
(HuggingFace's ModelOutput, an OrderedDict subclass, comes back as a ModelOutput of the same class), with
None / number / string leaves kept as captured.

A transformers KV cache in the output cannot be returned by a graph: where the call left `use_cache` at the
model's default (a causal LM training with use_cache=True fills a cache nobody reads), the forward is
captured with use_cache=False instead, with a warning (its output holds no cache); where the
caller passed use_cache itself, it runs eagerly.

Each call runs the original forward eagerly, which is always correct, unless all of these hold:

- gradients are enabled, every tensor argument is a CUDA tensor, every other argument is hashable and holds
  no tensor, and neither torch.compile is tracing nor another graph capturing (torch.compile traces the
  original forward; the tested order is the other one, `cuda_graphed(torch.compile(model))`, which captures
  the compiled code);
- the module has no forward/backward hooks on any submodule and no global module hooks (they would run
  only at capture);
- the parameters are the ones captured (same storage, dtype and requires_grad) and at most `max_graphs`
  signatures have been captured;
- the previous graphed forward's backward has run or its autograd graph is gone: a second forward before
  the first one's backward would overwrite the activations the first backward needs, so it runs eagerly;
- the output holds only what is listed above (a cache object, say, cannot be rebuilt from a graph).

Each of these fallbacks warns once per module and reason (RuntimeWarning), except torch.compile's tracing.

What a caller must not rely on, and why this rewrite is "unsafe" for `opadvisor apply`: outputs live in the
graph's memory and are overwritten by the next graphed call (keep `.detach().clone()` of an output you
need after the next step); Python side effects inside forward (prints, counters, Python-side randomness)
happen only during capture; dropout draws different (but equally distributed) masks than the eager run;
the capture itself runs the forward and backward 4 extra times once per input signature (buffers such as
BatchNorm statistics are restored afterwards). A capture that fails (a host synchronisation, a copy from
the host such as `torch.tensor(3).type_as(x)`, a data-dependent shape in forward) warns once, naming the
line it stopped at, and leaves the module eager for good: no signature is captured again, and every later
call runs the original forward with nothing added but one attribute check. What the attempt left behind
is freed (memory cached by its warm-up stream, the autograd nodes of its passes), the device's random
generator is taken out of the capture mode the failed capture left it in and the caller's stream restored
(below). `opadvisor suggest` names such lines from the profile and does not offer `cuda_graphed` while one
is left (see opadvisor/rules/launch/sparse_launch.py).

A failed capture leaves nothing behind for later ones: `torch.cuda.graph` leaves the calling thread on its
capture stream when the capture cannot end (its `__exit__` raises before it restores the stream), so every
later operation of the thread, later captures included, would run there; `cuda_graphed` restores the
caller's stream, and takes the device's random generator out of the capture mode the failed capture left it
in (`_release_rng_capture`).

Gradients are returned in fresh memory when a parameter's `.grad` is None (the usual `zero_grad()`), so a
parameter's `.grad` never aliases the graph's memory and gradient accumulation adds what it should.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import linecache
import os
import traceback
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn

from . import region
from ._backend import is_kv_cache

MAX_GRAPHS = 4  # input signatures captured per module; further ones run eagerly (memory per graph)
WARMUP_ITERS = 3  # make_graphed_callables' warm-up passes before capture (cuDNN/cuBLAS lazy init)
_STATIC_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def cuda_graphed(module: nn.Module, *, max_graphs: int = MAX_GRAPHS) -> nn.Module:
    """`module`, with its forward and backward replayed from CUDA graphs where that is safe (see the module
    docstring); calling it again on the same module changes nothing."""
    if isinstance(module.__dict__.get("forward"), GraphedForward):
        return module
    module.forward = GraphedForward(module, max_graphs)
    return module


# ---------------------------------------------------------------------------------------------------
# A call's arguments: the tensors (graph inputs) and the static rest (part of the signature)
# ---------------------------------------------------------------------------------------------------

_TENSOR = object()  # a tensor's slot in a call's static layout


class NotGraphable(Exception):
    """A call or an output that a CUDA graph cannot stand for; the message says why."""


class CacheOutput(NotGraphable):
    """The output holds a transformers KV cache (a model called with use_cache=True, the default of causal
    LMs, also while training): a graph cannot return that object."""


def split_call(
    args: tuple, kwargs: dict[str, Any], *, cuda: bool = True
) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """(the call's tensors in order, its static layout): positional arguments, then keyword arguments by
    name. The layout holds each non-tensor argument (with its type, so 1, 1.0 and True differ) and is
    hashable; raises NotGraphable for an argument a graph cannot take (with `cuda`, a tensor not on a CUDA
    device too) or a call without tensors."""
    tensors: list[torch.Tensor] = []
    slots = [_slot(a, f"argument {i}", tensors, cuda) for i, a in enumerate(args)]
    names = tuple(sorted(kwargs))
    slots += [_slot(kwargs[name], f"argument {name!r}", tensors, cuda) for name in names]
    if not tensors:
        raise NotGraphable("a call without tensor arguments")
    return tuple(tensors), (len(args), names, tuple(slots))


def _slot(value: Any, where: str, tensors: list[torch.Tensor], cuda: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if cuda and not value.is_cuda:
            raise NotGraphable(f"{where} is a {value.device.type} tensor (graphs take CUDA tensors)")
        tensors.append(value)
        return _TENSOR
    if any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(value)):
        raise NotGraphable(f"{where} is a {type(value).__name__} holding tensors (pass tensors directly)")
    try:
        hash(value)
    except TypeError:
        raise NotGraphable(f"{where} is an unhashable {type(value).__name__}") from None
    return (type(value), value)


def rebuild_call(tensors: tuple[torch.Tensor, ...], layout: tuple) -> tuple[tuple, dict[str, Any]]:
    """The (args, kwargs) that `split_call` split into `tensors` and `layout`."""
    n_args, names, slots = layout
    it = iter(tensors)
    values = [next(it) if slot is _TENSOR else slot[1] for slot in slots]
    return tuple(values[:n_args]), dict(zip(names, values[n_args:], strict=True))


# ---------------------------------------------------------------------------------------------------
# Outputs: flattened to the tensors a graph returns, rebuilt around them at each replay
# ---------------------------------------------------------------------------------------------------


def flatten_output(out: Any) -> tuple[list[torch.Tensor], Any]:
    """(tensors, spec) of a forward's output: tensors, tuples / lists (namedtuples too), dicts and
    dict-like objects (ModelOutput) of them, None / number / string leaves kept as they are. Raises
    NotGraphable for anything else."""
    tensors: list[torch.Tensor] = []
    return tensors, _flatten(out, tensors)


def _flatten(out: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        tensors.append(out)
        return _TENSOR
    if isinstance(out, _STATIC_LEAVES):
        return ("static", out)
    if isinstance(out, Mapping):
        keys = list(out.keys())
        return ("map", out, keys, [_flatten(out[k], tensors) for k in keys])
    if isinstance(out, (tuple, list)):
        return ("seq", type(out), [_flatten(v, tensors) for v in out])
    if is_kv_cache(out):
        raise CacheOutput(
            f"the output holds a {type(out).__name__} (a KV cache), which a graph cannot return"
        )
    raise NotGraphable(f"the output holds a {type(out).__name__}, which cannot be rebuilt from a graph")


def unflatten_output(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor], spec: Any) -> Any:
    """The output `flatten_output` gave `spec` for, around new `tensors`."""
    return _unflatten(iter(tensors), spec)


def _unflatten(it: Iterator[torch.Tensor], spec: Any) -> Any:
    if spec is _TENSOR:
        return next(it)
    kind = spec[0]
    if kind == "static":
        return spec[1]
    if kind == "map":
        _, template, keys, children = spec
        out = copy.copy(template)  # the same class (a ModelOutput stays one); every key is set again below
        for key, child in zip(keys, children, strict=True):
            out[key] = _unflatten(it, child)
        return out
    _, cls, children = spec
    values = [_unflatten(it, child) for child in children]
    return cls(*values) if hasattr(cls, "_fields") else cls(values)  # a namedtuple takes fields


# ---------------------------------------------------------------------------------------------------
# Capture and replay
# ---------------------------------------------------------------------------------------------------


class _Capture(nn.Module):
    """The surface `make_graphed_callables` graphs: the module's parameters, and its original forward called
    with one call layout's static arguments around the tensors, returning the output's tensors."""

    def __init__(self, module: nn.Module, forward: Any, layout: tuple) -> None:
        super().__init__()
        self.inner = module
        self.__dict__["_run"] = forward  # not a submodule or parameter
        self.layout = layout
        self.output_spec: Any = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild_call(tensors, self.layout)
        flat, self.output_spec = flatten_output(self._run(*args, **kwargs))
        return tuple(flat)


class _Graph:
    """One captured signature: its graphed callable, the parameters it read, and its pending backward."""

    def __init__(self, call: Any, params: tuple[nn.Parameter, ...], output_spec: Any) -> None:
        self.call = call
        self.params = params
        self.param_state = _param_state(params)
        self.output_spec = output_spec
        self.pending: weakref.ref | None = None  # the last replay's backward node, until it has run


class GraphedForward:
    """The replacement `forward`: graphs per call signature, the original forward otherwise."""

    def __init__(self, module: nn.Module, max_graphs: int) -> None:
        self.original = module.forward  # a bound method (or torch.compile's forward): holds the module
        self.module = module
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.disabled_reason: str | None = None
        self.failed = False  # a capture failed: every later call runs the original forward directly
        self.warned: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:  # a capture failed (warned once): the plain forward, with nothing else per call
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():
            return self.original(*args, **kwargs)  # torch.compile traces the original forward
        reason = _eager_reason(args, kwargs)
        if reason is not None:
            return self._eager(reason, args, kwargs)
        try:
            tensors, layout = split_call(args, kwargs)
        except NotGraphable as exc:
            return self._eager(str(exc), args, kwargs)
        key = _signature(self.module, tensors, layout)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, tensors, layout)
            if graph is None:
                return self._eager(self.disabled_reason or self._capture_skip_reason(), args, kwargs)
        if _backward_pending(graph):
            return self._eager("a second forward before the first one's backward", args, kwargs)
        if _param_state(graph.params) != graph.param_state:
            return self._eager(
                "the parameters changed since the capture (moved, cast or frozen)", args, kwargs
            )
        flat = graph.call(*tensors)
        _track_backward(graph, flat, n_inputs=len(tensors))
        return unflatten_output(flat, graph.output_spec)

    def _eager(self, reason: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The original forward, with a warning the first time this reason sends a call there."""
        self._warn(f"runs its forward eagerly: {reason}")
        return self.original(*args, **kwargs)

    def _capture_skip_reason(self) -> str:
        return f"more than {self.max_graphs} call signatures (max_graphs)"

    def _capture(self, key: tuple, tensors: tuple[torch.Tensor, ...], layout: tuple) -> _Graph | None:
        if self.disabled_reason is not None or len(self.graphs) >= self.max_graphs:
            return None
        module = self.module
        reason = _hooks_in(module)
        if reason is not None:
            self.disabled_reason = reason
            return None
        params = tuple(module.parameters())
        # static inputs of their own: the caller's first batch must not become the graph's input buffer
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        device = tensors[0].device
        stream = torch.cuda.current_stream(device)
        try:
            graphed = self._graphed_without_a_cache_output(layout, sample)
        except NotGraphable as exc:  # found while warming up, before any capture began
            self.disabled_reason = str(exc)
            return None
        except Exception as exc:  # the forward cannot be captured: stay eager, for good
            torch.cuda.set_stream(stream)  # torch.cuda.graph's __exit__ raised before restoring it
            _release_rng_capture(device)
            first = (str(exc).strip().splitlines() or [""])[0]
            self.disabled_reason = f"capture failed ({type(exc).__name__}: {first}){blocking_frame(exc)}"
            self.failed = True
            del sample
            _leave_no_trace(device)
            return None
        graph = self.graphs[key] = _Graph(graphed.forward, params, graphed.output_spec)
        return graph

    def _graphed_without_a_cache_output(self, layout: tuple, sample: tuple[torch.Tensor, ...]) -> _Capture:
        """The graphed surface; where the forward returns a KV cache because the call left `use_cache` at the
        model's default (a causal LM training: the cache is filled and never read), captured with
        use_cache=False instead, with a warning (the output holds no cache then)."""
        try:
            return self._graphed_with_compiled_regions(layout, sample)
        except CacheOutput as exc:
            without = _layout_without_cache(self.original, layout)
            if without is None:
                raise
            self._warn(f"is graphed with use_cache=False: {exc} (it returns no KV cache)")
            return self._graphed_with_compiled_regions(without, sample)

    def _graphed_with_compiled_regions(self, layout: tuple, sample: tuple[torch.Tensor, ...]) -> _Capture:
        """The graphed surface (make_graphed_callables replaces its forward). Compiled regions inside the
        forward (`compile_region`, compile_blocks) do not compile under a capture: a call that meets no
        compiled code there runs uncompiled and is recorded (library code often takes another path under
        capture, such as transformers' attention mask). Those calls are compiled after the capture, and a
        new surface is captured once more, so the graph holds compiled code."""
        region.take_capture_misses()  # left by captures that were not ours
        graphed = _make_graphed(self.module, self._surface(layout), sample)
        missed = region.take_capture_misses()
        if not missed:
            return graphed
        del graphed
        region.compile_missed(missed)
        graphed = _make_graphed(self.module, self._surface(layout), sample)
        left = sorted({m.region.name for m in region.take_capture_misses()})
        if left:
            self._warn(
                f"{', '.join(left)} runs uncompiled inside its CUDA graph (no compiled code fits its call)"
            )
        return graphed

    def _surface(self, layout: tuple) -> _Capture:
        surface = _Capture(self.module, self.original, layout)
        surface.training = self.module.training  # not .train(): that would recurse into the module
        return surface

    def _warn(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            name = type(self.module).__name__
            warnings.warn(f"opadvisor.kernels.cuda_graphed: {name} {message}", RuntimeWarning, stacklevel=4)


def _layout_without_cache(forward: Any, layout: tuple) -> tuple | None:
    """`layout` with the keyword argument use_cache=False added, or None when the call passed use_cache
    itself (by name or position) or the forward takes no such parameter. A forward replaced on the instance
    by a wrapper taking (*args, **kwargs) (opadvisor.patch's) is read through to its class's forward."""
    n_args, names, slots = layout
    try:
        params = list(inspect.signature(forward).parameters.values())
        owner = getattr(forward, "__self__", None)
        if owner is not None and any(p.kind is p.VAR_KEYWORD for p in params):
            params = list(inspect.signature(type(owner).forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return None
    params = [p.name for p in params]
    if "use_cache" in names or "use_cache" not in params or params.index("use_cache") < n_args:
        return None
    return n_args, (*names, "use_cache"), (*slots, (bool, False))


def _make_graphed(module: nn.Module, surface: _Capture, sample: tuple[torch.Tensor, ...]) -> _Capture:
    """make_graphed_callables of `surface` (warm-up passes, then the capture of forward and backward), the
    module's buffers restored afterwards (the warm-up passes update BatchNorm statistics, say)."""
    buffers = [b.detach().clone() for b in module.buffers()]
    # A collection inside the capture runs the finalizers of whatever garbage earlier code left (graphed
    # modules sit in reference cycles with their graphs and memory pools), and what they free can break
    # the capture: on the H200 the GPU suite's capture failed so ("operation failed due to a previous
    # error during capture") after earlier tests, never alone. So: collect now, and none inside.
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with _autocast_without_cache():
            return torch.cuda.make_graphed_callables(
                surface, sample, num_warmup_iters=WARMUP_ITERS, allow_unused_input=True
            )
    finally:
        if collecting:
            gc.enable()
        with torch.no_grad():
            for buf, saved in zip(module.buffers(), buffers, strict=True):
                buf.copy_(saved)


def blocking_frame(exc: BaseException) -> str:
    """ " at FILE:LINE in FUNCTION: SOURCE" for the innermost frame of `exc`'s traceback outside torch and
    this module (the user's or a library's line that the capture stopped at), or "" when there is none."""
    skip = (os.path.dirname(torch.__file__) + os.sep, __file__)
    found = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename
        if not path.startswith(skip[0]) and path != skip[1]:
            found = (path, line, frame.f_code.co_name)
    if found is None:
        return ""
    path, line, function = found
    source = linecache.getline(path, line).strip()
    return f" at {path}:{line} in {function}" + (f": {source}" if source else "")


def _leave_no_trace(device: torch.device) -> None:
    """After a failed capture: free what the warm-up passes and the partial capture left behind, so the
    eager forward that runs from now on finds the process as it was before the attempt.

    make_graphed_callables warms up on a side stream of its own: the memory its passes cached belongs to
    that stream (the caller's stream never reuses it), and the autograd nodes those passes created for the
    parameters (AccumulateGrad, bound to that stream) live on while anything reaches them. A collection
    drops the cycles that still hold them, and the caching allocator gives the side stream's blocks back."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _release_rng_capture(device: torch.device) -> None:
    """Take the device's default generator out of capture mode after a capture that failed.

    Every capture registers the default CUDA generator, and only a capture that ends cleanly takes it out
    of capture mode again (torch 2.11: when cudaStreamEndCapture fails on an invalidated capture, the
    generator's epilogue never runs). Left so, every later random op on the device fails with "Offset
    increment outside graph capture encountered unexpectedly". A tiny capture that ends cleanly runs that
    epilogue on the same generator state (so graphs captured before keep advancing the same offsets)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scratch = torch.zeros(1, device=device)
        with torch.cuda.graph(graph):
            scratch.add_(1)


def _eager_reason(args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this call runs eagerly whatever its arguments, or None."""
    if not torch.is_grad_enabled():
        return "gradients are disabled (no_grad / inference): graphs capture training steps"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "another CUDA graph is being captured (the outer graph captures this forward)"
    return None


def _signature(module: nn.Module, tensors: tuple[torch.Tensor, ...], layout: tuple) -> tuple:
    autocast = torch.is_autocast_enabled("cuda")
    return (
        module.training,
        autocast,
        torch.get_autocast_dtype("cuda") if autocast else None,
        layout,
        tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors),
    )


def _param_state(params: tuple[nn.Parameter, ...]) -> tuple:
    return tuple((p.data_ptr(), p.dtype, p.requires_grad) for p in params)


def _hooks_in(module: nn.Module) -> str | None:
    """Why hooks forbid graphing this module (they would run only while capturing), or None."""
    if torch.nn.modules.module._has_any_global_hook():
        return "global module hooks are registered (a profiler?)"
    for name, sub in module.named_modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return f"module {name or '(root)'} has hooks"
    return None


def _autocast_without_cache() -> contextlib.AbstractContextManager:
    """The caller's autocast state with its weight-cast cache off (captured casts must not be cached)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def _backward_pending(graph: _Graph) -> bool:
    return graph.pending is not None and graph.pending() is not None


def _track_backward(graph: _Graph, flat: tuple[torch.Tensor, ...], n_inputs: int) -> None:
    """Remember the replay's backward node until it runs; give parameters fresh gradient memory."""
    node = next((t.grad_fn for t in flat if t.grad_fn is not None), None)
    if node is None:
        graph.pending = None
        return
    graph.pending = weakref.ref(node)
    n_user = n_inputs  # the node's inputs: the call's tensors, then the parameters
    params = graph.params

    def after_backward(grad_inputs: tuple, _grad_outputs: tuple) -> tuple:
        graph.pending = None
        # The graph returns its own gradient buffers; a parameter whose .grad is None would take one over
        # and the next replay would overwrite it. Copy those (one fused launch); accumulate into the rest.
        fresh_at = [
            i
            for i, g in enumerate(grad_inputs)
            if g is not None and i >= n_user and params[i - n_user].grad is None
        ]
        if not fresh_at:
            return grad_inputs
        copies = torch._foreach_mul([grad_inputs[i] for i in fresh_at], 1.0)
        out_grads = list(grad_inputs)
        for i, c in zip(fresh_at, copies, strict=True):
            out_grads[i] = c
        return tuple(out_grads)

    node.register_hook(after_backward)
