"""Codemod for `sparse_launch`: replay the model's forward and backward from CUDA graphs.

What it rewrites: the module whose parameters an optimizer trains, `model` in
`torch.optim.AdamW(model.parameters(), ...)` (any `torch.optim` class, however imported), gets
`model = cuda_graphed(model)` on the line before that construction, with
`from opadvisor.kernels import cuda_graphed` (or the file's own spelling of it). `cuda_graphed` returns the
same module with its `forward` replaced: per input signature it captures the forward and backward in CUDA
graphs on the first call and replays them afterwards, so a step that launches thousands of short kernels
launches two graphs (see opadvisor/kernels/graphs.py). The rest of the step (data, loss, optimizer) is left
as written.

Fix safety: unsafe. The rewritten program computes the same values (tested), but graphs freeze what
Python did while they were captured: outputs of the model are overwritten by its next call (code that keeps
an old step's output must clone it), Python side effects inside forward (prints, counters, Python-side
randomness) happen only at capture, dropout draws other (equally distributed) masks, and capture costs
four extra forward/backward passes per new input shape. `cuda_graphed` itself runs the original forward
wherever graphing cannot be right (no gradients, non-tensor or keyword arguments, hooks, changed
parameters, a second forward before the first backward, a capture that fails: it warns once).

Capture blockers first. The finding's facts (`SparseLaunchFacts`, opadvisor/rules/launch/sparse_launch.py) list the ops
of the model's forward that a capture cannot take, from the profile. A Python number copied to the device
is rewritten at its line into the capture-safe form of the same value and dtype (exact):

    torch.tensor(c).type_as(t)          -> torch.full((), c, device=t.device).type_as(t)
                                           torch.full((), c, dtype=t.dtype, device=t.device)  (no cast seen)
    torch.tensor(c, device=d, dtype=x)  -> torch.full((), c, device=d, dtype=x)
    torch.tensor(c).to(t.device)        -> torch.full((), c, device=t.device)   (also .to(device), .cuda())

(`torch.full` infers the dtype `torch.tensor` infers for a Python bool, int or float). Any other blocker
(`.item()`, `.cpu()`, a CPU tensor moved in, `nonzero`, a blocker in library code or another file) refuses
the whole fix, naming the line and why: a graph that cannot be captured would only fall back to eager after
paying for the attempt.

Refused (left alone, with the reason): an optimizer whose first argument is not `NAME.parameters()` (a
parameter list or groups: which module to graph is not clear from the code), and a file that wraps a
module in `DistributedDataParallel` (its gradient hooks would run only at capture). A file that already
calls `cuda_graphed` is left as it is (idempotent; apply says "already applied").

Targets: sparse_launch's findings name the functions whose launches leave the GPU idle, not the
optimizer's line: a target anywhere in a file rewrites that file's optimizer constructions (`FILE_LEVEL`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod, target_facts
from opadvisor.rewrite.toolkit import DDP_NAMES, nodes_of, qualified, reference
from opadvisor.rules.launch.sparse_launch import SCALAR_TENSOR, CaptureBlocker, SparseLaunchFacts

KERNEL = "opadvisor.kernels.cuda_graphed"
KERNEL_NAMES = frozenset({KERNEL, "opadvisor.kernels.graphs.cuda_graphed"})
# the wrappers whose gradient hooks a capture would freeze: DDP (as the data-parallel codemods name it) and
# DataParallel
WRAPPER_NAMES = DDP_NAMES | {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel"}
_PARAMETERS_OF_NAME = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("parameters")), args=[])
# what `torch.tensor(c)` may hold for the rewrite: a Python number built from names, numbers and arithmetic
_SCALAR_PARTS = (
    cst.Name, cst.Attribute, cst.Integer, cst.Float, cst.Imaginary, cst.BinaryOperation, cst.UnaryOperation,
    cst.Subscript, cst.Call,
)  # fmt: skip


class CudaGraphsCodemod(RuleCodemod):
    """Wrap the optimized module in `cuda_graphed` before its optimizer is built."""

    RULE: ClassVar[str] = "sparse_launch"
    FACTS = SparseLaunchFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (
        "optim",
        "cuda_graphed",
    )  # the optimizer's construction, or its own fix
    NO_KERNEL_OP: ClassVar[str] = (
        "opadvisor.kernels.cuda_graphed keeps no dispatch record (a replay runs no Python to count); "
        "verify's step times show whether the graphs ran"
    )
    SAFETY: ClassVar[str] = "unsafe"
    # it inserts `model = cuda_graphed(model)` before the optimizer's line, which fused_optimizer may have
    # given `fused=True`: the two compose
    COMPOSES: ClassVar[bool] = True
    FILE_LEVEL: ClassVar[bool] = True
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        self._already = False
        self._already_line = 0
        self._ddp = False
        self._wrapped = False
        for call in nodes_of(node, cst.Call):
            names = qualified(self, call.func)  # type: ignore[attr-defined]
            if names & KERNEL_NAMES and not self._already:
                self._already, self._already_line = True, self.lines_of(call)[0]
            self._ddp = self._ddp or bool(names & WRAPPER_NAMES)
        self._rewrites: dict[cst.Call, tuple[cst.BaseExpression, CaptureBlocker]] = {}
        self._blocked = self._plan_blockers(node)
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.targets_only = 0 if self._blocked is not None else len(self._rewrites)  # none in static mode
        if self._blocked is not None:
            self.skip(original_node, self._blocked)
        elif self.targets and not self._already and not self._wrapped and not self.skipped:
            self.skip(
                original_node,
                "no torch.optim optimizer built from `model.parameters()` in this file: wrap the module that "
                "runs the step by hand: model = opadvisor.kernels.cuda_graphed(model)",
            )
        elif self._already and not self.changes and not self.skipped:
            self.already = f"the model is already wrapped in cuda_graphed (line {self._already_line})"
        return updated_node

    # ---- capture blockers --------------------------------------------------------------------------
    def _plan_blockers(self, module: cst.Module) -> str | None:
        """Find the capture-safe rewrite of every blocker the facts list; the reason to refuse the whole
        fix when one has none (None: all can be rewritten, or there are none)."""
        blockers: dict[tuple, tuple[CaptureBlocker, int | None]] = {}
        for target in self.targets or []:
            facts = target_facts(target, SparseLaunchFacts)
            for i, b in enumerate((facts.blockers or []) if facts is not None else []):
                key = (b.path, b.line, b.op, b.why, b.library_file, b.library_line)
                # its line in the text being rewritten (moved by earlier rewrites; the profiled one else)
                moved = target.step_line(f"blocker {i}")
                blockers.setdefault(key, (b, moved[0] if moved else b.line))
        if not blockers:
            return None
        calls = nodes_of(module, cst.Call)
        for b, line in blockers.values():
            if b.skipped_when_capturing:
                continue  # the library skips that read while a graph is captured
            stop = f"CUDA graph capture would stop at {b.where()}: it {b.why}"
            if b.rewrite != SCALAR_TENSOR or not self._in_this_file(b.path):
                return f"{stop}; move it out of the model's forward (or keep the value on the device) first"
            found = [c for c in calls if self._covers(c, line) and self._scalar_full(c, b) is not None]
            if not found and any(self._covers(c, line) and self._is_full(c) for c in calls):
                continue  # rewritten by an earlier apply
            if not found:
                return f"{stop}, and it is not a `torch.tensor(<number>)` form this fix rewrites"
            outer = found[
                0
            ]  # findall walks outer calls first: `torch.tensor(c).type_as(t)` before `torch.tensor(c)`
            self._rewrites[outer] = (self._scalar_full(outer, b), b)  # type: ignore[assignment]
        return None

    def _is_full(self, call: cst.Call) -> bool:
        """`torch.full((), ...)`: what this fix writes."""
        first = call.args[0].value if call.args else None
        return (
            "torch.full" in qualified(self, call.func) and isinstance(first, cst.Tuple) and not first.elements
        )

    def _in_this_file(self, path: str | None) -> bool:
        name = self.context.filename
        if name is None or path is None:  # a file of unknown name: the facts' own file
            return True
        return Path(path).resolve() == Path(name).resolve()

    def _covers(self, call: cst.Call, line: int | None) -> bool:
        start, end = self.lines_of(call)
        return line is not None and start <= line <= end

    def _scalar_full(self, call: cst.Call, b: CaptureBlocker) -> cst.BaseExpression | None:
        """The `torch.full((), c, ...)` form of a `torch.tensor(c)` copy at this call, or None."""
        func = call.func
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Call):
            inner = self._tensor_of_number(func.value)
            if inner is None or inner.args[1:]:
                return None
            method, args = func.attr.value, call.args
            if method == "type_as" and len(args) == 1 and _plain(args[0]) and _pure(args[0].value):
                other = args[0].value
                same = b.src_dtype is not None and b.src_dtype == b.dst_dtype  # the copy did not cast
                kw = {"dtype": cst.Attribute(other, cst.Name("dtype"))} if same else {}
                full = self._full(
                    inner.args[0].value, {**kw, "device": cst.Attribute(other, cst.Name("device"))}
                )
                return full if same else cst.Call(cst.Attribute(full, cst.Name("type_as")), [cst.Arg(other)])
            device = _device_of_move(method, args)
            if device is not None and (b.src_dtype is None or b.src_dtype == b.dst_dtype):
                return self._full(inner.args[0].value, {"device": device})
            return None
        inner = self._tensor_of_number(call)
        if inner is None or not inner.args[1:] or any(a.keyword is None for a in inner.args[1:]):
            return None
        keywords = {a.keyword.value: a.value for a in inner.args[1:]}  # type: ignore[union-attr]
        if "device" not in keywords or not set(keywords) <= {"device", "dtype", "requires_grad"}:
            return None
        return self._full(inner.args[0].value, keywords)

    def _tensor_of_number(self, call: cst.Call) -> cst.Call | None:
        """`call` when it is `torch.tensor(c, ...)` of a Python number expression, else None."""
        if "torch.tensor" not in qualified(self, call.func) or not call.args:
            return None
        first = call.args[0]
        if not _plain(first) or not _number_expression(first.value):
            return None
        return call

    def _full(self, value: cst.BaseExpression, keywords: dict[str, cst.BaseExpression]) -> cst.Call:
        full = reference(self.context, self._module, "torch.full")
        args = [cst.Arg(cst.Tuple([])), cst.Arg(value)]
        args += [cst.Arg(v, keyword=cst.Name(k), equal=_EQUAL) for k, v in keywords.items()]
        return cst.Call(full, args)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        planned = self._rewrites.get(original_node)
        if planned is None or self._blocked is not None:
            return updated_node
        new, _ = planned
        self.record_change(
            original_node,
            "a Python number copied to the GPU -> torch.full (the same value and dtype, made on the device: "
            "a CUDA graph can capture it)",
        )
        return new

    # ---- the wrap ----------------------------------------------------------------------------------
    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if self._already or self._blocked is not None or (self.targets is not None and not self.targets):
            return updated_node
        wrapped: list[str] = []
        for call in m.findall(original_node, m.Call()):
            if not any(name.startswith("torch.optim.") for name in qualified(self, call.func)):
                continue
            model = self._optimized_module(call)
            if model is not None and model not in wrapped:
                wrapped.append(model)
        if not wrapped:
            return updated_node
        graphed = reference(self.context, self._module, KERNEL)
        wraps = [
            cst.SimpleStatementLine(
                body=[
                    cst.Assign(
                        targets=[cst.AssignTarget(cst.Name(name))],
                        value=cst.Call(func=graphed, args=[cst.Arg(cst.Name(name))]),
                    )
                ]
            )
            for name in wrapped
        ]
        # blank lines go before the new lines, comments stay on the optimizer's
        lead = list(updated_node.leading_lines)
        cut = next((i for i, line in enumerate(lead) if line.comment is not None), len(lead))
        first = wraps[0].with_changes(leading_lines=lead[:cut])
        return cst.FlattenSentinel([first, *wraps[1:], updated_node.with_changes(leading_lines=lead[cut:])])

    def _optimized_module(self, call: cst.Call) -> str | None:
        """`NAME` of `torch.optim.X(NAME.parameters(), ...)`, or None (with the reason recorded)."""
        if self._ddp:
            self.skip(
                call,
                "the file wraps a module in DistributedDataParallel: its gradient hooks would run only "
                "while the graphs are captured; graph the module inside DDP by hand (DDP static_graph)",
            )
            return None
        first = call.args[0] if call.args and call.args[0].keyword is None and not call.args[0].star else None
        if first is None or not m.matches(first.value, _PARAMETERS_OF_NAME):
            self.skip(
                call,
                "the optimizer is not built from `model.parameters()`: which module to graph is not clear "
                "from the code; wrap it by hand: model = cuda_graphed(model)",
            )
            return None
        name = first.value.func.value.value  # type: ignore[attr-defined]
        self._wrapped = True
        self.record_change(
            call,
            f"{name} = cuda_graphed({name}): its forward and backward replay from CUDA graphs (per input shape)",
        )
        return name


_EQUAL = cst.AssignEqual(
    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
)


def _plain(arg: cst.Arg) -> bool:
    return arg.keyword is None and not arg.star


def _pure(node: cst.BaseExpression) -> bool:
    """A name or an attribute chain: read twice by the rewrite, it must give the same value both times."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)


def _number_expression(node: cst.BaseExpression) -> bool:
    """Whether `node` can only be a Python number (or a name read as one): numbers, names, attributes,
    arithmetic and calls; no list, tuple or comprehension (those make tensors of other shapes)."""
    if isinstance(node, cst.BinaryOperation):
        return _number_expression(node.left) and _number_expression(node.right)
    if isinstance(node, cst.UnaryOperation):
        return _number_expression(node.expression)
    return isinstance(node, _SCALAR_PARTS)


def _device_of_move(method: str, args: Sequence[cst.Arg]) -> cst.BaseExpression | None:
    """The device of `.to(t.device)`, `.to(device)`, `.to(device=d)` or `.cuda()`; None for other calls
    (`.to(t)` or `.to(dtype)` would also cast)."""
    if method == "cuda" and not args:
        return cst.SimpleString('"cuda"')
    if method != "to" or len(args) != 1:
        return None
    arg = args[0]
    if arg.keyword is not None:
        return arg.value if arg.keyword.value == "device" else None
    value = arg.value
    name = value.attr.value if isinstance(value, cst.Attribute) else getattr(value, "value", None)
    return value if isinstance(name, str) and name.lower().endswith("device") and _pure(value) else None
