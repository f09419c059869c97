"""Which implementation runs, and the dropout stream's definition (Triton and PyTorch agree bit for bit)."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import (
    _backend,
    _rng,
    backend,
    bias_dropout_add_backend,
    dropout_add,
    masked_softmax_backend,
    softmax,
)


def test_device_rule(monkeypatch):
    monkeypatch.setattr(_backend, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend("cpu") == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend("cpu") == "reference"
    assert backend("cuda") == "triton"
    assert backend("meta") == "reference"
    monkeypatch.setattr(_backend, "HAS_TRITON", False)
    assert backend("cuda") == "reference"


def test_per_op_rules(monkeypatch):
    monkeypatch.setattr(_backend, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8)
    assert masked_softmax_backend(x) == "interpreter"  # the interpreter ignores the small-size rule
    assert bias_dropout_add_backend(x) == "interpreter"
    assert masked_softmax_backend(x.double()) == "reference"
    assert masked_softmax_backend(torch.randn(0, 8)) == "reference"
    assert masked_softmax_backend(torch.tensor(1.0)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert masked_softmax_backend(x) == "reference"


def test_small_cuda_tensors_go_to_eager(monkeypatch):
    monkeypatch.setattr(_backend, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_backend, "backend", lambda device: "triton")  # as on a GPU
    small = torch.empty(softmax.SMALL_NUMEL - 1, device="meta")
    large = torch.empty(max(softmax.SMALL_NUMEL, dropout_add.SMALL_NUMEL), device="meta")
    assert masked_softmax_backend(small) == "eager"
    assert masked_softmax_backend(large) == "triton"
    assert bias_dropout_add_backend(torch.empty(dropout_add.SMALL_NUMEL - 1, device="meta")) == "eager"
    assert bias_dropout_add_backend(large) == "triton"


def test_eager_dispatch_runs_the_replaced_chain(monkeypatch):
    """A small tensor on the GPU runs `residual + dropout(x + bias)` in its own dtype: the same ops and
    random draws as the chain the rewrite replaced, so such a rewrite cannot make a step slower."""
    monkeypatch.setattr(_backend, "backend", lambda device: "triton")  # as on a GPU
    x, r = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)
    assert bias_dropout_add_backend(x) == "eager"
    torch.manual_seed(3)
    ours = dropout_add.bias_dropout_add(x, b, r, 0.25)
    torch.manual_seed(3)
    chain = r + torch.nn.functional.dropout(x + b, 0.25)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, chain)


def test_philox_matches_known_answer():
    """Philox4x32-10 known-answer vector (Random123 kat_vectors: counter 0, key 0)."""
    zero = torch.zeros(1, dtype=torch.int64)
    words = [int(w) for w in _rng.philox4x32(zero, zero, zero, zero, 0, 0)]
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("interleave", [True, False])
def test_triton_keep_mask_equals_pytorch_one(interleave, device, kernels_everywhere, monkeypatch):
    """The kernel's mask, read back through bias_dropout_add, is philox_keep_mask bit for bit."""
    monkeypatch.setattr(dropout_add, "RNG_INTERLEAVE", interleave)
    seed = (2**31 - 1, 12345, 3)
    monkeypatch.setattr(_rng, "draw_seed", lambda device: seed)
    x = torch.ones(5, 37, device=device)
    y = dropout_add.bias_dropout_add(x, None, torch.zeros_like(x), 0.3)
    assert torch.equal(y != 0, _rng.philox_keep_mask(seed, 5, 37, 0.3, device))


def test_fixed_dropout_seed_gives_every_call_one_mask(device, kernels_everywhere):
    """Inside `fixed_dropout_seed` every dropout uses the given seed; the draw comes back after it."""
    from opadvisor.kernels import fixed_dropout_seed

    drawn = _rng.draw_seed
    x = torch.ones(5, 37, device=device)
    with fixed_dropout_seed((7, 8, 9)):
        a = dropout_add.bias_dropout_add(x, None, torch.zeros_like(x), 0.3)
        b = dropout_add.bias_dropout_add(x, None, torch.zeros_like(x), 0.3)
    assert _rng.draw_seed is drawn
    assert torch.equal(a != 0, _rng.philox_keep_mask((7, 8, 9), 5, 37, 0.3, device))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="three integers"):
        with fixed_dropout_seed((1, 2**31)):
            pass


def test_seed_draw_follows_manual_seed():
    torch.manual_seed(11)
    a = _rng.draw_seed(torch.device("cpu"))
    torch.manual_seed(11)
    assert _rng.draw_seed(torch.device("cpu")) == a
    assert all(0 <= v < 2**31 for v in a)


def test_small_softmax_runs_the_replaced_chain(monkeypatch):
    """A small tensor on the GPU runs the chain a user writes, in its own dtype: scale, mask, softmax,
    dropout, the same ops and random draws; a fill value float16 cannot hold is clamped to its range."""
    monkeypatch.setattr(_backend, "backend", lambda device: "triton")  # as on a GPU
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    add = torch.where(torch.rand(2, 1, 1, 8) < 0.3, -1e4, 0.0).to(torch.bfloat16)
    assert masked_softmax_backend(x) == "eager"
    torch.manual_seed(5)
    ours = softmax.masked_softmax(x, add, scale=0.5, dropout_p=0.2)
    torch.manual_seed(5)
    chain = torch.nn.functional.dropout(torch.softmax(x * 0.5 + add, -1), 0.2)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, chain)
    half = x.half()
    bool_mask = torch.rand(2, 1, 1, 8) < 0.3
    ours = softmax.masked_softmax(half, bool_mask, fill_value=-1e9, zero_masked=True)
    expected = torch.softmax(half.masked_fill(bool_mask, torch.finfo(torch.half).min), -1).masked_fill(
        bool_mask, 0
    )
    assert torch.equal(ours, expected)
