"""The first-call check: a patched module's first call runs the original forward and the replacement on copies
of its inputs with dropout off and compares the outputs and the gradients (inputs and parameters), within the
rounding of the dtype the module computes in (`_TOLERANCE`); where 16-bit rounding is in play, against a
float32 run of the original (`_judged_against_float32`)."""

from __future__ import annotations

import copy as copy_module
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from .shared import _Patcher, _State

# Relative tolerance of the first-call check (max |replacement - original| / max |original|, per output
# and per gradient), by the dtype the module computes in: the rounding of that dtype, with room for a
# different order of summation (SDPA accumulates differently from matmul -> softmax -> matmul).
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _first_call_check(
    module: nn.Module, state: _State, patcher: _Patcher, args: tuple, kwargs: dict
) -> str | None:
    """None when the replacement gives the original's outputs and gradients (dropout off), else why not.
    Where 16-bit rounding is in play and they differ, the replacement passes if it is no further from a
    float32 run of the original than the original itself is (`_judged_against_float32`)."""
    saved = _dropout_off(module)
    try:
        # The check's own forward and backward keep what they save: inside a non-reentrant checkpoint
        # (transformers' gradient checkpointing) its hooks would otherwise take those tensors, and the check's
        # backward would recompute the whole checkpointed layer from inside this call
        # The caller's gradient mode is kept: a replacement may branch on it (the fused LM head and loss
        # run only with gradients on), and a call without gradients compares outputs alone; the first call
        # with gradients on is checked, gradients too, as a path of its own (install._call_path)
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            ref, ref_grads = _run_and_differentiate(module, state.original, patcher, args, kwargs)
            new_forward = functools.partial(patcher.forward, module, state)
            new, new_grads = _run_and_differentiate(module, new_forward, patcher, args, kwargs)
            # the module's parameters are in play too: a model held in bf16 computes in bf16 whatever dtype
            # its inputs (token ids) and its output (a float32 loss) have
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tol = _tolerance(ref, [*tensors, *module.parameters()])
            problem = _compare("output", ref, new, tol) or _compare_grads(ref_grads, new_grads, tol)
            if problem is not None and tol >= _TOLERANCE[torch.float16]:
                exact = _float32_run(module, state, patcher, args, kwargs, like=ref)
                if exact is not None:
                    problem = _judged_against_float32((ref, ref_grads), (new, new_grads), exact, tol, problem)
    except Exception as exc:  # noqa: BLE001 - a replacement that fails must fall back, not break the step
        return f"failed on the first call ({type(exc).__name__}: {exc})"
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    return problem


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


Gradients = dict[str, torch.Tensor | None]


def _run_and_differentiate(
    module: nn.Module,
    forward: Callable[..., Any],
    patcher: _Patcher,
    args: tuple,
    kwargs: dict,
    cast: torch.dtype | None = None,
    upstream_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, Gradients]:
    """`forward` on copies of the arguments (floating ones cast to `cast` when given): its main output and
    the gradients of its inputs and of the module's parameters for a fixed upstream gradient (rounded to
    `upstream_dtype` first when given: the float32 run sees the 16-bit runs' upstream values)."""
    call_args, call_kwargs, leaves = _copies(args, kwargs, cast)
    out = patcher.main_output(forward(*call_args, **call_kwargs))
    if not out.requires_grad:
        return out, {}
    generator = torch.Generator(device=out.device).manual_seed(0)  # leaves the global RNG alone
    upstream = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32)
    upstream = upstream.to(upstream_dtype or out.dtype).to(out.dtype)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    names = [f"input {i}" for i in range(len(leaves))] + [n for n, _ in params]
    got = _gradients(out, [*leaves, *(p for _, p in params)], upstream)
    return out, dict(zip(names, got, strict=True))


def _gradients(out: torch.Tensor, wrt: list[torch.Tensor], upstream: torch.Tensor) -> tuple:
    """d out / d wrt for the upstream gradient; through `backward` where the forward ran a reentrant
    checkpoint (torch.utils.checkpoint with use_reentrant=True refuses autograd.grad): the module's whole
    forward holds checkpointed layers, as a model's does under gradient checkpointing."""
    if _ran_reentrant_checkpoint(out):
        return _gradients_by_backward(out, wrt, upstream)
    return torch.autograd.grad(out, wrt, upstream, allow_unused=True)


# The autograd nodes `_ran_reentrant_checkpoint` visits at most (a large model's step has tens of thousands)
MAX_GRAPH_NODES = 200_000


def _ran_reentrant_checkpoint(out: torch.Tensor) -> bool:
    """Whether `out`'s autograd graph holds a reentrant checkpoint's node (asked before differentiating:
    autograd.grad refuses such a graph only after it has freed part of it)."""
    seen: set = set()
    stack = [out.grad_fn]
    while stack and len(seen) < MAX_GRAPH_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False


