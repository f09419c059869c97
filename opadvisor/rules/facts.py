"""Facts: what the profile proved about one pattern site, carried from the rule to its fix as plain data.

A fixable rule describes its pattern once, as a dataclass deriving from `Facts` (in the rule's own module,
or beside the chain it shares with another rule, as `opadvisor.rules.attention` does): the op chain in the
order it ran, shapes, dtypes, which operands were Python numbers and which tensors (and whether they
require grad), in-place flags. `detect` fills it from the profile and passes it as the finding's `details`
(`facts.to_details()`: plain JSON, in `opadvisor suggest --format json` under each finding's "details");
the codemod reads it back with `FactsClass.from_details(target.details)` and checks the source against
it, refusing with the reason when they disagree (the source's scale is a tensor expression where the
profile saw a Python number, say). Where a fact is None the profile could not tell, and the codemod falls
back to what the source shows.

    @dataclass
    class MyFacts(Facts):
        lines: dict[str, list[int]] = field(default_factory=dict)
        scale: Operand | None = None

    details = MyFacts(lines=..., scale=operand(op, 1)).to_details()      # in detect()
    facts = MyFacts.from_details(target.details)                          # in the codemod; None: no facts

Keys are stable: a field is added with a default, never renamed; `from_details` ignores keys it does not
know (the engine adds `alternative`), so a profile's findings keep working across versions.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from opadvisor.profile.model import Op

__all__ = ["Facts", "Operand", "TENSOR_KINDS", "operand", "operand_kind"]

F = TypeVar("F", bound="Facts")

# Operand kinds that are tensors (see `Operand.kind`).
TENSOR_KINDS = frozenset({"tensor", "param", "frozen", "buffer"})


@dataclass
class Operand:
    """One input of an op as the profile saw it.

    kind: "number" (a Python number: `x / 8.0`, a fill value), "tensor", "param" (an nn.Parameter that
    requires grad), "frozen" (a parameter that does not), "buffer", or None (the profile cannot tell).
    requires_grad: True/False where the profile can tell (parameters, buffers, numbers), else None.
    value: the number, when the profile recorded it.
    """

    kind: str | None = None
    shape: list[int] | None = None
    dtype: str | None = None
    requires_grad: bool | None = None
    value: float | str | None = None

    @property
    def is_tensor(self) -> bool:
        return self.kind in TENSOR_KINDS

    def words(self) -> str:
        """ "a [2, 1, 1] float32 parameter that requires grad", "a Python number" ..."""
        if self.kind == "number":
            return "a Python number"
        what = {"param": "parameter", "frozen": "parameter", "buffer": "buffer"}.get(
            self.kind or "", "tensor"
        )
        shape = f"{list(self.shape)} " if self.shape is not None else ""
        dtype = f"{self.dtype} " if self.dtype else ""
        grad = {True: " that requires grad", False: ""}.get(self.requires_grad, "")  # type: ignore[arg-type]
        return f"a {shape}{dtype}{what}{grad}"


def operand_kind(op: Op, i: int) -> str | None:
    """What input i of `op` is: "number", "tensor", "param", "frozen", "buffer", or None when unknown."""
    if i < len(op.input_kinds) and op.input_kinds[i] is not None:
        return op.input_kinds[i]
    if i < len(op.input_shapes) and isinstance(op.input_shapes[i], list):
        return "tensor" if op.input_shapes[i] else None  # 0-dim: a tensor or a wrapped Python number
    if i < len(op.scalars) and op.scalars[i] is not None:
        return "number"
    return None


def operand(op: Op, i: int) -> Operand:
    """Input i of `op` as an Operand (see `operand_kind`)."""
    kind = operand_kind(op, i)
    shape = op.input_shapes[i] if i < len(op.input_shapes) else None
    dtype = op.input_dtypes[i] if i < len(op.input_dtypes) else None
    value = op.scalars[i] if i < len(op.scalars) else None
    grad = {"param": True, "frozen": False, "buffer": False, "number": False}.get(kind or "")
    return Operand(
        kind=kind,
        shape=list(shape) if isinstance(shape, list) else None,
        dtype=_norm_dtype(dtype),
        requires_grad=grad,
        value=value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None,
    )


def _norm_dtype(name: str | None) -> str | None:
    from opadvisor.rules._chains import norm_dtype

    return norm_dtype(name)


class Facts:
    """Base of a rule's facts dataclass: JSON round trip through a finding's `details`."""

    def to_details(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_details(cls: type[F], details: Mapping[str, Any] | None) -> F | None:
        """The facts in `details`; None when there are none (static mode) or they do not fit this class."""
        if not details or not isinstance(details, Mapping):
            return None
        try:
            return _build(cls, details)
        except (TypeError, ValueError):
            return None


def _build(cls: type, data: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        target = _dataclass_in(hints.get(f.name))
        if target is not None and isinstance(value, Mapping):
            value = _build(target, value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in a hint such as `Operand | None`, else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None
