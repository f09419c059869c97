"""Our own code never breaks a graph (issue 33): every public op a rewritten script may call inside a
torch.compile'd region traces with fullgraph=True, and the compiled function gives the eager values and
gradients.

Each op runs compiled (`aot_eager`: no C++ compile) and eagerly, forward and backward on small CPU tensors,
under each dispatch the kernels have:

- "kernels": the kernels at every size (`kernels_everywhere`), the ops with a COMPILE_PATH tracing their
  custom ops, `PaddedLinear` padding on the CPU: what is traced is the Triton path (run by Triton's
  interpreter, TRITON_INTERPRET=1 from conftest);
- "default": the dispatch as shipped (the interpreter on the CPU, each op's default COMPILE_PATH);
- "eager_chain": a GPU's size dispatch for small tensors (the kernels' backend said to be "triton", as
  test_kernels_compile does): the plain chains;
- "reference": TRITON_INTERPRET unset, the CPU's PyTorch references (kept out of the cases: a CPU run with
  no Triton traces the same PyTorch ops "eager_chain" does, and the suite's time is counted).

Dropout: where compiled and eager code draw from one stream (the custom ops, with a fixed seed) the values are
compared with dropout on; where the compiled code traces F.dropout (torch's stream) and the eager code runs a
kernel (Philox), the values are compared without dropout, and the compiled run with dropout is checked for
being a dropout of those values (kept elements scaled by 1 / (1 - p), the gradient through the same mask).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from opadvisor.kernels import (
    PaddedLinear,
    _backend,
    _dispatch,
    _rng,
    activations,
    bias_dropout_add,
    cell_sequence,
    compile_region,
    cross_entropy,
    disentangled_bias,
    dropout,
    dropout_add,
    linear,
    masked_softmax,
    padded_linear,
    quick_gelu,
    reference_masked_softmax,
    region_state,
    relpos,
)
from opadvisor.kernels import seeded_dropout as dropout_module
from torch import nn

ce_module = importlib.import_module("opadvisor.kernels.cross_entropy")  # the package's name is the function

FIXED_SEED = (7, 8, 9)
P = 0.25
MODES = ["kernels", "default", "eager_chain"]
# The ops whose compiled call is their custom op (opaque to dynamo, the kernels inside), per mode.
CUSTOM_OPS = {
    "kernels": {"masked_softmax", "bias_dropout_add", "cross_entropy", "disentangled_bias"},
    "default": {"masked_softmax"},
    "eager_chain": set(),
    "reference": set(),
}
# What the eager call records in the dispatch record, per mode (ops that do not dispatch: their own path).
EAGER_PATH = {
    "kernels": _dispatch.KERNEL,
    "default": _dispatch.KERNEL,
    "eager_chain": _dispatch.CHAIN,
    "reference": _dispatch.REFERENCE,
}


@dataclass
class Case:
    """One call: `fn(*inputs)` (a tensor); its op's name in the dispatch record (`kernel_op`) and the path
    its eager call records per mode (`paths`, else EAGER_PATH's); the parameters whose gradients count too;
    for dropout ops a check of a compiled run with dropout (`dropout_check`)."""

    fn: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]
    kernel_op: str | None
    params: list[torch.Tensor] = field(default_factory=list)
    dropout_check: Callable[..., None] | None = None
    paths: dict[str, str] | None = None
    region: Any = None  # compile_region's decorated function


def _leaf(*shape, grad=True):
    return torch.randn(*shape, requires_grad=grad)


def _kept(out: torch.Tensor, base: torch.Tensor, p: float) -> None:
    """`out` is a dropout of `base`: each element 0 or base / (1 - p), some of each where base is not 0."""
    live = base != 0
    kept = (out != 0) & live
    torch.testing.assert_close(out[kept], base[kept] * _rng.keep_scale(p))
    assert (out[~live] == 0).all()
    frac = kept.sum().item() / max(live.sum().item(), 1)
    assert 0.4 < frac < 0.95, f"kept {frac:.2f} of the elements with p={p}"


# ---- the ops -------------------------------------------------------------------------------------------


def _masked_softmax(p):
    def fn(x, mask):
        return masked_softmax(x, mask, scale=0.5, zero_masked=True, dropout_p=p)

    def check(inputs, out, grads):
        base = reference_masked_softmax(inputs[0].detach(), inputs[1], scale=0.5, zero_masked=True)
        _kept(out, base, p)

    mask = torch.rand(2, 1, 1, 24) < 0.3
    return Case(fn, [_leaf(2, 2, 6, 24), mask], "masked_softmax", dropout_check=check)


def _masked_softmax_additive(p):
    def fn(x, mask):
        return masked_softmax(x, mask, scale=0.5)

    return Case(fn, [_leaf(2, 2, 6, 24), _leaf(2, 1, 1, 24)], "masked_softmax")


def _bda_check(p, has_bias):
    def check(inputs, out, grads):
        x, bias, residual = inputs if has_bias else (inputs[0], None, inputs[1])
        v = x.detach() if bias is None else x.detach() + bias.detach()
        _kept(out - residual.detach(), v, p)
        # d(out . w)/dx = w where kept, scaled: the same mask as the forward's
        torch.testing.assert_close(
            grads[0], torch.where(out != residual.detach(), _W(out) * _rng.keep_scale(p), 0)
        )

    return check


def _bias_dropout_add(p):
    def fn(x, bias, residual):
        return bias_dropout_add(x, bias, residual, p)

    return Case(
        fn, [_leaf(6, 48), _leaf(48), _leaf(6, 48)], "bias_dropout_add", dropout_check=_bda_check(p, True),
    )  # fmt: skip


def _dropout_add(p):
    def fn(x, residual):
        return bias_dropout_add(x, None, residual, p)

    return Case(
        fn, [_leaf(6, 48), _leaf(6, 48)], "bias_dropout_add", dropout_check=_bda_check(p, False),
    )  # fmt: skip


def _dropout(p):
    def fn(x):
        return dropout(x, p)

    def check(inputs, out, grads):
        _kept(out, inputs[0].detach(), p)
        torch.testing.assert_close(grads[0], torch.where(out != 0, _W(out) * _rng.keep_scale(p), 0))

    return Case(fn, [_leaf(6, 48)], "dropout", dropout_check=check)


def _quick_gelu(p):
    return Case(lambda x: quick_gelu(x), [_leaf(4, 33)], "quick_gelu")


def _disentangled_bias(p):
    def fn(c2p, p2c, ci, pi):
        return disentangled_bias(c2p, p2c, ci, pi, 2.0)

    inputs = [_leaf(2, 5, 6), _leaf(2, 5, 6), torch.randint(0, 6, (1, 5, 5)), torch.randint(0, 6, (1, 5, 5))]
    return Case(fn, inputs, "disentangled_bias")


def _cross_entropy(reduction):
    def build(p):
        target = torch.randint(0, 10, (6,))
        target[2] = -100  # ignored

        def fn(x, t):
            return cross_entropy(x, t, reduction=reduction)

        return Case(fn, [_leaf(6, 10), target], "cross_entropy")

    return build


def _padded_linear(p):
    inputs = [_leaf(3, 10), _leaf(13, 10), _leaf(13)]  # both sizes padded
    return Case(lambda x, w, b: padded_linear(x, w, b), inputs, "padded_linear")


def _padded_linear_module(p):
    layer = PaddedLinear(10, 13)
    paths = {"kernels": _dispatch.KERNEL, "default": _dispatch.REFERENCE}  # default: no padding on the CPU
    return Case(lambda x: layer(x), [_leaf(3, 10)], "padded_linear", list(layer.parameters()), paths=paths)


def _cell_sequence(kind):
    def build(p):
        if kind == "lstm":
            cell = nn.LSTMCell(5, 7)
            state = (_leaf(3, 7), _leaf(3, 7))

            def fn(x, h, c):
                out, (h, c) = cell_sequence(cell, x, (h, c))
                return torch.cat([out.flatten(), h.flatten(), c.flatten()])

            return Case(fn, [_leaf(6, 3, 5), *state], "cell_sequence", list(cell.parameters()), paths=KERNEL)
        cell = nn.GRUCell(5, 7)

        def fn(x):  # no state given, time along dim 1
            out, h = cell_sequence(cell, x, time_dim=1)
            return torch.cat([out.flatten(), h.flatten()])

        return Case(fn, [_leaf(3, 6, 5)], "cell_sequence", list(cell.parameters()), paths=KERNEL)

    return build


def _compile_region(p):
    @compile_region(backend="aot_eager")
    def region(x, y):
        return torch.sin(x) * y + x.exp()

    def fn(x, y):
        return region(x, y).tanh() * 2

    return Case(fn, [_leaf(4, 9), _leaf(4, 9)], None, region=region)


KERNEL = {"kernels": _dispatch.KERNEL, "default": _dispatch.KERNEL}  # cell_sequence: the fused op always

# Ops whose implementation depends on the dispatch: run under every mode.
DISPATCHED = {
    "masked_softmax": _masked_softmax,
    "masked_softmax_additive_mask": _masked_softmax_additive,
    "bias_dropout_add": _bias_dropout_add,
    "dropout_add": _dropout_add,
    "dropout": _dropout,
    "quick_gelu": _quick_gelu,
    "disentangled_bias": _disentangled_bias,
    "cross_entropy": _cross_entropy("mean"),
    "cross_entropy_none": _cross_entropy("none"),
}
# The rest run PyTorch ops whatever the dispatch: under "kernels" and "default" only.
UNDISPATCHED = {
    "padded_linear": _padded_linear,
    "PaddedLinear": _padded_linear_module,
    "cell_sequence_lstm": _cell_sequence("lstm"),
    "cell_sequence_gru": _cell_sequence("gru"),
    "compile_region": _compile_region,
}
CASES = [(m, op) for m in MODES for op in DISPATCHED] + [
    ("default", op)
    for op in UNDISPATCHED  # they run their own path whatever the dispatch
]


def _W(out: torch.Tensor) -> torch.Tensor:
    """The fixed weights of the loss `(out * w).sum()`: every gradient element differs."""
    return torch.linspace(-1.5, 2.0, out.numel()).reshape(out.shape)


def _set_mode(mode: str, monkeypatch, request) -> None:
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    if mode == "kernels":
        request.getfixturevalue("kernels_everywhere")
        for module in (dropout_module, activations, relpos):
            monkeypatch.setattr(module, "SMALL_NUMEL", 0)
        monkeypatch.setattr(dropout_add, "COMPILE_PATH", "custom_op")
        monkeypatch.setattr(ce_module, "COMPILE_PATH", "custom_op")
        monkeypatch.setattr(relpos, "COMPILE_PATH", "custom_op")
        monkeypatch.setattr(linear, "should_pad", lambda x: True)
    elif mode == "eager_chain":
        monkeypatch.setattr(_backend, "backend", lambda device: _backend.TRITON)
    elif mode == "reference":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _fwd_bwd(fn, inputs, params):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    for prm in params:
        prm.grad = None
    out = fn(*inputs)
    (out * _W(out)).sum().backward()
    grads = [t.grad for t in inputs if t.requires_grad] + [prm.grad for prm in params]
    for prm in params:
        prm.grad = None
    return out.detach(), grads, inputs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    _dispatch.reset_dispatch_counts()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode, op", CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_traces_whole_and_matches_eager(mode, op, monkeypatch, request):
    _set_mode(mode, monkeypatch, request)
    builder = DISPATCHED.get(op) or UNDISPATCHED[op]
    torch.manual_seed(0)
    case = builder(P)
    same_stream = case.dropout_check is None or case.kernel_op in CUSTOM_OPS[mode]  # dropout's

    explanation = torch._dynamo.explain(case.fn)(*case.inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    targets = {str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"}
    if case.kernel_op in CUSTOM_OPS[mode]:
        assert any(f"opadvisor.{case.kernel_op}_fwd" in t for t in targets), targets
    if op == "compile_region":  # the outer graph traced through the region, which did not compile itself
        assert any("sin" in t for t in targets), targets
        assert region_state(case.region) == ("pending", None)

    if not same_stream:  # compiled with dropout: a dropout of the values; then both without it
        out, grads, inputs = _fwd_bwd(
            torch.compile(case.fn, backend="aot_eager", fullgraph=True), case.inputs, []
        )
        case.dropout_check(inputs, out, grads)
        torch._dynamo.reset()
        torch.manual_seed(0)
        case = builder(0.0)
    compiled = torch.compile(case.fn, backend="aot_eager", fullgraph=True)
    out_c, grads_c, _ = _fwd_bwd(compiled, case.inputs, case.params)
    _dispatch.reset_dispatch_counts()
    out_e, grads_e, _ = _fwd_bwd(case.fn, case.inputs, case.params)
    if case.kernel_op is not None and (case.kernel_op != "dropout" or same_stream):  # dropout(p=0): x itself
        path = (case.paths or EAGER_PATH)[mode]
        assert _dispatch.dispatch_counts()[case.kernel_op] == {path: 1}
    torch.testing.assert_close(out_c, out_e)
    assert len(grads_c) == len(grads_e)
    for g_c, g_e in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(g_c, g_e)
    if op == "compile_region":  # eagerly the region compiled itself; the outer compile still traces it whole
        assert region_state(case.region) == ("compiled", None)
        torch._dynamo.reset()
        out_c2, _, _ = _fwd_bwd(torch.compile(case.fn, backend="aot_eager", fullgraph=True), case.inputs, [])
        torch.testing.assert_close(out_c2, out_e)
