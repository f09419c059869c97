"""Codemod for `rnn_cell_loop`: a loop stepping an nn.LSTMCell / nn.GRUCell / nn.RNNCell becomes one call.

Before::

    for t in range(x.size(0)):
        h, c = self.cell(x[t], (h, c))
        outputs.append(h)

After::

    step_outputs, (h, c) = cell_sequence(self.cell, x, (h, c))
    outputs.extend(step_outputs.unbind(0))

with `from opadvisor.kernels import cell_sequence` (or the file's own spelling of it). `cell_sequence` runs
the cell's own parameters through the fused op `nn.LSTM` calls (cuDNN on CUDA) and returns every step's
hidden state and the final state; the list the loop filled gets the same tensors (so whatever the code does
with it next, `torch.stack(outputs)` or `outputs[-1]`, is unchanged), and the state names hold the final
state, as after the loop. A loop that only carries the state becomes `h, c = cell_sequence(...)[1]`.

Why not an nn.LSTM in the cell's place: nn.LSTM names its parameters `weight_ih_l0`, ... where the cell has
`weight_ih`, ...: every saved state_dict would stop loading. The cell stays; only the loop changes.

What is rewritten (anything else is left alone, with the reason):
- the loop: `for t in range(N)` where N is `x.size(d)`, `x.shape[d]`, `len(x)` (d = 0) or a name bound
  once in the function from one of those (or unpacked from `x.size()` / `x.shape`); or `for x_t in x`,
  `for x_t in x.unbind(d)`, `for x_t in torch.unbind(x, d)`; no `else:`, and the loop variable not read
  after the loop;
- its body, nothing else: `h, c = CELL(x[t], (h, c))` for an LSTM cell (or `hx = CELL(x[t], hx)`, then
  `hx[0]` is the hidden state), `h = CELL(x[t], h)` for a GRU or RNN cell, where `x[t]` is `x[t]` / `x[t, :]`
  (time on dimension 0) or `x[:, t]` / `x[:, t, :]` (dimension 1), matching N's dimension (or the loop
  variable itself for the `for x_t in ...` forms); then optionally `outputs.append(h)`.
- the cell: in profile mode, the module the finding names (the facts' `module`, whose last part is the
  attribute called, its `kind` decides the state's form); in static mode, a `self.<attr>` that the class's
  `__init__` builds as `nn.LSTMCell(...)`, `nn.GRUCell(...)` or `nn.RNNCell(...)`.

Fix safety: safe: the same recurrence, the same parameters and state_dict, values equal up to
floating-point rounding (checked with the gradients in the tests). A sequence of length 0 (the loop would
run zero times) is not supported by the fused op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import (
    Visitor,
    class_info,
    code,
    enclosing_class,
    int_value,
    names_in,
    parent,
    qualified,
    reference,
    self_attr,
)
from opadvisor.rules.rnn.rnn_cell_loop import CellLoopFacts

KERNEL = "opadvisor.kernels.cell_sequence"
CELL_CLASSES = {
    "torch.nn.LSTMCell": "LSTMCell",
    "torch.nn.modules.rnn.LSTMCell": "LSTMCell",
    "torch.nn.GRUCell": "GRUCell",
    "torch.nn.modules.rnn.GRUCell": "GRUCell",
    "torch.nn.RNNCell": "RNNCell",
    "torch.nn.modules.rnn.RNNCell": "RNNCell",
}
TEMP = "step_outputs"


class Refused(Exception):
    """Why a loop is left as it is."""


@dataclass
class Plan:
    cell: cst.BaseExpression
    inputs: cst.BaseExpression
    dim: int
    state_arg: cst.BaseExpression  # what the cell call passed as the state
    state_target: cst.BaseAssignTargetExpression  # what the cell call assigned
    outputs: str | None  # the list the loop appended the hidden state to


class RnnCellLoopCodemod(RuleCodemod):
    """Replace a loop over a recurrent cell by one `opadvisor.kernels.cell_sequence` call."""

    RULE: ClassVar[str] = "rnn_cell_loop"
    FACTS = CellLoopFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("cell",)  # nn.LSTMCell, nn.GRUCell, nn.RNNCell
    KERNEL_OP: ClassVar[str | tuple[str, ...] | None] = "cell_sequence"
    SAFETY: ClassVar[str] = "safe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        return True

    def leave_For(
        self, original_node: cst.For, updated_node: cst.For
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        target = self._target(original_node)
        if target is None:
            return updated_node
        try:
            kind, plan = self._plan(original_node, target)
        except Refused as why:
            if self.targets is not None:
                self.answered.add(target)
                self.skip(original_node, str(why))
            return updated_node
        self.answered.add(target)
        self.record_change(
            original_node,
            f"the loop over {code(plan.cell)} ({kind}) -> one cell_sequence call (the fused recurrence)",
        )
        return cst.FlattenSentinel(self._statements(original_node, plan))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda target: "no loop stepping the cell on these lines")
        return updated_node

    def _target(self, loop: cst.For) -> Target | None:
        start = self.lines_of(loop)[0]
        if self.targets is None:
            return Target(start, start)
        return next((t for t in self.targets if t.line <= start <= t.end_line), None)

    # ---- the analysis --------------------------------------------------------------------------------------
    def _plan(self, loop: cst.For, target: Target) -> tuple[str, Plan]:
        if loop.orelse is not None:
            raise Refused("the loop has an else: clause")
        function = self._function(loop)
        steps = _body(loop)
        cell_call, assigned = _cell_step(steps[0])
        kind = self._kind(loop, cell_call.func, target)
        state_arg = cell_call.args[1].value
        _check_state(kind, assigned, state_arg)
        outputs = _appended(steps[1], assigned) if len(steps) == 2 else None
        step_input = cell_call.args[0].value
        inputs, dim = self._sequence(loop, step_input, function)
        var = loop.target.value if isinstance(loop.target, cst.Name) else None
        if var is None:
            raise Refused("the loop variable is not a plain name")
        if _read_after(function, loop, var):
            raise Refused(f"{var} is read after the loop: its last value would be gone")
        return kind, Plan(cell_call.func, inputs, dim, state_arg, assigned, outputs)

    def _function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        current = parent(self, node)
        while current is not None and not isinstance(current, cst.FunctionDef):
            current = parent(self, current)
        return current

    def _kind(self, loop: cst.For, cell: cst.BaseExpression, target: Target) -> str:
        built = self._constructed_kind(loop, cell)
        if self.targets is None:
            if built is None:
                raise Refused(f"{code(cell)} is not built as an nn.LSTMCell, nn.GRUCell or nn.RNNCell here")
            return built
        facts = target_facts(target, CellLoopFacts) or CellLoopFacts()
        module, kind = facts.module, facts.kind
        called = cell.attr.value if isinstance(cell, cst.Attribute) else getattr(cell, "value", "")
        if module.rpartition(".")[2] != called:
            raise Refused(f"the loop calls {code(cell)}, not the profiled cell {module!r}")
        if built is not None and built != kind:
            raise Refused(f"{code(cell)} is built as {built} but the profile saw {kind}")
        if kind not in ("LSTMCell", "GRUCell", "RNNCell"):
            raise Refused(f"the profile names no recurrent cell kind ({kind!r})")
        return kind

    def _constructed_kind(self, loop: cst.For, cell: cst.BaseExpression) -> str | None:
        attr = self_attr(cell)
        cls = enclosing_class(self, loop)
        if attr is None or cls is None:
            return None
        value = class_info(cls).value(attr)
        if not isinstance(value, cst.Call):
            return None
        found = qualified(self, value.func) & CELL_CLASSES.keys()
        return CELL_CLASSES[sorted(found)[0]] if found else None

    def _sequence(
        self, loop: cst.For, step_input: cst.BaseExpression, function: cst.FunctionDef | None
    ) -> tuple[cst.BaseExpression, int]:
        """(the whole input, its time dimension) from the loop header and the step's input expression."""
        var = loop.target.value if isinstance(loop.target, cst.Name) else None
        iterable = loop.iter
        if m.matches(iterable, m.Call(func=m.Name("range"))):
            args = iterable.args  # type: ignore[union-attr]
            if len(args) != 1 or args[0].keyword is not None:
                raise Refused("the loop is range() with a start or a step, not the whole sequence")
            inputs, dim = _indexed(step_input, var)
            length = _length_of(args[0].value, function, loop)
            if length is None:
                raise Refused(f"cannot tell that range({code(args[0].value)}) covers the whole sequence")
            if code(length[0]) != code(inputs) or length[1] != dim:
                raise Refused(
                    f"the loop runs over {code(args[0].value)} but steps {code(inputs)} along dimension {dim}"
                )
            return inputs, dim
        if not (isinstance(step_input, cst.Name) and step_input.value == var):
            raise Refused("the cell's input is not the loop variable")
        sequence = _unbound(iterable)
        if sequence is None:
            raise Refused(
                f"cannot tell that the loop over {code(iterable)} steps through a tensor's first dimension"
            )
        return sequence

    # ---- the rewrite ---------------------------------------------------------------------------------------
    def _statements(self, loop: cst.For, plan: Plan) -> list[cst.BaseStatement]:
        func = reference(self.context, self._module, KERNEL)
        args = [cst.Arg(plan.cell), cst.Arg(plan.inputs), cst.Arg(_parenthesised(plan.state_arg))]
        if plan.dim:
            args.append(
                cst.Arg(
                    keyword=cst.Name("time_dim"),
                    value=cst.Integer(str(plan.dim)),
                    equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
                )
            )
        call = cst.Call(func=func, args=_commas(args))
        state = _parenthesised(plan.state_target)
        comments = _comment_lines(loop)
        if plan.outputs is None:
            value = cst.Subscript(value=call, slice=[cst.SubscriptElement(cst.Index(cst.Integer("1")))])
            first = _assign(state, value)
            return [first.with_changes(leading_lines=[*loop.leading_lines, *comments])]
        temp = _fresh(TEMP, self._function(loop) or self._module)
        first = _assign(cst.Tuple([cst.Element(cst.Name(temp)), cst.Element(state)], lpar=[], rpar=[]), call)
        unbind = cst.Call(
            func=cst.Attribute(value=cst.Name(temp), attr=cst.Name("unbind")),
            args=[cst.Arg(cst.Integer(str(plan.dim)))],
        )
        extend = cst.Call(
            func=cst.Attribute(value=cst.Name(plan.outputs), attr=cst.Name("extend")), args=[cst.Arg(unbind)]
        )
        second = cst.SimpleStatementLine([cst.Expr(extend)])
        return [first.with_changes(leading_lines=[*loop.leading_lines, *comments]), second]


