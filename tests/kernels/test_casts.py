"""autocast_shared: one 16-bit copy for the linear layers that read one float32 activation under autocast,
with the values, gradients and dtypes of eager autocast (each layer casting for itself), bit for bit."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import autocast_shared


def _run(shared: bool, autocast: bool = True):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 96) for _ in range(3)]
    source = torch.randn(8, 64, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = source * 1.0  # an activation, as a norm's output: not a leaf
            inputs = autocast_shared(hidden, 3) if shared else (hidden,) * 3
            outputs = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
            loss = sum((o.float() ** 2).sum() for o in outputs)
    loss.backward()
    grads = [source.grad, *(p.grad for layer in layers for p in layer.parameters())]
    return outputs, grads, saved


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no-autocast"])
def test_same_values_and_gradients_as_each_layer_casting(autocast: bool) -> None:
    (before, before_grads, _), (after, after_grads, _) = _run(False, autocast), _run(True, autocast)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before_grads, after_grads, strict=True)
    )
    assert after_grads[0].dtype == torch.float32  # the gradient reaches the float32 activation as float32


def test_one_copy_kept_for_backward_instead_of_three() -> None:
    _, _, before = _run(False)
    _, _, after = _run(True)
    copy = 8 * 64 * 2  # one bfloat16 copy of the [8, 64] activation
    assert sum(before.values()) - sum(after.values()) == 2 * copy


def test_outside_autocast_or_for_16_bit_inputs_the_tensor_itself() -> None:
    x = torch.randn(4, 8)
    assert all(t is x for t in autocast_shared(x, 2))
    half = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(t is half for t in autocast_shared(half, 3))
        copies = autocast_shared(x, 2)  # no gradient needed: one plain copy
    assert copies[0] is copies[1] and copies[0].dtype == torch.bfloat16 and torch.equal(copies[0], half)


def test_traced_whole_by_torch_compile() -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 24) for _ in range(2))

    def step(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inputs = autocast_shared(h * 1.0, 2)
            return sum((layer(x).float() ** 2).sum() for layer, x in zip(layers, inputs, strict=True))

    h = torch.randn(4, 16, requires_grad=True)
    eager = step(h)
    eager.backward()
    expected, h.grad = h.grad.clone(), None
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(h)
    compiled.backward()
    assert torch.equal(compiled, eager) and torch.equal(h.grad, expected)
