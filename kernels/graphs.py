"""`cuda_graphed(module)`: a module's forward and backward replayed from CUDA graphs, per input shape.

A training step of a mid-sized transformer launches about two thousand kernels; when most of them are short,
the GPU waits for the host to launch the next one (the BERT-base example after `opadvisor apply`: the GPU
busy 18 ms of a 29 ms step, the rest launch time). A CUDA graph launches all of a forward's (or a
backward's) kernels at once. `cuda_graphed` captures them with `torch.cuda.make_graphed_callables` (the
forward and backward as one autograd node) the first time it sees a set of input shapes, and replays them
afterwards; everything else in the step (data, loss, optimizer) stays as written.

Returns the same module object with its `forward` replaced (an instance attribute): parameters, buffers,
`state_dict`, `isinstance` and attribute access are unchanged. Each call runs the original forward eagerly,
which is always correct, unless all of these hold:

- gradients are enabled, every positional argument is a CUDA tensor, no keyword arguments, and neither
  torch.compile is tracing nor another graph capturing (torch.compile traces the original forward; the
  tested order is the other one, `cuda_graphed(torch.compile(model))`, which captures the compiled code);
- the module has no forward/backward hooks on any submodule and no global module hooks (they would run
  only at capture);
- the parameters are the ones captured (same storage, dtype and requires_grad), the autocast state is the
  captured one (it is part of the key), and at most `max_graphs` input signatures have been captured;
- the previous graphed forward's backward has run or its autograd graph is gone: a second forward before
  the first one's backward would overwrite the activations the first backward needs, so it runs eagerly.

What a caller must not rely on, and why this rewrite is "unsafe" for `opadvisor apply`: outputs live in the
graph's memory and are overwritten by the next graphed call (keep `.detach().clone()` of an output you
need after the next step); Python side effects inside forward (prints, counters, Python-side randomness)
happen only during capture; dropout draws different (but equally distributed) masks than the eager run;
the capture itself runs the forward and backward 4 extra times once per input signature (buffers such as
BatchNorm statistics are restored afterwards). A capture that fails (a host synchronisation or a data-
dependent shape in forward) warns once and leaves the module eager, with the device's random generator
taken out of the capture mode the failed capture left it in (`_release_rng_capture`).

Gradients are returned in fresh memory when a parameter's `.grad` is None (the usual `zero_grad()`), so a
parameter's `.grad` never aliases the graph's memory and gradient accumulation adds what it should.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

MAX_GRAPHS = 4  # input signatures captured per module; further ones run eagerly (memory per graph)
WARMUP_ITERS = 3  # make_graphed_callables' warm-up passes before capture (cuDNN/cuBLAS lazy init)


def cuda_graphed(module: nn.Module, *, max_graphs: int = MAX_GRAPHS) -> nn.Module:
    """`module`, with its forward and backward replayed from CUDA graphs where that is safe (see the module
    docstring); calling it again on the same module changes nothing."""
    if isinstance(module.__dict__.get("forward"), GraphedForward):
        return module
    module.forward = GraphedForward(module, max_graphs)
    return module


class _Capture(nn.Module):
    """The surface `make_graphed_callables` graphs: the module's parameters and its original forward."""

    def __init__(self, module: nn.Module, forward: Any) -> None:
        super().__init__()
        self.inner = module
        self.__dict__["_run"] = forward  # not a submodule or parameter

    def forward(self, *args: torch.Tensor) -> Any:
        return self._run(*args)


class _Graph:
    """One captured signature: its graphed callable, the parameters it read, and its pending backward."""

    def __init__(self, call: Any, params: tuple[nn.Parameter, ...]) -> None:
        self.call = call
        self.params = params
        self.param_state = _param_state(params)
        self.pending: weakref.ref | None = None  # the last replay's backward node, until it has run


class GraphedForward:
    """The replacement `forward`: graphs per input signature, the original forward otherwise."""

    def __init__(self, module: nn.Module, max_graphs: int) -> None:
        self.original = module.forward  # a bound method (or torch.compile's forward): holds the module
        self.module = module
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.disabled_reason: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or kwargs or not _graphable_call(args):
            return self.original(*args, **kwargs)  # torch.compile traces the original forward
        module = self.module
        key = _signature(module, args)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(module, key, args)
            if graph is None:
                return self.original(*args)
        if _backward_pending(graph) or _param_state(graph.params) != graph.param_state:
            return self.original(*args)
        out = graph.call(*args)
        _track_backward(graph, out, n_inputs=len(args))
        return out

    def _capture(self, module: nn.Module, key: tuple, args: tuple) -> _Graph | None:
        if self.disabled_reason is not None or len(self.graphs) >= self.max_graphs:
            return None
        reason = _hooks_in(module)
        if reason is not None:
            self._disable(reason)
            return None
        params = tuple(module.parameters())
        buffers = [b.detach().clone() for b in module.buffers()]
        surface = _Capture(module, self.original)
        surface.training = module.training  # not .train(): that would recurse into the module
        # static inputs of their own: the caller's first batch must not become the graph's input buffer
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        try:
            with _autocast_without_cache():
                graphed = torch.cuda.make_graphed_callables(
                    surface, sample, num_warmup_iters=WARMUP_ITERS, allow_unused_input=True
                )
        except Exception as exc:  # the forward cannot be captured: say so once, stay eager
            _release_rng_capture(args[0].device)
            self._disable(f"capture failed ({type(exc).__name__}: {exc})")
            return None
        finally:
            with torch.no_grad():
                for buf, saved in zip(module.buffers(), buffers, strict=True):
                    buf.copy_(saved)
        graph = self.graphs[key] = _Graph(graphed.forward, params)
        return graph

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        name = type(self.module).__name__
        warnings.warn(
            f"opadvisor.kernels.cuda_graphed: {name} runs without CUDA graphs: {reason}",
            RuntimeWarning,
            stacklevel=4,
        )


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


def _graphable_call(args: tuple) -> bool:
    return (
        bool(args)
        and torch.is_grad_enabled()
        and all(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        and not torch.cuda.is_current_stream_capturing()
    )


def _signature(module: nn.Module, args: tuple) -> tuple:
    autocast = torch.is_autocast_enabled("cuda")
    return (
        module.training,
        autocast,
        torch.get_autocast_dtype("cuda") if autocast else None,
        tuple((a.shape, a.stride(), a.dtype, a.device, a.requires_grad) for a in args),
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


def _track_backward(graph: _Graph, out: Any, n_inputs: int) -> None:
    """Remember the replay's backward node until it runs; give parameters fresh gradient memory."""
    node = next(
        (
            t.grad_fn
            for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.grad_fn
        ),
        None,
    )
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