# ---- helpers (pure functions of the syntax tree) -----------------------------------------------------------
def _body(loop: cst.For) -> list[cst.BaseSmallStatement]:
    if not isinstance(loop.body, cst.IndentedBlock):
        raise Refused("the loop body is on the for line")
    small: list[cst.BaseSmallStatement] = []
    for stmt in loop.body.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            raise Refused("the loop does more than step the cell (a nested block)")
        small.extend(stmt.body)
    if not 1 <= len(small) <= 2:
        raise Refused("the loop does more per step than call the cell and append its output")
    return small


def _cell_step(stmt: cst.BaseSmallStatement) -> tuple[cst.Call, cst.BaseAssignTargetExpression]:
    if not (isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, cst.Call)):
        raise Refused("the loop's first statement is not `state = cell(input, state)`")
    call = stmt.value
    state_keyword = call.args[1].keyword if len(call.args) == 2 else None
    if (
        len(call.args) != 2
        or call.args[0].keyword is not None
        or state_keyword not in (None,)
        and (state_keyword.value != "hx")
    ):
        raise Refused("the cell is not called as cell(input, state)")
    if any(a.star for a in call.args) or not m.matches(call.func, m.Name() | m.Attribute()):
        raise Refused("the cell call unpacks arguments or its callee is computed")
    if _has_call(call.func):
        raise Refused("the cell expression calls something")
    return call, stmt.targets[0].target


