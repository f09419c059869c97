"""A recurrent cell (nn.LSTMCell, nn.GRUCell, nn.RNNCell) stepped over time in a Python loop.

What it finds
    An `nn.LSTMCell`, `nn.GRUCell` or `nn.RNNCell` called many times per training step from one line
    inside a `for` or `while` loop of the user's code: the recurrence written as one cell call per time
    step. The profile records every module call (how often, from which line) and the ops each call ran,
    so this is found on a CPU profile too. The finding gives the calls per step, the ops (kernels on a
    GPU) each time step costs, and the time of the whole recurrence, forward and backward.

Why it is slow
    Each time step is a separate call: two matrix products, the gate activations and the state update as
    separate kernels, each launched from Python, and as many again in backward. At a small batch the GPU
    waits on those launches. One call over the whole sequence (what `nn.LSTM` runs: cuDNN's fused
    recurrence on CUDA, which multiplies the input projections of all time steps in one GEMM) does the
    same arithmetic in a handful of launches. hfai measured 125 ms for a forward and backward of
    `nn.LSTM` at input 985, hidden 985, batch 4, sequence 1000, and a loop of cells is slower still.

Example
    for t in range(x.size(0)):
        h, c = self.cell(x[t], (h, c))
        outputs.append(h)

Fix and its safety
    `opadvisor apply --rule rnn_cell_loop` replaces the loop by one call of
    `opadvisor.kernels.cell_sequence(self.cell, x, (h, c))`, which runs the cell's own parameters through
    the fused LSTM / GRU / RNN op that `nn.LSTM` calls (`torch.lstm`: cuDNN on CUDA), and returns every
    step's hidden state and the final state; the list the loop filled is extended with the same tensors.
    The cell module stays: its parameters keep their names (`weight_ih`, `weight_hh`, `bias_ih`,
    `bias_hh`), so saved state_dicts load as before (an `nn.LSTM` in its place would name them
    `weight_ih_l0`, ...). Safe: the same function up to floating-point rounding. Rewritten only where the
    loop does nothing else per step (the cell call, and appending the hidden state to a list), runs over the
    whole of one input (`range(x.size(0))`, `range(len(x))`, `for x_t in x`, or a name bound from
    `x.size()`/`x.shape`), time along dimension 0 or 1, and the state is carried from one step to the
    next; any other loop is left alone with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from opadvisor.profile.model import ModuleCall, Profile
from opadvisor.rules._findings import cost_words, fmt_ms
from opadvisor.rules._index import ProfileIndex, index_of
from opadvisor.rules._source import load_profiled_source
from opadvisor.rules.facts import Facts
from opadvisor.rules.finding import Evidence, Finding

ID = "rnn_cell_loop"
TITLE = "Recurrent cell stepped in a Python loop"
FIX = "safe"

CELLS = ("LSTMCell", "GRUCell", "RNNCell")
MIN_CALLS_PER_STEP = 4  # fewer time steps leave little to fuse
FUSED_LAYER = {"LSTMCell": "nn.LSTM", "GRUCell": "nn.GRU", "RNNCell": "nn.RNN"}


@dataclass
class CellLoopFacts(Facts):
    """The cell the profile saw stepped in the loop (the finding's `details`; the codemod checks the
    loop's cell against `module` and the state's form against `kind`)."""

    RULES = ("rnn_cell_loop",)

    kind: str = ""  # "LSTMCell", "GRUCell" or "RNNCell"
    module: str = ""  # its path in the model; the call names its last part (`self.cell`)
    call_line: int | None = None
    calls_per_step: float = 0.0  # the time steps
    input_size: int | None = None
    hidden_size: int | None = None
    bias: bool | None = None
    nonlinearity: str | None = None  # RNNCell: "tanh" or "relu"
    input_shape: list[int] | None = None  # one time step's input
    state_given: bool | None = None  # whether the first call passed a state


def detect(profile: Profile) -> list[Finding]:
    ix = index_of(profile)
    findings = []
    for call in profile.module_calls:
        kind = call.attrs.get("kind")
        if kind not in CELLS or not call.file or not call.line or call.attrs.get("caller"):
            continue
        per_step = call.calls / ix.steps_recorded
        if per_step < MIN_CALLS_PER_STEP:
            continue
        src = load_profiled_source(profile, call.file)
        loop = src.enclosing_loop(call.line) if src is not None else None
        if src is not None and loop is None:
            continue  # called many times, but not from a loop around that line (e.g. a recursion)
        findings.append(_finding(profile, call, kind, per_step, loop or (call.line, call.line)))
    return findings


def _finding(
    profile: Profile, call: ModuleCall, kind: str, per_step: float, loop: tuple[int, int]
) -> Finding:
    ix = index_of(profile)
    ops = ix.module_ops(call.module, call.module_class)
    total_us = ix.site_cost_us(ops)
    ms = ix.per_step_ms(total_us) if ops else None
    share = ix.share_of_step(ms)
    if ix.gpu:
        per_call = ix.site_kernels(ops) / max(call.calls, 1)
        unit = f"{per_call:.0f} kernels per time step (forward and backward)"
    else:
        per_call = len(ops) / max(call.calls, 1)
        unit = f"{per_call:.0f} op{'' if round(per_call) == 1 else 's'} per time step in forward"
    attrs = call.attrs
    message = (
        f"nn.{kind} {call.module or '(model)'} stepped {per_step:.0f}x per step in a Python loop: {unit}, "
        f"{cost_words(ix, ms, share)}; one fused call over the sequence ({FUSED_LAYER[kind]}'s op) "
        "runs the recurrence in a few launches"
    )
    notes = _notes(ix, attrs)
    return Finding(
        rule=ID,
        path=call.file or "",
        line=loop[0],
        end_line=loop[1],
        message=message,
        fix="safe",
        function=call.function,
        module=call.module,
        evidence=Evidence(
            ops=sorted({op.name for op in ops}),
            kernel_count=round(ix.site_kernels(ops) / ix.steps_recorded) if ix.gpu else None,
            dtypes=[d for d in (attrs.get("input_dtype"),) if d],
            time_ms_per_step=ms,
            share_of_step=share,
            time_basis=ix.basis if ops else "none",  # type: ignore[arg-type]
            occurrences=max(1, round(per_step)),
            notes=notes,
        ),
        time_ms_per_step=ms,
        est_saving_ms_per_step=None,
        advice=(
            f"replace the loop by `opadvisor.kernels.cell_sequence({call.module or 'cell'}, inputs, state)`: "
            f"{FUSED_LAYER[kind]}'s fused op over the whole sequence, with the cell's own parameters "
            f"(about {fmt_ms(ms)}/step spent in the loop now)"
        ),
        details=_facts(call, kind, per_step).to_details(),
    )


def _notes(ix: ProfileIndex, attrs: dict) -> list[str]:
    notes = [
        f"input {attrs.get('input_shape')} ({attrs.get('input_dtype')}), hidden size {attrs.get('hidden_size')}",
        "the saving is measured by `opadvisor verify` after the rewrite (on a GPU: cuDNN's fused recurrence)",
    ]
    if not ix.gpu:
        notes.append("CPU profile: times are CPU op times; profile on a GPU for kernel times")
    return notes


def _facts(call: ModuleCall, kind: str, per_step: float) -> CellLoopFacts:
    """The cell and its loop as profiled, for the codemod to check the source against."""
    attrs = call.attrs
    return CellLoopFacts(
        kind=kind,
        module=call.module,
        call_line=call.line,
        calls_per_step=per_step,
        input_size=attrs.get("input_size"),
        hidden_size=attrs.get("hidden_size"),
        bias=attrs.get("bias"),
        nonlinearity=attrs.get("nonlinearity"),
        input_shape=attrs.get("input_shape"),
        state_given=attrs.get("state_given"),
    )


__all__ = ["FIX", "ID", "TITLE", "CellLoopFacts", "detect"]
