"""opadvisor.kernels.cell_sequence: the same values and gradients as stepping the cell in a Python loop."""

from __future__ import annotations

import pytest
import torch
from opadvisor.kernels import cell_sequence
from torch import nn

CELLS = {
    "lstm": lambda: nn.LSTMCell(5, 7),
    "lstm_nobias": lambda: nn.LSTMCell(5, 7, bias=False),
    "gru": lambda: nn.GRUCell(5, 7),
    "rnn_tanh": lambda: nn.RNNCell(5, 7),
    "rnn_relu": lambda: nn.RNNCell(5, 7, nonlinearity="relu"),
}


def _loop(cell, x, state, time_dim):
    outputs = []
    for t in range(x.size(time_dim)):
        x_t = x[t] if time_dim == 0 else x[:, t]
        state = cell(x_t, state)
        outputs.append(state[0] if isinstance(state, tuple) else state)
    return torch.stack(outputs, dim=time_dim), state


def _state(cell, batch, device, given, dtype=torch.float32):
    if not given:
        return None
    shape = (batch, 7) if batch is not None else (7,)
    h = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    if isinstance(cell, nn.LSTMCell):
        return (h, torch.randn(shape, device=device, dtype=dtype, requires_grad=True))
    return h


def _flat(state):
    return list(state) if isinstance(state, tuple) else [state]


def _tensors(kind, time_dim, batched, given, device, dtype, fused: bool) -> list[torch.Tensor]:
    """outputs, final state and gradients (inputs, parameters, given state) of one run, same seed."""
    torch.manual_seed(0)
    cell = CELLS[kind]().to(device, dtype)
    shape = [6, 3, 5] if time_dim == 0 else [3, 6, 5]
    if not batched:
        shape = [6, 5]
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    state = _state(cell, 3 if batched else None, device, given, dtype)
    if fused:
        out, final = cell_sequence(cell, x, state, time_dim=time_dim)
    else:
        out, final = _loop(cell, x, state, time_dim)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    loss = (out * weights).sum() + sum(s.sum() * 0.5 for s in _flat(final))
    loss.backward()
    grads = [x.grad] + [p.grad for p in cell.parameters()]
    grads += [s.grad for s in _flat(state)] if state is not None else []
    return [out.detach(), *(s.detach() for s in _flat(final)), *grads]


def _compare(kind: str, time_dim: int, batched: bool, given: bool, device: str, rtol: float, atol: float):
    loop = _tensors(kind, time_dim, batched, given, device, torch.float32, fused=False)
    fused = _tensors(kind, time_dim, batched, given, device, torch.float32, fused=True)
    for a, b in zip(loop, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("time_dim", [0, 1])
@pytest.mark.parametrize("given", [True, False], ids=["state", "zeros"])
def test_same_values_and_gradients_as_the_loop(kind: str, time_dim: int, given: bool):
    _compare(kind, time_dim, True, given, "cpu", 1e-5, 1e-6)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unbatched_inputs(kind: str):
    _compare(kind, 0, False, True, "cpu", 1e-5, 1e-6)


def test_state_dict_is_the_cells():
    cell = nn.LSTMCell(5, 7)
    before = {k: v.clone() for k, v in cell.state_dict().items()}
    cell_sequence(cell, torch.randn(4, 2, 5))
    assert list(cell.state_dict()) == ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    assert all(torch.equal(cell.state_dict()[k], v) for k, v in before.items())


def test_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="nn.LSTMCell, nn.GRUCell or nn.RNNCell"):
        cell_sequence(nn.Linear(5, 7), torch.randn(4, 2, 5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="time_dim"):
        cell_sequence(nn.GRUCell(5, 7), torch.randn(4, 2, 5), time_dim=2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("time_dim", [0, 1])
def test_same_on_cuda(kind: str, time_dim: int, recwarn):
    """cuDNN's fused recurrence is as close to the float64 result as the loop of cells is (cudnn.allow_tf32
    is on by default; cell_sequence follows the matmul setting, off by default, as the loop's GEMMs do, in
    the forward and in the backward). Two float32 algorithms round differently, so the two are compared
    through the float64 truth, not with each other; TF32 anywhere is ~1000x further off."""
    assert torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    truth = _tensors(kind, time_dim, True, True, "cuda", torch.float64, fused=False)
    loop = _tensors(kind, time_dim, True, True, "cuda", torch.float32, fused=False)
    fused = _tensors(kind, time_dim, True, True, "cuda", torch.float32, fused=True)
    for i, (t, a, b) in enumerate(zip(truth, loop, fused, strict=True)):
        scale = t.abs().max().item() or 1.0
        loop_err = (a.double() - t).abs().max().item() / scale
        fused_err = (b.double() - t).abs().max().item() / scale
        assert fused_err <= 10 * max(loop_err, 1e-6), (
            f"tensor {i}: fused {fused_err:.2e}, loop {loop_err:.2e}"
        )
    assert not [w for w in recwarn if "contiguous chunk" in str(w.message)]


def test_each_call_is_recorded_as_the_fused_op() -> None:
    """verify reads the dispatch record to see that rnn_cell_loop's rewrite ran."""
    from opadvisor.kernels import dispatch_counts, reset_dispatch_counts

    reset_dispatch_counts()
    cell_sequence(nn.GRUCell(5, 7), torch.randn(3, 2, 5))
    assert dispatch_counts() == {"cell_sequence": {"kernel": 1}}