def _has_call(node: cst.CSTNode) -> bool:
    return bool(m.findall(node, m.Call()))


def _names(node: cst.CSTNode) -> list[str]:
    if isinstance(node, cst.Name):
        return [node.value]
    if isinstance(node, cst.Tuple) and all(isinstance(e.value, cst.Name) for e in node.elements):
        return [e.value.value for e in node.elements]  # type: ignore[union-attr]
    return []


def _check_state(kind: str, assigned: cst.CSTNode, passed: cst.CSTNode) -> None:
    out, into = _names(assigned), _names(passed)
    if not out or out != into:
        raise Refused("the cell's state is not carried from one step to the next (`h = cell(x_t, h)`)")
    if kind == "LSTMCell" and len(out) not in (1, 2) or kind != "LSTMCell" and len(out) != 1:
        raise Refused(f"the state's form does not fit an {kind}")
    if kind == "LSTMCell" and len(out) == 1 and isinstance(assigned, cst.Tuple):
        raise Refused("an LSTM cell's state is a pair")


def _appended(stmt: cst.BaseSmallStatement, state: cst.CSTNode) -> str:
    """The list the hidden state is appended to (`outputs.append(h)`, or `hx[0]` for a paired state)."""
    pattern = m.Expr(
        m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("append")), args=[m.Arg(keyword=None)])
    )
    if not m.matches(stmt, pattern):
        raise Refused("the loop's second statement is not `outputs.append(hidden)`")
    call = stmt.value  # type: ignore[union-attr]
    appended = call.args[0].value
    names = _names(state)
    hidden_ok = (
        len(names) == 2
        and m.matches(appended, m.Name(names[0]))
        or len(names) == 1
        and isinstance(state, cst.Name)
        and (
            m.matches(appended, m.Name(names[0]))
            or m.matches(appended, m.Subscript(value=m.Name(names[0])))
            and int_value(appended.slice[0].slice.value) == 0  # type: ignore[union-attr]
        )
    )
    if not hidden_ok:
        raise Refused(f"the loop appends {code(appended)}, not the cell's hidden state")
    owner = call.func.value.value
    if owner in names:
        raise Refused("the list appended to is the state itself")
    return owner


