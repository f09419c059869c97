"""Kernels index in int32 unless a tensor reaches 2**31 elements: both index widths give the same bits.

(The int64 path on real 2**31-element tensors runs in test_kernels_gpu_large on a GPU.)"""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import record_launches
from opadvisor.kernels import _layout, _rng, bias_dropout_add, dropout_add, masked_softmax, softmax

pytestmark = pytest.mark.usefixtures("kernels_everywhere")


def test_needs_int64_counts_elements_and_strided_reach():
    assert not _layout.needs_int64((4, 8), [(8, 1)])
    assert _layout.needs_int64((2**16, 2**15), [(2**15, 1)])  # 2**31 elements
    assert _layout.needs_int64((2, 8), [(2**31, 1)])  # few elements, far apart
    assert not _layout.needs_int64((2**20, 8), [(0, 1)])  # broadcast: no reach


def _clear_plans():
    softmax._plan.cache_clear()
    softmax._launch_plan.cache_clear()
    dropout_add._fwd_plan.cache_clear()
    dropout_add._bwd_plan.cache_clear()


def _both_ops(device):
    torch.manual_seed(0)
    s = torch.randn(2, 3, 5, 37, device=device, requires_grad=True)
    mask = torch.rand(2, 1, 1, 37, device=device) < 0.3
    x = torch.randn(6, 70, device=device, requires_grad=True)
    r = torch.randn(6, 70, device=device, requires_grad=True)
    b = torch.randn(70, device=device, requires_grad=True)
    out = masked_softmax(s, mask, scale=0.5, zero_masked=True, dropout_p=0.2).square().sum()
    out = out + bias_dropout_add(x, b, r, 0.3).square().sum()
    grads = torch.autograd.grad(out, [s, x, r, b])
    return [out.detach(), *grads]


def test_int32_and_int64_indexing_agree(device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: (5, 6, 7))
    _clear_plans()
    narrow = _both_ops(device)
    monkeypatch.setattr(_layout, "INT32_SAFE", 1)  # every launch takes the int64 path
    _clear_plans()
    try:
        assert softmax._plan((4, 8), (8, 1), None, 1, softmax.MAX_BLOCK, softmax.LOOP_BLOCK)[2]["I64"]
        metas = record_launches(monkeypatch)
        wide = _both_ops(device)
        indexing = [meta["I64"] for meta in metas if "I64" in meta]  # (the bias-gradient sum has none)
        assert len(indexing) == 4 and all(indexing)
    finally:
        _clear_plans()
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a, b)
