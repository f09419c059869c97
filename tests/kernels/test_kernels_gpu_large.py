"""GPU only: tensors over 2**31 elements (64-bit offsets) and the eager path for small tensors."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import (
    _rng,
    bias_dropout_add,
    masked_softmax,
    reference_bias_dropout_add,
    reference_masked_softmax,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROWS, COLS = 262_145, 8192  # 2_147_491_840 elements > 2**31
SEED = (99, 98, 97)


def test_masked_softmax_over_2_31_elements(kernels_everywhere):
    x = torch.empty(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    x[:8].normal_()
    x[-8:].normal_()
    mask = torch.rand(COLS, device="cuda") < 0.3
    mask[0] = False
    y = masked_softmax(x, mask, scale=0.5)
    for rows in (slice(0, 8), slice(ROWS - 8, ROWS)):
        ref = reference_masked_softmax(x[rows], mask, scale=0.5)
        torch.testing.assert_close(y[rows].float(), ref.float(), rtol=1e-2, atol=1e-3)
    dy = torch.ones_like(y)
    (dx,) = torch.autograd.grad(masked_softmax(x.requires_grad_(), mask, scale=0.5), x, dy)
    assert dx[-8:].abs().max().item() < 1e-2  # sum(y) = 1 per row: d/dx of sum is 0
    del x, y, dx, dy
    torch.cuda.empty_cache()


def test_bias_dropout_add_over_2_31_elements(kernels_everywhere, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: SEED)
    x = torch.empty(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    x[-8:].normal_()
    residual = torch.zeros_like(x)
    residual[-8:].normal_()
    bias = torch.randn(COLS, device="cuda", dtype=torch.bfloat16)
    y = bias_dropout_add(x, bias, residual, 0.2)
    keep = _rng.philox_keep_mask(SEED, 8, COLS, 0.2, "cuda", first_row=ROWS - 8)
    ref = reference_bias_dropout_add(x[-8:], bias, residual[-8:], 0.2, keep=keep)
    torch.testing.assert_close(y[-8:], ref)
    del x, y, residual
    torch.cuda.empty_cache()


def test_small_tensors_take_the_chain():
    """Under SMALL_NUMEL elements masked_softmax runs the plain chain on the GPU (the same ops as a user's),
    from SMALL_NUMEL on its kernel."""
    from opadvisor.kernels import masked_softmax_backend, softmax

    small = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
    assert masked_softmax_backend(small) == "eager"
    assert torch.equal(masked_softmax(small, scale=0.5), torch.softmax(small * 0.5, -1))
    large = torch.empty(softmax.SMALL_NUMEL // 4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert masked_softmax_backend(large) == "triton"