def _indexed(step_input: cst.BaseExpression, var: str | None) -> tuple[cst.BaseExpression, int]:
    """`x[t]` / `x[t, :]` -> (x, 0); `x[:, t]` / `x[:, t, :]` -> (x, 1)."""
    if not isinstance(step_input, cst.Subscript) or _has_call(step_input.value):
        raise Refused(
            f"the cell's input {code(step_input)} is not one time step of a tensor (x[t] or x[:, t])"
        )
    parts = [e.slice for e in step_input.slice]
    full = [
        isinstance(p, cst.Slice) and p.lower is None and p.upper is None and p.step is None for p in parts
    ]
    hits = [
        i for i, p in enumerate(parts) if isinstance(p, cst.Index) and m.matches(p.value, m.Name(var or ""))
    ]
    if len(hits) != 1 or hits[0] > 1 or not all(full[i] for i in range(len(parts)) if i != hits[0]):
        raise Refused(
            f"the cell's input {code(step_input)} is not one time step of a tensor (x[t] or x[:, t])"
        )
    return step_input.value, hits[0]


def _length_of(
    expr: cst.BaseExpression, function: cst.FunctionDef | None, loop: cst.For
) -> tuple[cst.BaseExpression, int] | None:
    """(tensor, dim) when `expr` is its length along dim: x.size(d), x.shape[d], len(x), or a name bound
    once in the function from one of those (or unpacked from x.size() / x.shape)."""
    direct = _size_expr(expr)
    if direct is not None or not isinstance(expr, cst.Name) or function is None:
        return direct
    found: list[tuple[cst.BaseExpression, int] | None] = []
    for assign in m.findall(function, m.Assign()):
        for t in assign.targets:  # type: ignore[attr-defined]
            if m.matches(t.target, m.Name(expr.value)):
                found.append(_size_expr(assign.value))  # type: ignore[attr-defined]
            elif isinstance(t.target, cst.Tuple):
                names = [e.value for e in t.target.elements]
                hits = [i for i, n in enumerate(names) if m.matches(n, m.Name(expr.value))]
                if hits:
                    found.append(_whole_size(assign.value, hits[0]))  # type: ignore[attr-defined]
    rebound = m.AugAssign(target=m.Name(expr.value)) | m.Param(name=m.Name(expr.value))
    found.extend(None for _ in m.findall(function, rebound))
    return found[0] if len(found) == 1 else None


