"""The dispatch record (`dispatch_counts`): which path each fused call took, and the one-time warnings of
fallbacks that are not the documented size dispatch. Under torch.compile both happen while tracing, with no
graph break and no recompilation."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from opadvisor.kernels import (
    PaddedLinear,
    _backend,
    _dispatch,
    bias_dropout_add,
    cross_entropy,
    dispatch_counts,
    masked_softmax,
    padded_linear,
    reset_dispatch_counts,
)


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch):
    """An empty record, and fallback warnings that have not been given yet in this process."""
    reset_dispatch_counts()
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    yield
    reset_dispatch_counts()


def _no_warnings():
    return warnings.catch_warnings(record=True)


def test_kernel_paths_are_counted_per_call(kernels_everywhere):
    x = torch.randn(4, 32)
    for _ in range(2):
        masked_softmax(x)
    bias_dropout_add(x, None, x, 0.0)
    cross_entropy(x, torch.randint(0, 32, (4,)))
    assert dispatch_counts() == {
        "masked_softmax": {"kernel": 2},
        "bias_dropout_add": {"kernel": 1},
        "cross_entropy": {"kernel": 1},
    }
    counts = dispatch_counts()
    counts["masked_softmax"]["kernel"] = 99  # a copy
    assert dispatch_counts()["masked_softmax"] == {"kernel": 2}
    reset_dispatch_counts()
    assert dispatch_counts() == {}


def test_size_dispatch_is_recorded_without_a_warning(monkeypatch):
    """Small CUDA tensors run the chain by design: recorded as "chain", no warning."""
    monkeypatch.setattr(_backend, "backend", lambda device: _backend.TRITON)  # as on a GPU
    monkeypatch.setattr(_backend, "cuda_graph_capturing", lambda: False)
    x = torch.randn(4, 64)
    with _no_warnings() as seen:
        warnings.simplefilter("always")
        masked_softmax(x)
        bias_dropout_add(x, None, x, 0.1)
    assert dispatch_counts() == {"masked_softmax": {"chain": 1}, "bias_dropout_add": {"chain": 1}}
    assert not [w for w in seen if "opadvisor" in str(w.message)]


def test_cpu_reference_is_recorded_without_a_warning(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(4, 64)
    with _no_warnings() as seen:
        warnings.simplefilter("always")
        masked_softmax(x)
        cross_entropy(x, torch.randint(0, 64, (4,)))
        PaddedLinear(64, 10)(x)
    assert dispatch_counts() == {
        "masked_softmax": {"reference": 1},
        "cross_entropy": {"reference": 1},
        "padded_linear": {"reference": 1},
    }
    assert not [w for w in seen if "opadvisor" in str(w.message)]


def test_fallbacks_warn_once_with_the_reason(kernels_everywhere):
    x = torch.randn(4, 64, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"masked_softmax: .*not torch.float64.*reference"):
        masked_softmax(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        masked_softmax(x)  # once
    logits, target = torch.randn(4, 64), torch.randint(0, 64, (4,))
    with pytest.warns(RuntimeWarning, match=r"cross_entropy: label smoothing: F.cross_entropy runs"):
        loss = cross_entropy(logits, target, label_smoothing=0.1)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, label_smoothing=0.1))
    assert dispatch_counts() == {"masked_softmax": {"reference": 2}, "cross_entropy": {"reference": 1}}


def test_which_references_are_fallbacks(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_backend, "HAS_TRITON", False)
    assert "Triton is not installed" in _backend.fallback_reason_for("cuda", torch.float32, 2)
    assert _backend.fallback_reason_for("cpu", torch.float32, 2) is None  # the CPU implementation
    monkeypatch.setattr(_backend, "HAS_TRITON", True)
    assert "not torch.float64" in _backend.fallback_reason_for("cuda", torch.float64, 2)
    assert "0-d" in _backend.fallback_reason_for("cuda", torch.float32, 0)
    assert "mps" in _backend.fallback_reason_for("mps", torch.float32, 2)
    assert _backend.fallback_reason_for("cuda", torch.bfloat16, 2) is None


def test_a_learnable_scale_keeps_its_gradient(kernels_everywhere):
    """masked_softmax with a tensor scale that requires grad runs the reference (so the scale gets its
    gradient) and says so; the kernels would take it as a number."""
    scale = torch.tensor(0.5, requires_grad=True)
    x = torch.randn(2, 16)
    with pytest.warns(RuntimeWarning, match="tensor scale that requires grad"):
        y = masked_softmax(x, scale=scale)
    (y * torch.randn(2, 16)).sum().backward()
    assert scale.grad is not None and scale.grad != 0
    assert dispatch_counts() == {"masked_softmax": {"reference": 1}}


def test_padded_linear_paths():
    w, x = torch.randn(10, 16), torch.randn(3, 16)
    padded_linear(x, w)  # 10 out features: padded to 16
    padded_linear(x, torch.randn(8, 16))  # aligned: F.linear
    assert dispatch_counts() == {"padded_linear": {"kernel": 1, "chain": 1}}


def _block(scores, x, bias, logits, target):
    probs = masked_softmax(scores, scale=0.5)
    return probs.sum() + bias_dropout_add(x, bias, x, 0.0).sum() + cross_entropy(logits, target)


def test_compile_records_once_per_trace_without_breaks(kernels_everywhere):
    """Under torch.compile the record is written while dynamo traces (the compiled code runs no Python):
    once per traced call, one graph, no break, and no recompilation on the next calls (the record must not
    become a guard)."""
    inputs = (
        torch.randn(2, 8),
        torch.randn(4, 8),
        torch.randn(8),
        torch.randn(4, 16),
        torch.tensor([1, 2, 3, 4]),
    )
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_block)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    reset_dispatch_counts()
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(_block, backend=counter, fullgraph=True)
    for _ in range(3):
        compiled(*inputs)
    assert counter.frame_count == 1
    assert dispatch_counts() == {
        "masked_softmax": {"kernel": 1},  # its custom op: the kernels run inside the compiled graph
        "bias_dropout_add": {"chain": 1},  # COMPILE_PATH "chain"
        "cross_entropy": {"chain": 1},  # COMPILE_PATH "native"
    }


def test_compile_warns_while_tracing_without_a_break(kernels_everywhere):
    def f(x):
        return masked_softmax(x).sum()

    x = torch.randn(2, 8, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="not torch.float64"):
        explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
