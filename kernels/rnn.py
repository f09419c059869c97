"""A recurrent cell run over a whole sequence in one fused call: ``cell_sequence(cell, inputs, state)``.

A loop such as

    for t in range(x.size(0)):
        h, c = cell(x[t], (h, c))
        outputs.append(h)

launches the cell's kernels once per time step, forward and backward. ``cell_sequence(cell, x, (h, c))``
computes the same recurrence with the cell's own parameters through the op ``nn.LSTM`` itself calls
(``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh`` / ``torch.rnn_relu``: cuDNN's fused recurrence on CUDA, a
fused loop in C++ on the CPU), one call for the whole sequence. The cell module is not replaced, so its
parameters keep their names and a saved ``state_dict`` loads as before.

Returns ``(outputs, state)``: ``outputs`` holds the hidden state after every step, with time along
``time_dim`` (``outputs[t]`` for ``time_dim=0`` is what the loop's ``h`` was after step ``t``), and ``state``
is the final state in the cell's own form (``(h, c)`` for ``nn.LSTMCell``, ``h`` otherwise).

Precision on CUDA: the loop ran the cell's matrix products through cuBLAS, in TF32 only where
``torch.backends.cuda.matmul.allow_tf32`` is set (off by default); cuDNN's recurrence follows
``torch.backends.cudnn.allow_tf32`` (on by default). The call runs cuDNN with the matmul setting, forward
and backward (its backward node sets it when autograd runs it), so the fused recurrence computes at the
precision of the loop it replaces.

On CUDA the cell's four weight tensors are not one packed buffer, so each call packs them for cuDNN (one
copy of the weights, far less than the sequence's work); cuDNN's warning about it ("RNN module weights are
not part of single contiguous chunk of memory") is silenced for this call only: it is expected here.

Under torch.compile the call traces into the caller's graph without a break (tests/kernels/
test_kernels_fullgraph.py): the compiled code runs torch's decomposition of the op (the recurrence as matrix
products, which follow the matmul TF32 setting as the loop did), so neither the warning filter nor the cuDNN
flag is set there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import _dispatch

OP = "cell_sequence"  # its name in the dispatch record: every call runs the fused layer op ("kernel")
_PACKING_WARNING = "RNN module weights are not part of single contiguous chunk of memory"


def _parameters(cell: nn.RNNCellBase) -> list[Tensor]:
    params = [cell.weight_ih, cell.weight_hh]
    if cell.bias:
        params += [cell.bias_ih, cell.bias_hh]
    return params


def _zeros(inputs: Tensor, batch: int | None, hidden: int) -> Tensor:
    shape = (hidden,) if batch is None else (batch, hidden)
    return torch.zeros(shape, dtype=inputs.dtype, device=inputs.device)


def _layer_state(state: Tensor) -> Tensor:
    """A cell's [batch, hidden] state as a one-layer RNN's [1, batch, hidden] (contiguous, as cuDNN wants)."""
    return state.unsqueeze(0).contiguous()


def cell_sequence(
    cell: nn.RNNCellBase, inputs: Tensor, state: Any = None, *, time_dim: int = 0
) -> tuple[Tensor, Any]:
    """Run `cell` (nn.LSTMCell, nn.GRUCell or nn.RNNCell) over `inputs` in one fused call (module doc)."""
    op = _fused_op(cell)
    if time_dim not in (0, 1):
        raise ValueError(f"time_dim must be 0 or 1, got {time_dim}")
    batched = inputs.dim() == 3
    if not batched:
        if inputs.dim() != 2 or time_dim != 0:
            raise ValueError(
                "inputs must be [time, batch, features], [batch, time, features] or [time, features]"
            )
        inputs = inputs.unsqueeze(1)
    batch = inputs.size(1 - time_dim)
    lstm = isinstance(cell, nn.LSTMCell)
    if state is None:
        zeros = _zeros(inputs, batch, cell.hidden_size)
        state = (zeros, zeros) if lstm else zeros
    elif not batched:
        state = tuple(s.unsqueeze(0) for s in state) if lstm else state.unsqueeze(0)
    args = (_parameters(cell), cell.bias, 1, 0.0, torch.is_grad_enabled(), False, time_dim == 1)
    _dispatch.record(OP, _dispatch.KERNEL)
    if torch.compiler.is_compiling():
        # Traced: no warning filter or cuDNN flag to set (dynamo breaks the graph at both). The compiled graph
        # runs torch's decomposition of the op (the recurrence as matrix products, as the loop ran them).
        outputs, final = _run(op, lstm, inputs, state, args)
    else:
        with warnings.catch_warnings(), _loop_precision(inputs.is_cuda, _loop_tf32()):
            warnings.filterwarnings("ignore", message=_PACKING_WARNING)
            outputs, final = _run(op, lstm, inputs, state, args)
        _backward_at_loop_precision(outputs)
    if not batched:
        outputs = outputs.squeeze(1)
        final = tuple(s.squeeze(0) for s in final) if lstm else final.squeeze(0)
    return outputs, final


def _run(op: Any, lstm: bool, inputs: Tensor, state: Any, args: tuple) -> tuple[Tensor, Any]:
    """(outputs, final state in the cell's form, batched) of the fused layer op."""
    if lstm:
        outputs, h, c = op(inputs, (_layer_state(state[0]), _layer_state(state[1])), *args)
        return outputs, (h[0], c[0])
    outputs, h = op(inputs, _layer_state(state), *args)
    return outputs, h[0]


def _loop_tf32() -> bool:
    """Whether the loop's cuBLAS matrix products ran in TF32 (see the module doc)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


@contextlib.contextmanager
def _loop_precision(on_cuda: bool, want: bool) -> Iterator[None]:
    """cuDNN's TF32 flag set to `want` (the loop's, `_loop_tf32()`) while inside; a no-op off CUDA."""
    cudnn = torch.backends.cudnn
    if not on_cuda or cudnn.allow_tf32 == want:
        yield
        return
    try:
        cudnn.allow_tf32 = want
    except RuntimeError:  # flags frozen by the caller: its setting stands
        yield
        return
    try:
        yield
    finally:
        cudnn.allow_tf32 = not want


def _backward_at_loop_precision(outputs: Tensor) -> None:
    """cuDNN's recurrence backward reads the TF32 flag when it runs (in `loss.backward()`, long after this
    call returned), so its autograd node sets the loop's precision for itself too (measured on the H200:
    with TF32 in the backward only, the gradients differed from the loop's by 1.7% relative)."""
    want = _loop_tf32()  # as the forward ran, whatever the flag is when the backward runs
    if not outputs.is_cuda or outputs.grad_fn is None or torch.backends.cudnn.allow_tf32 == want:
        return
    node = _cudnn_node(outputs.grad_fn)
    if node is None:
        return
    inside: list[contextlib.ExitStack] = []

    def enter(_grad_outputs: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(_loop_precision(True, want))
        inside.append(stack)

    def leave(_grad_inputs: Any, _grad_outputs: Any) -> None:
        if inside:
            inside.pop().close()

    node.register_prehook(enter)
    node.register_hook(leave)


def _cudnn_node(node: Any, depth: int = 4) -> Any:
    """The cuDNN recurrence's backward node under `node` (the op's outputs pass through a view or two)."""
    if node is None or depth < 0:
        return None
    if "CudnnRnn" in type(node).__name__ or "CudnnRnn" in node.name():
        return node
    for parent, _ in node.next_functions:
        found = _cudnn_node(parent, depth - 1)
        if found is not None:
            return found
    return None


def _fused_op(cell: nn.RNNCellBase) -> Any:
    """The op nn.LSTM / nn.GRU / nn.RNN run for a cell of this kind."""
    if isinstance(cell, nn.LSTMCell):
        return torch.lstm
    if isinstance(cell, nn.GRUCell):
        return torch.gru
    if isinstance(cell, nn.RNNCell):
        return torch.rnn_tanh if cell.nonlinearity == "tanh" else torch.rnn_relu
    raise TypeError(f"cell_sequence takes nn.LSTMCell, nn.GRUCell or nn.RNNCell, not {type(cell).__name__}")
