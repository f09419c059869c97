"""The manual_layernorm rewrite computes the same function: before and after code run on random CPU fp32
tensors give the same outputs and the same gradients (inputs, weights and biases).

Every function and nn.Module of each safe fixture is called: the first argument, and any named like an
activation, is a [4, 5, 16] tensor; arguments named like a weight or bias (w*, b*, gamma, beta) are [16]
tensors; modules are built with `Cls(16)` (or `Cls()`) and get random parameters.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from remaining_helpers import FIXTURES, expected_path, options

HIDDEN = 16
PARAM_PREFIXES = ("w", "b", "gamma", "beta")


def _load(path: Path) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": f"fixture_{path.stem.replace('.', '_')}"}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace


def _callables(namespace: dict[str, Any]) -> dict[str, Any]:
    own = namespace["__name__"]
    return {
        name: obj
        for name, obj in namespace.items()
        if getattr(obj, "__module__", None) == own and (inspect.isfunction(obj) or inspect.isclass(obj))
    }


def _arguments(fn: Any, generator: torch.Generator) -> list[torch.Tensor]:
    args = []
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    for i, p in enumerate(params):
        if p.default is not inspect.Parameter.empty:
            continue
        shape = (HIDDEN,) if i > 0 and p.name.startswith(PARAM_PREFIXES) else (4, 5, HIDDEN)
        args.append((torch.randn(shape, generator=generator) * 3 + 1).requires_grad_())
    return args


def _outputs(result: Any) -> list[torch.Tensor]:
    items = result if isinstance(result, tuple) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _run(obj: Any, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs, then gradients of every input and parameter, for fixed random inputs."""
    generator = torch.Generator().manual_seed(seed)
    if inspect.isclass(obj):
        try:
            module = obj(HIDDEN)
        except TypeError:  # a module without constructor arguments
            module = obj()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        fn, leaves = module, list(module.parameters())
        args = _arguments(module.forward, generator)
    else:
        fn, leaves = obj, []
        args = _arguments(obj, generator)
    outs = _outputs(fn(*args))
    upstream = [torch.randn(o.shape, generator=generator) for o in outs]
    torch.autograd.backward(outs, upstream)
    grads = [t.grad for t in [*args, *leaves]]
    return [o.detach() for o in outs], grads


def _safe_cases() -> list[Path]:
    cases = []
    for case in sorted((FIXTURES / "manual_layernorm").glob("*.in.py")):
        source, expected = case.read_text(), expected_path(case)
        if (
            not expected.exists()
            or options(source, "manual_layernorm").kwargs.get("allow_unsafe")
            or expected.read_text() == source
        ):
            continue
        cases.append(case)
    return cases


@pytest.mark.parametrize("case", _safe_cases(), ids=lambda p: p.name.removesuffix(".in.py"))
def test_rewrite_is_numerically_equivalent(case: Path) -> None:
    before, after = _callables(_load(case)), _callables(_load(expected_path(case)))
    assert before.keys() == after.keys() and before
    for name, obj in before.items():
        if inspect.isclass(obj) and not issubclass(obj, torch.nn.Module):
            continue
        outs_before, grads_before = _run(obj, seed=0)
        outs_after, grads_after = _run(after[name], seed=0)
        assert len(outs_before) == len(outs_after), name
        for a, b in zip(outs_before, outs_after, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"{case.name}: {name} output")
        for a, b in zip(grads_before, grads_after, strict=True):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"{case.name}: {name} gradient")


def test_unsafe_rewrites_really_change_the_numbers() -> None:
    """What `allow_unsafe` rewrites (unbiased statistics, eps outside the root) is not the same function."""
    case = FIXTURES / "manual_layernorm" / "unsafe_allowed.in.py"
    before, after = _callables(_load(case)), _callables(_load(expected_path(case)))
    for name in ("AnnotatedLayerNorm", "unbiased"):
        out_before, _ = _run(before[name], seed=0)
        out_after, _ = _run(after[name], seed=0)
        assert not torch.allclose(out_before[0], out_after[0], rtol=1e-3, atol=1e-3), name
