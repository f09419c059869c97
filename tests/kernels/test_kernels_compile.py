"""torch.compile traces through the kernels' custom ops: one graph, no break, same results as eager."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import _rng, bias_dropout_add, dropout_add, masked_softmax

FIXED_SEED = (7, 8, 9)

pytestmark = pytest.mark.usefixtures("kernels_everywhere")


def _block(scores, mask, x, bias, residual, bda_p=0.1):
    probs = masked_softmax(scores, mask, scale=0.125, zero_masked=True, dropout_p=0.1)
    return probs.sum(-1).mean() + bias_dropout_add(x, bias, residual, bda_p).sum()


def _block_bda_no_dropout(scores, mask, x, bias, residual):
    return _block(scores, mask, x, bias, residual, bda_p=0.0)


def _inputs(device):
    torch.manual_seed(0)
    scores = torch.randn(2, 2, 8, 40, device=device, requires_grad=True)
    mask = torch.rand(2, 1, 1, 40, device=device) < 0.3
    x = torch.randn(16, 64, device=device, requires_grad=True)
    bias = torch.randn(64, device=device, requires_grad=True)
    residual = torch.randn(16, 64, device=device, requires_grad=True)
    return scores, mask, x, bias, residual


def _fwd_bwd(fn, inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward()
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _check(device, backend, monkeypatch, compile_path):
    """One graph, no break, compiled == eager. With bias_dropout_add traced as its PyTorch chain
    ("chain"), its dropout draws from torch's generator under compile: compared without dropout there."""
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    monkeypatch.setattr(dropout_add, "COMPILE_PATH", compile_path)
    block = _block if compile_path == "custom_op" else _block_bda_no_dropout
    inputs = _inputs(device)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    ops = {str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("masked_softmax_fwd" in o for o in ops)
    assert any("bias_dropout_add_fwd" in o for o in ops) == (compile_path == "custom_op")
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out_c, grads_c = _fwd_bwd(compiled, inputs)
    out_e, grads_e = _fwd_bwd(block, inputs)
    torch.testing.assert_close(out_c, out_e)
    for g_c, g_e in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(g_c, g_e)


@pytest.mark.parametrize("compile_path", ["chain", "custom_op"])
def test_compile_cpu_no_graph_break(monkeypatch, compile_path):
    _check(torch.device("cpu"), "aot_eager", monkeypatch, compile_path)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_path", ["chain", "custom_op"])
def test_compile_gpu_inductor(monkeypatch, compile_path):
    _check(torch.device("cuda"), "inductor", monkeypatch, compile_path)


def _small_sizes(monkeypatch):
    """Undo kernels_everywhere: the default size dispatch, where these tensors are small."""
    from opadvisor.kernels import softmax

    monkeypatch.setattr(softmax, "SMALL_NUMEL", 1 << 22)
    monkeypatch.setattr(dropout_add, "SMALL_NUMEL", 1 << 25)


def test_compile_never_asks_whether_a_graph_is_captured(monkeypatch):
    """Small tensors on the kernels' backend: eager code asks whether a CUDA graph is being captured (the
    kernels run inside one at every size); traced code must not, or dynamo breaks the graph at each call.
    Here the question itself breaks the graph, so one break would show."""
    from opadvisor.kernels import _backend

    _small_sizes(monkeypatch)
    monkeypatch.setattr(_backend, "backend", lambda device: _backend.TRITON)
    asked = []

    def capturing():
        asked.append(torch.compiler.is_compiling())
        torch._dynamo.graph_break()
        return False

    monkeypatch.setattr(_backend, "cuda_graph_capturing", capturing)
    inputs = _inputs(torch.device("cpu"))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_block_bda_no_dropout)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert True not in asked
    assert _backend.for_tensor(inputs[2], 1 << 25) == _backend.EAGER and asked == [False]


@pytest.mark.gpu
def test_compile_gpu_small_tensors_one_graph(monkeypatch):
    """The sizes a BERT-base step feeds bias_dropout_add (under SMALL_NUMEL): one graph under torch.compile."""
    _small_sizes(monkeypatch)
    inputs = _inputs(torch.device("cuda"))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_block_bda_no_dropout)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