def _gradients_by_backward(out: torch.Tensor, wrt: list[torch.Tensor], upstream: torch.Tensor) -> tuple:
    """`_gradients` accumulated into `.grad`: each tensor's own gradient is kept aside and put back."""
    kept = [t.grad for t in wrt]
    for t in wrt:
        t.grad = None
    try:
        out.backward(upstream)
        return tuple(t.grad for t in wrt)
    finally:
        for t, g in zip(wrt, kept, strict=True):
            t.grad = g


def _dropout_off(module: nn.Module) -> list[tuple[Any, str, Any]]:
    """Set every dropout probability under `module` to 0 (nn.Dropout's p, MultiheadAttention's dropout);
    returns what to put back. Training flags stay: the replacement must take the path it takes in training."""
    saved = []
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
            m.p = 0.0
        elif isinstance(m, nn.MultiheadAttention):
            saved.append((m, "dropout", m.dropout))
            m.dropout = 0.0
    return saved


def _copies(
    args: tuple, kwargs: dict, cast: torch.dtype | None = None
) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Detached copies of the tensor arguments (floating ones cast to `cast` when given); those that
    required grad become leaves that do."""
    leaves: list[torch.Tensor] = []

    def copy(value: Any) -> Any:
        if type(value).__name__.endswith("Cache"):  # a transformers KV cache: each run fills its own copy
            return _copy_cache(value)
        if not isinstance(value, torch.Tensor):
            return value
        out = value.detach().clone()
        if cast is not None and out.is_floating_point():
            out = out.to(cast)
        if value.requires_grad and out.is_floating_point():
            out.requires_grad_(True)
            leaves.append(out)
        return out

    return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}, leaves


def _copy_cache(value: Any, depth: int = 0) -> Any:
    """A copy of a KV cache object whose updates leave the original alone: the objects are copied, their
    tensors cloned (clones stay in the autograd graph; deepcopy refuses non-leaf tensors)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_copy_cache(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _copy_cache(v, depth + 1) for k, v in value.items()}
    if depth > 4 or not hasattr(value, "__dict__") or isinstance(value, (type, types.ModuleType, nn.Module)):
        return value
    out = copy_module.copy(value)
    for name, attr in vars(value).items():
        if isinstance(attr, (torch.Tensor, list, dict)) or hasattr(attr, "__dict__"):
            setattr(out, name, _copy_cache(attr, depth + 1))
    return out


def _tolerance(t: torch.Tensor, inputs: Sequence[torch.Tensor] = ()) -> float:
    """The tolerance of the least precise dtype the module computed in: its output's, its inputs', and
    autocast's when it is on (a LayerNorm's float32 output after a bfloat16 product carries bf16 error)."""
    dtypes = {t.dtype, *(x.dtype for x in inputs if x.is_floating_point())}
    device = t.device.type
    if torch.is_autocast_enabled(device):
        dtypes.add(torch.get_autocast_dtype(device))
    tol = max(_TOLERANCE.get(d, 1e-3) for d in dtypes)
    if dtypes == {torch.float32} and t.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        tol = 1e-2  # TF32 products round to 10 bits
    return tol


def _compare(what: str, ref: torch.Tensor, new: torch.Tensor, tol: float, floor: float = 0.0) -> str | None:
    """None when `new` is `ref` up to the rounding of the compute dtype: max |new - ref| within the
    tolerance times the larger of ref's own scale and `floor` (the scale of the gradients around it: a
    gradient that is zero in exact arithmetic, such as softmax's with respect to a key bias, is noise)."""
    if ref.shape != new.shape:
        return f"gives a different {what} shape ({tuple(new.shape)} vs {tuple(ref.shape)})"
    ref32, new32 = ref.detach().float(), new.detach().float()
    if not bool(torch.isfinite(new32).eq(torch.isfinite(ref32)).all()):
        return f"gives non-finite values where the original does not ({what})"
    finite = torch.isfinite(ref32)
    if not bool(finite.any()):
        return None
    scale = max(ref32[finite].abs().max().item(), floor, 1e-12)
    err = (new32 - ref32)[finite].abs().max().item()
    if err > tol * scale:
        return (
            f"differs from it: {what} max |difference| {err:.3g}, {err / scale:.2g} of its scale "
            f"(tolerance {tol:g})"
        )
    return None


def _bias_floor(name: str, scale_of: dict[str, float]) -> float:
    """A bias's gradient is its layer's output gradient summed over tokens, as its weight's is that sum
    weighted by the inputs: the weight's gradient scale is the scale its rounding noise comes at. Where the
    bias's gradient is zero in exact arithmetic (a key bias before softmax: a constant per row), what is
    left is that noise (measured on an H200 in bf16: 0.1 of the key bias's own scale)."""
    if not name.endswith("bias"):
        return 0.0
    return scale_of.get(name[: -len("bias")] + "weight", 0.0)


def _compare_grads(got_ref: Gradients, got_new: Gradients, tol: float) -> str | None:
    floors = _noise_floors(got_ref)
    for name, a, b in _gradient_pairs(got_ref, got_new):
        problem = _compare(f"gradient of {name}", a, b, tol, floor=floors[name])
        if problem is not None:
            return problem
    return None


