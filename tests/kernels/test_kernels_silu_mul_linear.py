"""`silu_mul_linear(g, u, weight)`: a SwiGLU MLP's down projection `F.linear(silu_mul(g, u), weight)` whose
backward computes silu_mul's output again instead of keeping it. The values and every gradient are the
chain's bit for bit (the same kernels, products and casts), with and without autocast; what autograd keeps
is smaller by that output and the 16-bit weight; elsewhere (bias, no grad, compiled) it is the chain itself.
CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), and the GPU at a Llama's sizes."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from opadvisor.kernels import dispatch_counts, reset_dispatch_counts, silu_mul, silu_mul_linear


def _chain(g, u, weight, bias=None):
    return F.linear(silu_mul(g, u), weight, bias)


def _run(fn, g, u, weight, autocast: torch.dtype | None, device: str = "cpu"):
    """fn's output, the gradients of g, u and weight for a fixed output gradient, and the bytes autograd
    saved for the backward (each storage once)."""
    leaves = [t.detach().clone().requires_grad_() for t in (g, u, weight)]
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    amp = torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext()
    with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    gen = torch.Generator().manual_seed(3)
    out.backward(torch.randn(out.shape, generator=gen).to(out.device, out.dtype))
    # the leaves themselves (weight, g, u) are kept anyway: count what is kept beyond them
    own = {leaf.untyped_storage().data_ptr() for leaf in leaves}
    kept = sum(n for ptr, n in saved.items() if ptr not in own)
    return out.detach(), [leaf.grad for leaf in leaves], kept


def _case(dtype: torch.dtype, device: str = "cpu", tokens=(2, 5), inner: int = 48, hidden: int = 16):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(*tokens, inner, generator=gen).to(device, dtype)
    u = torch.randn(*tokens, inner, generator=gen).to(device, dtype)
    weight = (torch.randn(hidden, inner, generator=gen) * 0.1).to(device)
    return g, u, weight


@pytest.mark.parametrize(
    ("dtype", "weight_dtype", "autocast"),
    [
        (torch.float32, torch.float32, None),  # float32 training
        (torch.bfloat16, torch.float32, torch.bfloat16),  # float32 weights, bf16 autocast (Llama's benchmark)
        (torch.bfloat16, torch.bfloat16, None),  # a model cast to bf16
    ],
)
def test_values_and_gradients_are_the_chains_bit_for_bit(dtype, weight_dtype, autocast) -> None:
    g, u, weight = _case(dtype)
    weight = weight.to(weight_dtype)
    reset_dispatch_counts()
    got, got_grads, got_kept = _run(silu_mul_linear, g, u, weight, autocast)
    assert dispatch_counts() == {"silu_mul_linear": {"kernel": 1}}  # its own Function, not the chain
    want, want_grads, want_kept = _run(_chain, g, u, weight, autocast)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for name, a, b in zip(("g", "u", "weight"), got_grads, want_grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # the chain keeps silu_mul's output (and, under autocast, the 16-bit weight) beyond g and u
    y_bytes = g.numel() * g.element_size()
    cast_weight = weight.numel() * 2 if autocast else 0
    assert want_kept - got_kept == y_bytes + cast_weight


def test_a_frozen_weight_gets_no_gradient_and_the_inputs_theirs() -> None:
    g, u, weight = _case(torch.float32)
    g, u = g.requires_grad_(), u.requires_grad_()
    out = silu_mul_linear(g, u, weight)
    out.sum().backward()
    assert weight.grad is None and g.grad is not None and u.grad is not None
    ref_g, ref_u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    _chain(ref_g, ref_u, weight).sum().backward()
    assert torch.equal(g.grad, ref_g.grad) and torch.equal(u.grad, ref_u.grad)


@pytest.mark.parametrize("where", ["bias", "no_grad", "mixed_dtypes"])
def test_elsewhere_it_is_the_chain(where) -> None:
    g, u, weight = _case(torch.float32)
    bias = torch.randn(weight.shape[0]) if where == "bias" else None
    if where == "mixed_dtypes":  # no autocast: F.linear refuses them, as eager's chain does
        with pytest.raises(RuntimeError):
            silu_mul_linear(g.to(torch.bfloat16), u.to(torch.bfloat16), weight.requires_grad_())
        return
    weight.requires_grad_()
    reset_dispatch_counts()
    with torch.no_grad() if where == "no_grad" else contextlib.nullcontext():
        got = silu_mul_linear(g, u, weight, bias)
    assert "silu_mul_linear" not in dispatch_counts() and "silu_mul" in dispatch_counts()  # the chain
    assert torch.equal(got, _chain(g, u, weight, bias))


def test_compiled_it_traces_the_chain_without_a_graph_break() -> None:
    g, u, weight = _case(torch.float32)
    weight.requires_grad_()
    compiled = torch.compile(silu_mul_linear, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(g, u, weight), _chain(g, u, weight))


@pytest.mark.gpu
def test_on_cuda_at_a_llama_mlps_size_under_autocast() -> None:
    """Llama-3.2-1B's MLP (8192 inner, 2048 hidden) over 4096 tokens, float32 weight, bf16 autocast: the
    chain's values and gradients bit for bit, 64 MiB + the 32 MiB bf16 weight fewer kept."""
    g, u, weight = _case(torch.bfloat16, "cuda", tokens=(2, 2048), inner=8192, hidden=2048)
    got, got_grads, got_kept = _run(silu_mul_linear, g, u, weight, torch.bfloat16, "cuda")
    want, want_grads, want_kept = _run(_chain, g, u, weight, torch.bfloat16, "cuda")
    assert torch.equal(got, want)
    for name, a, b in zip(("g", "u", "weight"), got_grads, want_grads, strict=True):
        assert torch.equal(a, b), name
    assert want_kept - got_kept == g.numel() * 2 + weight.numel() * 2
