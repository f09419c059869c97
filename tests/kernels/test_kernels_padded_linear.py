"""PaddedLinear is nn.Linear: same init, same state_dict, same outputs and gradients, same optimizer steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from opadvisor.kernels import PaddedLinear, linear, padded_linear


@pytest.fixture
def always_pad(monkeypatch):
    """Pad on the CPU too (by default only CUDA inputs are padded)."""
    monkeypatch.setattr(linear, "should_pad", lambda x: True)


@pytest.mark.parametrize("bias", [True, False])
def test_same_init_and_rng_consumption(bias):
    torch.manual_seed(0)
    ref = nn.Linear(77, 30, bias=bias)
    after_ref = torch.rand(3)
    torch.manual_seed(0)
    pad = PaddedLinear(77, 30, bias=bias)
    after_pad = torch.rand(3)
    assert torch.equal(pad.weight, ref.weight)
    assert (pad.bias is None) == (ref.bias is None) and (not bias or torch.equal(pad.bias, ref.bias))
    assert torch.equal(after_pad, after_ref)  # the RNG was consumed identically
    assert isinstance(pad, nn.Linear)
    assert (pad.in_features, pad.out_features) == (77, 30)


def test_state_dict_round_trip():
    ref = nn.Linear(13, 30522)
    pad = PaddedLinear(13, 30522, multiple=64)
    pad.load_state_dict(ref.state_dict())
    sd = pad.state_dict()
    assert {k: v.shape for k, v in sd.items()} == {"weight": (30522, 13), "bias": (30522,)}
    nn.Linear(13, 30522).load_state_dict(sd)
    assert "multiple=64" in repr(pad)


@pytest.mark.parametrize("shape", [(5, 13, 30), (4, 16, 30), (4, 13, 32), (2, 3, 13, 31)])
def test_function_and_gradients_match(shape, always_pad):
    *lead, n_in, n_out = shape
    torch.manual_seed(1)
    ref = nn.Linear(n_in, n_out).double()
    pad = PaddedLinear(n_in, n_out).double()
    pad.load_state_dict(ref.state_dict())
    x = torch.randn(*lead, n_in, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_pad = ref(x1), pad(x2)
    assert y_pad.shape == y_ref.shape
    torch.testing.assert_close(y_pad, y_ref)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y_pad.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(pad.weight.grad, ref.weight.grad)
    torch.testing.assert_close(pad.bias.grad, ref.bias.grad)
    assert pad.weight.grad.shape == (n_out, n_in)


def test_optimizer_steps_identical(always_pad):
    """Parameters keep their shape: AdamW with weight decay moves both modules identically."""
    torch.manual_seed(2)
    ref = nn.Linear(13, 30).double()
    pad = PaddedLinear(13, 30).double()
    pad.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt_pad = torch.optim.AdamW(pad.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(8, 13, dtype=torch.float64)
        for m, opt in ((ref, opt_ref), (pad, opt_pad)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    torch.testing.assert_close(pad.weight, ref.weight)
    torch.testing.assert_close(pad.bias, ref.bias)


def test_weight_tying(always_pad):
    emb = nn.Embedding(30, 16)
    head = PaddedLinear(16, 30, bias=False)
    head.weight = emb.weight
    x = torch.randn(4, 16)
    torch.testing.assert_close(head(x), F.linear(x, emb.weight))
    head(x).sum().backward()
    assert emb.weight.grad is not None


def test_aligned_sizes_and_cpu_are_plain_linear():
    w = torch.randn(32, 16)
    x = torch.randn(4, 16)
    assert torch.equal(padded_linear(x, w), F.linear(x, w))
    assert not linear.should_pad(x)


@pytest.mark.gpu
def test_cuda_bf16_lm_head():
    torch.manual_seed(3)
    ref = nn.Linear(768, 30522, device="cuda", dtype=torch.bfloat16)
    pad = PaddedLinear(768, 30522, device="cuda", dtype=torch.bfloat16)
    pad.load_state_dict(ref.state_dict())
    x = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16)
    y_ref, y_pad = ref(x), pad(x)
    exact = F.linear(x.double(), ref.weight.double(), ref.bias.double())
    err_pad = (y_pad.double() - exact).norm() / exact.norm()
    err_ref = (y_ref.double() - exact).norm() / exact.norm()
    assert err_pad <= 2 * err_ref + 1e-6