def _noise_floors(grads: Gradients) -> dict[str, float]:
    """Per gradient, the scale its differences are judged against at least (`_compare`'s floor): a
    thousandth of the largest gradient, and a bias's weight's scale (`_bias_floor`)."""
    scale_of = {n: g.detach().abs().max().item() for n, g in grads.items() if g is not None and g.numel()}
    floor = 1e-3 * max(scale_of.values(), default=0.0)
    return {name: max(floor, _bias_floor(name, scale_of)) for name in grads}


def _gradient_pairs(*runs: Gradients) -> list[tuple[str, ...]]:
    """(name, gradient of each run) for every gradient of the first run that some run has; a run without
    it (the parameter unused there) gives zeros: a gradient one program lost is a difference."""
    out = []
    for name in runs[0]:
        got = [run.get(name) for run in runs]
        like = next((g for g in got if g is not None), None)
        if like is not None:
            out.append((name, *(torch.zeros_like(like) if g is None else g for g in got)))
    return out


def _float32_run(
    module: nn.Module, state: _State, patcher: _Patcher, args: tuple, kwargs: dict, like: torch.Tensor
) -> tuple[torch.Tensor, Gradients] | None:
    """The original forward and its gradients in float32 (autocast off, floating arguments cast): the
    reference both 16-bit runs are rounded from. None where the module's own parameters are not float32
    (a model cast to bfloat16 has no float32 run to compare with)."""
    if any(p.dtype != torch.float32 for p in module.parameters()):
        return None
    device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), "cpu")
    with torch.autocast(device, enabled=False):
        out, grads = _run_and_differentiate(
            module, state.original, patcher, args, kwargs, torch.float32, upstream_dtype=like.dtype
        )
    return out, grads


def _judged_against_float32(
    ref: tuple[torch.Tensor, Gradients],
    new: tuple[torch.Tensor, Gradients],
    exact: tuple[torch.Tensor, Gradients],
    tol: float,
    problem: str,
) -> str | None:
    """The replacement differs from the original by more than 16-bit rounding explains (`problem`): it
    passes where every output and gradient of it is, as a whole (relative Frobenius norm), within twice the
    original's own distance from the float32 run or the tolerance, whichever is larger (two 16-bit programs
    each rounded from the same exact values may differ by the sum of their errors), and no element of it is
    further than `_ELEMENT_CEILING` tolerances (or twice the original's largest). Distances are relative to
    the float32 value's scale, never below its noise floor (`_noise_floors`: a key bias's gradient, zero in
    exact arithmetic, is noise); a gradient the replacement lost counts as zeros. Deep layers of a bf16
    attention are such a case: the hand-written softmax rounds its scores to bf16, SDPA keeps them in float32,
    and SDPA's backward cancels in bf16 where a near-uniform softmax's gradient is small."""
    floors = {"output": 0.0, **{f"gradient of {n}": f for n, f in _noise_floors(exact[1]).items()}}
    pairs = [("output", exact[0], ref[0], new[0])]
    pairs += [(f"gradient of {n}", x, a, b) for n, x, a, b in _gradient_pairs(exact[1], ref[1], new[1])]
    for what, x, a, b in pairs:
        x32 = x.detach().float()
        theirs, ours = _distances(x32, a, floors[what]), _distances(x32, b, floors[what])
        limits = (max(tol, 2.0 * theirs[0]), max(_ELEMENT_CEILING * tol, 2.0 * theirs[1]))
        for i, kind in enumerate(("as a whole (norm)", "at its largest element")):
            if ours[i] > limits[i]:
                return (
                    f"{problem}; against a float32 run of the original, its {what} is {ours[i]:.2g} of the "
                    f"scale away {kind}, the original's {theirs[i]:.2g}"
                )
    return None


# How far one element of a 16-bit program may be from the float32 value, in tolerances, in the float32
# judgement: fused attention's backward (every SDPA backend) leaves bf16 query/key gradients 0.02-0.06 of their
# scale from float32 at some elements where a near-uniform softmax cancels (BERT-base, H200), while the whole
# tensor stays within the tolerance (0.014-0.025 relative norm); a wrong formula or a wrong row moves elements by
# the tensor's whole scale.
_ELEMENT_CEILING = 4.0


def _distances(exact: torch.Tensor, got: torch.Tensor, floor: float) -> tuple[float, float]:
    """(whole-tensor, largest-element) distance of `got` from `exact`, relative to `exact`'s scale (its norm,
    its largest magnitude), never below what `floor`, a scale of one element, gives."""
    diff = got.detach().float() - exact
    norm_scale = max(exact.norm().item(), floor * exact.numel() ** 0.5, 1e-12)
    max_scale = max(exact.abs().max().item(), floor, 1e-12)
    return diff.norm().item() / norm_scale, diff.abs().max().item() / max_scale
