"""Dropout seeds under CUDA graphs: while a graph is captured the kernels read their seed from a device
tensor drawn by `torch.randint`, so every replay draws a fresh mask (a seed read on the host would repeat
the capture's mask forever), and forward and backward of one replay agree on it.

On the CPU the seed-pointer path of the kernels is checked through the interpreter (a seed given as a
tensor); on a GPU, real captures and replays, directly and through `cuda_graphed`."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from opadvisor.kernels import _rng, bias_dropout_add, cuda_graphed, dropout_add, masked_softmax, softmax

SEED_WORDS = (2024, 11, 5)


def _tensor_seed(device):
    return torch.tensor(SEED_WORDS, dtype=torch.int32, device=device)


@pytest.mark.usefixtures("kernels_everywhere")
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bias_dropout_add_reads_a_device_seed(p, device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", _tensor_seed)
    torch.manual_seed(0)
    x = torch.randn(6, 300, device=device, requires_grad=True)
    bias = torch.randn(300, device=device, requires_grad=True)
    residual = torch.randn(6, 300, device=device)
    dy = torch.randn(6, 300, device=device)
    y = bias_dropout_add(x, bias, residual, p)
    dx, dbias = torch.autograd.grad(y, [x, bias], dy)
    keep = dropout_add.philox_keep_like(x, SEED_WORDS, p)
    scale = 1.0 / (1.0 - p)
    torch.testing.assert_close(y, residual + torch.where(keep, (x + bias) * scale, 0.0))
    torch.testing.assert_close(dx, torch.where(keep, dy * scale, 0.0))
    torch.testing.assert_close(dbias, torch.where(keep, dy * scale, 0.0).sum(0))


@pytest.mark.usefixtures("kernels_everywhere")
def test_masked_softmax_reads_a_device_seed(device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", _tensor_seed)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, 130, device=device, requires_grad=True)
    dy = torch.randn(2, 3, 8, 130, device=device)
    y = masked_softmax(x, dropout_p=0.3)
    (dx,) = torch.autograd.grad(y, [x], dy)
    keep = softmax.philox_keep_like(x, -1, SEED_WORDS, 0.3)
    x_ = x.detach().requires_grad_()
    y_ref = torch.where(keep, torch.softmax(x_, -1) / 0.7, 0.0)
    (dx_ref,) = torch.autograd.grad(y_ref, [x_], dy)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)


def test_host_seed_reads_both_kinds():
    assert _rng.host_seed(SEED_WORDS) == SEED_WORDS
    assert _rng.host_seed(_tensor_seed("cpu")) == SEED_WORDS


# --------------------------------------------------------------------------------------------------
# GPU: real captures
# --------------------------------------------------------------------------------------------------


def _capture(run):
    """(graph, static outputs) of `run()` captured after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


def _record_seeds(monkeypatch):
    seeds = []

    def draw(device, _draw=_rng.draw_seed):
        seed = _draw(device)
        seeds.append(seed)
        return seed

    monkeypatch.setattr(_rng, "draw_seed", draw)
    return seeds


@pytest.mark.gpu
def test_bias_dropout_add_graph_replays_draw_fresh_masks(monkeypatch):
    seeds = _record_seeds(monkeypatch)
    launches = []
    monkeypatch.setattr(
        dropout_add, "_forward", lambda *a, _f=dropout_add._forward: launches.append(1) or _f(*a)
    )
    torch.manual_seed(2)
    p = 0.3
    x = torch.randn(64, 256, device="cuda", requires_grad=True)  # small: eager outside a capture
    bias = torch.randn(256, device="cuda")
    residual = torch.randn(64, 256, device="cuda")
    dy = torch.randn(64, 256, device="cuda")
    assert dropout_add.bias_dropout_add_backend(x) == "eager"

    def run():
        y = bias_dropout_add(x, bias, residual, p)
        (dx,) = torch.autograd.grad(y, [x], dy)
        return y, dx

    launches.clear()
    graph, (y, dx) = _capture(run)
    assert launches, "the kernel did not run during the capture"
    seed = seeds[-1]
    assert isinstance(seed, torch.Tensor) and seed.is_cuda
    masks = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        keep = dropout_add.philox_keep_like(x, seed, p)
        scale = 1.0 / (1.0 - p)
        torch.testing.assert_close(y, residual + torch.where(keep, (x + bias) * scale, 0.0))
        torch.testing.assert_close(dx, torch.where(keep, dy * scale, 0.0))
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    kept = torch.stack(masks).double().mean().item()
    assert abs(kept - (1 - p)) < 0.02


@pytest.mark.gpu
def test_masked_softmax_graph_replays_draw_fresh_masks(monkeypatch):
    seeds = _record_seeds(monkeypatch)
    torch.manual_seed(3)
    x = torch.randn(2, 4, 16, 64, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)

    def run():
        y = masked_softmax(x, dropout_p=0.2)
        (dx,) = torch.autograd.grad(y, [x], dy)
        return y, dx

    graph, (y, dx) = _capture(run)
    seed = seeds[-1]
    assert isinstance(seed, torch.Tensor)
    outs = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = softmax.philox_keep_like(x, -1, seed, 0.2)
        x_ = x.detach().requires_grad_()
        y_ref = torch.where(keep, torch.softmax(x_, -1) / 0.8, 0.0)
        (dx_ref,) = torch.autograd.grad(y_ref, [x_], dy)
        torch.testing.assert_close(y, y_ref)
        torch.testing.assert_close(dx, dx_ref)
        outs.append(y.clone())
    assert not torch.equal(outs[0], outs[1])


class _DropoutBlock(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x):
        return bias_dropout_add(self.lin(x), None, torch.zeros_like(x), 0.5)


@pytest.mark.gpu
def test_cuda_graphed_module_gets_a_fresh_mask_each_step():
    torch.manual_seed(4)
    model = cuda_graphed(_DropoutBlock().cuda())
    x = torch.randn(32, 128, device="cuda", requires_grad=True)
    outs = []
    for _ in range(4):
        x.grad = None
        y = model(x)
        y.sum().backward()
        keep = y != 0
        # dL/dx = (keep * 2) @ W for this step's own mask: forward and backward replays agree
        torch.testing.assert_close(x.grad, (keep.float() * 2.0) @ model.lin.weight)
        outs.append(keep.clone())
    assert len(model.forward.graphs) == 1 and model.forward.disabled_reason is None
    assert not torch.equal(outs[-1], outs[-2])
