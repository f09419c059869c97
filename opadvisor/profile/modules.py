"""Module calls inside the recorded window: where each module was called from, how often, with what.

The session's global forward pre hook calls `ModuleCalls.on_call` for every module forward inside the
window. The first call of a module records its call site (the frame that called it, when that frame is
user code; else the innermost user frame, with `caller` saying where the call really came from), the
bytes of its tensor arguments, and facts of its class that the rules check the source against:

- recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`), on every call: whether the weights form the single
  contiguous buffer cuDNN's fused path wants (the test cuDNN's `try_get_weight_buf` makes: every weight in
  one storage, each starting where the previous one ends; else every call compacts them and warns
  "RNN module weights are not part of single contiguous chunk of memory"), the weight and input dtypes,
  autocast, the device, and torch.backends.cudnn's `enabled` and `allow_tf32`;
- recurrent cells (`nn.LSTMCell`, `nn.GRUCell`, `nn.RNNCell`): sizes, bias, nonlinearity, the shape of the
  first input and whether a state was passed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from opadvisor.profile.model import ModuleCall
from opadvisor.profile.userframes import opadvisor_dirs, resolve_user_file

RNN_LAYERS = ("LSTM", "GRU", "RNN")
RNN_CELLS = ("LSTMCell", "GRUCell", "RNNCell")


class ModuleCalls:
    def __init__(self) -> None:
        self.records: dict[int, ModuleCall] = {}
        self._machinery: tuple[str, tuple[str, ...]] | None = None

    def on_call(self, module: Any, path: str, cls: str, args: tuple) -> None:
        record = self.records.get(id(module))
        if record is None:
            record = self._first_call(module, path, cls, args)
            self.records[id(module)] = record
        record.calls += 1
        if type(module).__name__ in RNN_LAYERS and _is_torch_rnn(module):
            _update_rnn_facts(record.attrs, module, args)

    def _first_call(self, module: Any, path: str, cls: str, args: tuple) -> ModuleCall:
        record = ModuleCall(module=path, module_class=cls, calls=0, input_bytes=_tensor_bytes(args))
        site = self._call_site()
        if site is not None:
            record.file, record.line, record.function, caller = site
            if caller is not None:
                record.attrs["caller"] = caller
        if type(module).__name__ in RNN_CELLS and _is_torch_rnn(module):
            record.attrs.update(_cell_facts(module, args))
        return record

    def _call_site(self) -> tuple[str, int, str, str | None] | None:
        """(file, line, function, caller): the frame that called the module when it is user code (caller
        None); else the innermost user frame, and `caller` the frame that made the call ("file:line": a
        library's, or torch's own such as nn.Sequential's)."""
        if self._machinery is None:
            import torch.nn.modules.module as module_py

            self._machinery = (str(Path(module_py.__file__).resolve()), opadvisor_dirs())
        call_py, ours = self._machinery
        frame = sys._getframe(2)
        caller: str | None = None
        direct = True
        while frame is not None:
            name = frame.f_code.co_filename
            user = resolve_user_file(name)
            if user is not None:
                return user, frame.f_lineno, frame.f_code.co_name, None if direct else caller
            if not _is(name, call_py) and not any(_under(name, own) for own in ours):
                if direct:
                    caller = f"{name}:{frame.f_lineno}"
                direct = False
            frame = frame.f_back
        return None

    def results(self) -> list[ModuleCall]:
        return sorted(self.records.values(), key=lambda r: (r.module, r.module_class))


def _resolved(file_name: str) -> str:
    try:
        return str(Path(file_name).resolve())
    except OSError:
        return file_name


def _is(file_name: str, path: str) -> bool:
    return _resolved(file_name) == path


def _under(file_name: str, root: str) -> bool:
    return _resolved(file_name).startswith(root.rstrip(os.sep) + os.sep)


def _is_torch_rnn(module: Any) -> bool:
    return type(module).__module__.startswith("torch.nn.modules.rnn")


def _tensor_bytes(args: Any) -> int:
    """Bytes of the distinct storages among the tensors in `args` (nested tuples, lists and dicts)."""
    import torch

    seen: dict[int, int] = {}
    stack = [args]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            try:
                storage = item.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return sum(seen.values())


def _dtype(tensor: Any) -> str | None:
    dtype = getattr(tensor, "dtype", None)
    return None if dtype is None else str(dtype).replace("torch.", "")


def weights_flat(weights: list[Any]) -> bool:
    """Whether the weights form one contiguous buffer, in order (what cuDNN's fused path needs)."""
    if not weights:
        return False
    try:
        storage = weights[0].untyped_storage().data_ptr()
        end = None
        for w in weights:
            if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage:
                return False
            if end is not None and w.data_ptr() != end:
                return False
            end = w.data_ptr() + w.numel() * w.element_size()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _update_rnn_facts(attrs: dict[str, Any], module: Any, args: tuple) -> None:
    import torch

    weights = list(getattr(module, "_flat_weights", []) or [])
    x = args[0] if args else None
    if isinstance(x, torch.nn.utils.rnn.PackedSequence):
        x = x.data
    device = weights[0].device.type if weights else None
    attrs.setdefault("calls_not_flat", 0)
    if not weights_flat(weights):
        attrs["calls_not_flat"] += 1
    attrs.update(
        kind=type(module).__name__,
        input_size=module.input_size,
        hidden_size=module.hidden_size,
        num_layers=module.num_layers,
        bidirectional=module.bidirectional,
        batch_first=module.batch_first,
        proj_size=getattr(module, "proj_size", 0),
        weight_dtype=_dtype(weights[0]) if weights else None,
        input_dtype=_dtype(x),
        input_shape=list(x.shape) if isinstance(x, torch.Tensor) else None,
        device=device,
        autocast=_autocast_dtype(device),
        cudnn_enabled=bool(torch.backends.cudnn.enabled),
        cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
    )


def _autocast_dtype(device: str | None) -> str | None:
    import torch

    if device is None:
        return None
    try:
        if not torch.is_autocast_enabled(device):
            return None
        return _dtype(torch.get_autocast_dtype(device))
    except (TypeError, RuntimeError, AttributeError):  # a device type autocast does not know
        return None


def _cell_facts(module: Any, args: tuple) -> dict[str, Any]:
    import torch

    x = args[0] if args else None
    facts: dict[str, Any] = {
        "kind": type(module).__name__,
        "input_size": module.input_size,
        "hidden_size": module.hidden_size,
        "bias": module.bias,
        "input_shape": list(x.shape) if isinstance(x, torch.Tensor) else None,
        "input_dtype": _dtype(x),
        "weight_dtype": _dtype(module.weight_ih),
        "state_given": len(args) > 1 and args[1] is not None,
    }
    if hasattr(module, "nonlinearity"):
        facts["nonlinearity"] = module.nonlinearity
    return facts
