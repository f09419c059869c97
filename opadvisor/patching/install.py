"""One instance patched and put back: `_install` sets the forward on the instance (never on its class),
`_call` runs the first-call check before the replacement's first use on each call path (`_call_path`) and
falls back to the original where the check fails, `_restore` puts back exactly what was there."""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import torch
import torch.nn as nn

import opadvisor.kernels as kernels

from .check import _first_call_check
from .report import PatchReport
from .shared import STATE, _Patcher, _State


class _Missing:
    """No instance-level forward before the patch. One object, also in a deep copy of a patched model
    (`_restore` tests it by identity: a copied sentinel would be put back as the forward)."""

    def __copy__(self) -> _Missing:
        return self

    def __deepcopy__(self, memo: dict) -> _Missing:
        return self

    def __reduce__(self) -> str:
        return "_MISSING"


_MISSING = _Missing()


def _install(module: nn.Module, path: str, patcher: _Patcher, check: bool, report: PatchReport) -> None:
    state = _State(patcher.fix.name, path, module.__dict__.get("forward", _MISSING), module.forward, report)
    state.status = "pending" if check else "ok"
    if patcher.undo is not None:
        state.undo = functools.partial(patcher.undo, module)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # the state is read from the instance, not closed over: a deep copy of the model (an EMA or teacher
        # copy) has its own state, whose original forward is bound to the copy
        state = self.__dict__.get(STATE)
        if state is None:  # put back (a failed check, unpatch) after this forward was bound: what runs now
            return self.forward(*args, **kwargs)
        return _call(self, state, patcher, args, kwargs)

    module.__dict__[STATE] = state
    module.forward = types.MethodType(forward, module)


def _restore(module: nn.Module) -> None:
    state: _State = module.__dict__.pop(STATE)
    if state.prev is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = state.prev
    for name, value in state.attrs.items():
        setattr(module, name, value)
    if state.undo is not None:
        state.undo()


def _call(module: nn.Module, state: _State, patcher: _Patcher, args: tuple, kwargs: dict) -> Any:
    if state.status == "checking":
        # called again while its own first-call check runs: a checkpointed layer recomputing its forward
        # for the check's backward (torch.utils.checkpoint, transformers' gradient checkpointing)
        return state.original(*args, **kwargs)
    if state.status == "pending":
        path = _call_path(module, args, kwargs)
        if path not in state.checked:
            if torch.compiler.is_compiling() or kernels.cuda_graph_capturing():
                return state.original(*args, **kwargs)  # the check runs eagerly, at a later call
            state.status = "checking"
            try:
                problem = _first_call_check(module, state, patcher, args, kwargs)
            finally:
                state.status = "pending"
            if problem is not None:
                return _fall_back(module, state, problem, args, kwargs)
            state.checked[path] = True
    return patcher.forward(module, state, *args, **kwargs)


def _call_path(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What decides the path a replacement takes: training or evaluation, gradients on or off, which
    arguments are given (an LM head fuses its loss only in training with labels). The first-call check runs
    at the first call of each path: an evaluation before training (Lightning's sanity check, an
    `evaluate()` first) checks the evaluation's path, and the first training step checks its own."""
    given = tuple(sorted(name for name, value in kwargs.items() if value is not None))
    return module.training, torch.is_grad_enabled(), tuple(a is None for a in args), given


def _fall_back(module: nn.Module, state: _State, problem: str, args: tuple, kwargs: dict) -> Any:
    """The original forward from now on, said once; this call's output from it."""
    warnings.warn(
        f"opadvisor.patch: {state.path or '<model>'} ({type(module).__name__}) keeps its original forward: "
        f"the {state.fix} replacement {problem}",
        RuntimeWarning,
        stacklevel=4,
    )
    state.status = "failed"
    _restore(module)
    _report_left(state, f"fell back at its first call: {problem}")
    return state.original(*args, **kwargs)


def _report_left(state: _State, reason: str) -> None:
    """Move a module that went back to its original forward from the report's `patched` to `left`."""
    if state.report is None:
        return
    entry = next((e for e in state.report.patched if e[0] == state.path and e[2] == state.fix), None)
    if entry is not None:
        state.report.patched.remove(entry)
        state.report.left.append((entry[0], entry[1], reason))
