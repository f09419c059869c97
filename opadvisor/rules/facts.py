"""Facts: what the profile proved about one pattern site, carried from the rule to its fix as plain data.

A fixable rule describes its pattern once, as a dataclass deriving from `Facts` (in the rule's own module,
or beside the chain it shares with another rule, as `opadvisor.rules.attention` does): the op chain in the
order it ran, shapes, dtypes, which operands were Python numbers and which tensors (and whether they
require grad), in-place flags. `detect` fills it from the profile and passes it as the finding's `details`
(`facts.to_details()`: plain JSON, in `opadvisor suggest --format json` under each finding's "details");
the engine reads it back as the fix's declared facts class (`RuleCodemod.FACTS`, checked against the
finding's rule) and hands it to the codemod typed (`self.facts_of(target)`), which checks the source
against it, refusing with the reason when they disagree (the source's scale is a tensor expression where
the profile saw a Python number, say). Where a fact is None the profile could not tell, and the codemod
falls back to what the source shows.

    @dataclass
    class MyFacts(Facts):
        RULES = ("my_rule",)
        lines: dict[str, list[int]] = field(default_factory=dict)
        scale: Operand | None = None

    details = MyFacts(lines=..., scale=operand(op, 1)).to_details()      # in detect()
    facts = finding.facts(MyFacts)                                        # anywhere else: typed

Reading is strict: a missing or unknown field, a value of the wrong type or another rule's finding is a
`FactsError` naming the rule, the field and what was found, never None and never a silently skipped guard.
Nothing reads facts written by another version: a finding's facts live in memory from `detect` to the fix
(`apply` runs the rules on profile.json again; the suggest JSON is output only). A field added later is
still declared with `absent_as(default, why)`, whose default must be the safe reading of its absence.
Engine bookkeeping (the alternative fix at the same lines, lines moved by an earlier rewrite) is no fact:
it lives in the finding's and the target's own fields. Only this module and the serialisation (the
finding's JSON) read a finding's `details`.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from opadvisor.profile.model import Op
from opadvisor.rules import registry

__all__ = [
    "Facts",
    "FactsError",
    "Operand",
    "TENSOR_KINDS",
    "absent_as",
    "facts_class",
    "operand",
    "operand_kind",
]

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


class FactsError(ValueError):
    """A finding's facts do not fit the facts class read: a missing or unknown field, a value of the wrong
    type, or another rule's facts. The message names the rule, the field and what was found."""


def absent_as(default: Any, why: str) -> Any:
    """A field a finding's facts may lack (written only in some findings, or added after): `from_details`
    then uses (a copy of) `default`, which `why` shows is safe (it never switches a guard off). Every other
    field must be present."""
    return field(default_factory=lambda: copy.copy(default), metadata={"absent": why})


class Facts:
    """Base of a rule's facts dataclass: JSON round trip through a finding's `details`.

    RULES: the rules whose findings carry these facts; reading another rule's finding as them is an error.
    """

    RULES: ClassVar[tuple[str, ...]] = ()

    def to_details(self) -> dict[str, Any]:
        details = dataclasses.asdict(self)  # type: ignore[call-overload]
        for name in self.unwritten():
            del details[name]
        return details

    def unwritten(self) -> frozenset[str]:
        """The fields these facts do not write: those a finding of their kind has never carried (each one
        declared `absent_as`, so that reading it back gives the same facts). None here."""
        return frozenset()

    @classmethod
    def from_details(cls: type[F], details: Any, rule: str | None = None, partial: bool = False) -> F:
        """The facts in `details` (a finding's, of rule `rule` when given); a `FactsError` when they do not
        fit. `partial`: fields left out take the dataclass defaults (hand-written targets in tests name only
        what they assert); a finding's facts always carry every field (`to_details`)."""
        who = rule or cls.__name__
        if rule is not None and rule not in cls.RULES:
            raise FactsError(
                f"{rule}: its finding's facts are read as {cls.__name__}, the facts of {_rules(cls)}"
            )
        if not isinstance(details, Mapping):
            raise FactsError(f"{who}: facts {cls.__name__} expected a mapping, found {details!r}")
        return _build(cls, details, who, cls.__name__, partial)

    def step_lines(self) -> dict[str, list[int]]:
        """The lines where the profile saw each step (label -> [first, last]), for facts that carry them
        (a `lines` field); {} for the others."""
        lines = getattr(self, "lines", None)
        return {k: [int(v[0]), int(v[-1])] for k, v in lines.items() if v} if isinstance(lines, dict) else {}


def facts_class(rule: str) -> type[Facts] | None:
    """The facts class of `rule`'s findings (the one whose RULES name it); None for a rule whose findings
    carry none."""
    if rule in registry.rule_ids():
        registry.get_rule(rule)  # its module, which defines or imports its facts class
    found = [c for c in _subclasses(Facts) if rule in c.RULES]
    if len(found) > 1:
        raise FactsError(
            f"{rule}: two facts classes claim its findings: {', '.join(c.__name__ for c in found)}"
        )
    return found[0] if found else None


def _subclasses(cls: type) -> list[type]:
    return [d for c in cls.__subclasses__() for d in (c, *_subclasses(c))]


def _rules(cls: type) -> str:
    rules = getattr(cls, "RULES", ())
    return ", ".join(rules) if rules else "no rule (built by the engine)"


def _build(cls: type, data: Mapping[str, Any], who: str, where: str, partial: bool) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise FactsError(f"{who}: facts {where}: unknown field {unknown[0]!r} (found {data[unknown[0]]!r})")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], who, f"{where}.{name}", partial)
        elif not partial and "absent" not in f.metadata:
            raise FactsError(f"{who}: facts {where}: field {name!r} is missing")
    return cls(**kwargs)


def _convert(value: Any, hint: Any, who: str, where: str, partial: bool) -> Any:
    """`value` as type `hint` (a dataclass built from its mapping), or a FactsError naming the field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(value, args, who, where, partial)
    if origin is Literal:
        if value in args:
            return value
    elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return _build(hint, value, who, where, partial)
    elif origin in (list, tuple) and isinstance(value, list | tuple):
        item = args[0] if args else Any
        return origin(_convert(v, item, who, f"{where}[{i}]", partial) for i, v in enumerate(value))
    elif origin is dict and isinstance(value, Mapping):
        key, item = args or (Any, Any)
        return {
            _convert(k, key, who, where, partial): _convert(v, item, who, f"{where}[{k!r}]", partial)
            for k, v in value.items()
        }
    elif _plain(value, hint):
        return value
    raise FactsError(f"{who}: facts {where}: expected {_name(hint)}, found {value!r}")


def _union(value: Any, args: tuple, who: str, where: str, partial: bool) -> Any:
    if value is None and type(None) in args:
        return None
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) == 1:  # `X | None`: X's own error, which names the nested field
        return _convert(value, kinds[0], who, where, partial)
    for arg in kinds:
        try:
            return _convert(value, arg, who, where, partial)
        except FactsError:
            continue
    raise FactsError(f"{who}: facts {where}: expected {' | '.join(map(_name, args))}, found {value!r}")


def _plain(value: Any, hint: Any) -> bool:
    """Whether `value` is of the plain type `hint` (bool is no int; an int is a float, as JSON has it)."""
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(hint, type) and isinstance(value, hint)


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
