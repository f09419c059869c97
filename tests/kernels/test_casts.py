"""autocast_shared: one 16-bit copy for the linear layers that read one float32 activation under autocast,
with the values, gradients and dtypes of eager autocast (each layer casting for itself), bit for bit.
autocast_linear: F.linear under autocast, its weight's gradient written in float32 by the product on CUDA
(casts.WEIGHT_GRAD_F32), eager's computation elsewhere."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import autocast_linear, autocast_shared, casts


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


def _linear_grads(fn, x, weight, bias, device):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    bias = None if bias is None else bias.detach().clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        out = fn(x, weight, bias)
    (out.float() ** 2).sum().backward()
    return out, x.grad, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("shape", [(16, 32), (2, 8, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_autocast_linear_on_the_cpu_is_eagers_linear_bit_for_bit(shape, with_bias, monkeypatch) -> None:
    monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", True)
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=g), torch.randn(24, 32, generator=g)
    bias = torch.randn(24, generator=g) if with_bias else None
    got = _linear_grads(autocast_linear, x, weight, bias, "cpu")
    want = _linear_grads(torch.nn.functional.linear, x, weight, bias, "cpu")
    assert got[0].grad_fn.name() == "_AutocastLinearBackward"  # its own Function ran
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_autocast_linear_is_f_linear_where_the_switch_or_autocast_is_off(monkeypatch) -> None:
    x, weight = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_linear(x, weight).grad_fn.name() != "_AutocastLinearBackward"
    monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", True)
    assert torch.equal(autocast_linear(x, weight), torch.nn.functional.linear(x, weight))  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert autocast_linear(x, weight).grad_fn is None


@pytest.mark.gpu
def test_autocast_linear_on_cuda_writes_the_weight_gradient_in_float32(monkeypatch) -> None:
    """The output and the input's gradient are eager's; the weight's gradient is the product's float32 sum
    (close to eager's, which is that sum rounded to bf16, but not always equal to it), also compiled."""
    monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", True)
    g = torch.Generator(device="cuda").manual_seed(0)
    x, weight = (
        torch.randn(4, 256, 512, device="cuda", generator=g),
        torch.randn(384, 512, device="cuda", generator=g),
    )
    want = _linear_grads(torch.nn.functional.linear, x, weight, None, "cuda")
    for fn in (autocast_linear, torch.compile(autocast_linear)):
        out, dx, dw, _ = _linear_grads(fn, x, weight, None, "cuda")
        assert torch.equal(out, want[0]) and torch.equal(dx, want[1])
        torch.testing.assert_close(dw, want[2], rtol=1e-2, atol=1e-2)
        assert not torch.equal(dw, dw.bfloat16().float())  # not rounded to bf16 first