def _size_expr(expr: cst.BaseExpression) -> tuple[cst.BaseExpression, int] | None:
    if m.matches(expr, m.Call(func=m.Attribute(attr=m.Name("size")), args=[m.Arg()])):
        dim = int_value(expr.args[0].value)  # type: ignore[union-attr]
        owner = expr.func.value  # type: ignore[union-attr]
        return (owner, dim) if dim in (0, 1) and not _has_call(owner) else None
    if m.matches(expr, m.Subscript(value=m.Attribute(attr=m.Name("shape")))) and len(expr.slice) == 1:  # type: ignore[union-attr]
        index = expr.slice[0].slice  # type: ignore[union-attr]
        dim = int_value(index.value) if isinstance(index, cst.Index) else None
        owner = expr.value.value  # type: ignore[union-attr]
        return (owner, dim) if dim in (0, 1) and not _has_call(owner) else None
    if m.matches(expr, m.Call(func=m.Name("len"), args=[m.Arg(keyword=None)])):
        owner = expr.args[0].value  # type: ignore[union-attr]
        return (owner, 0) if not _has_call(owner) else None
    return None


def _whole_size(expr: cst.BaseExpression, index: int) -> tuple[cst.BaseExpression, int] | None:
    """`seq, batch, _ = x.size()` (or `x.shape`): the name at `index` is x's size along that dimension."""
    if index > 1:
        return None
    if m.matches(expr, m.Call(func=m.Attribute(attr=m.Name("size")), args=[])):
        owner = expr.func.value  # type: ignore[union-attr]
    elif m.matches(expr, m.Attribute(attr=m.Name("shape"))):
        owner = expr.value  # type: ignore[union-attr]
    else:
        return None
    return None if _has_call(owner) else (owner, index)


def _unbound(iterable: cst.BaseExpression) -> tuple[cst.BaseExpression, int] | None:
    """`x` -> (x, 0); `x.unbind(d)` / `x.unbind(dim=d)` / `torch.unbind(x, d)` -> (x, d) for d in 0, 1."""
    if isinstance(iterable, cst.Name | cst.Attribute) and not _has_call(iterable):
        return iterable, 0
    if not isinstance(iterable, cst.Call):
        return None
    args = list(iterable.args)
    if m.matches(iterable.func, m.Attribute(attr=m.Name("unbind"))) and not m.matches(
        iterable.func, m.Attribute(value=m.Name("torch"))
    ):
        owner = iterable.func.value  # type: ignore[union-attr]
    elif m.matches(iterable.func, m.Attribute(value=m.Name("torch"), attr=m.Name("unbind"))) and args:
        owner, args = args[0].value, args[1:]
    else:
        return None
    dim = int_value(args[0].value) if args else 0
    if len(args) > 1 or dim not in (0, 1) or _has_call(owner):
        return None
    return owner, dim


def _read_after(function: cst.FunctionDef | None, loop: cst.For, name: str) -> bool:
    """Whether `name` appears in the function's statements after the loop (in the loop's own block)."""
    if function is None:
        return False
    found = False
    seen_loop = False

    class _After(Visitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            nonlocal found, seen_loop
            if node is loop:
                seen_loop = True
                return False
            if seen_loop and isinstance(node, cst.Name) and node.value == name:
                found = True
            return not found

    function.visit(_After())
    return found


def _fresh(base: str, scope: cst.CSTNode) -> str:
    used = {n.value for n in names_in(scope)}
    name, i = base, 1
    while name in used:
        i += 1
        name = f"{base}_{i}"
    return name


def _parenthesised(node: cst.CSTNode) -> cst.BaseExpression:
    """A tuple written with parentheses (`(h, c)`), anything else as it is."""
    if isinstance(node, cst.Tuple) and not node.lpar:
        return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return node  # type: ignore[return-value]


def _commas(args: list[cst.Arg]) -> list[cst.Arg]:
    sep = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return [a.with_changes(comma=sep) for a in args[:-1]] + args[-1:]


def _assign(target: cst.BaseAssignTargetExpression, value: cst.BaseExpression) -> cst.SimpleStatementLine:
    return cst.SimpleStatementLine([cst.Assign(targets=[cst.AssignTarget(target)], value=value)])


def _comment_lines(loop: cst.For) -> list[cst.EmptyLine]:
    """The loop's comments (its header's and its body's), as comment lines above what replaces it."""
    comments = [
        c for c in m.findall(loop.with_changes(leading_lines=[]), m.Comment()) if isinstance(c, cst.Comment)
    ]
    return [cst.EmptyLine(indent=True, whitespace=cst.SimpleWhitespace(""), comment=c) for c in comments]
