"""Codemod for `grad_accum_sync`: synchronise gradients only on the micro-step that steps the optimizer.

Profile mode only. Each target is the statement that built the wrapper (`model = DDP(...)`, or the root
`fully_shard(model)`): it names the model (the name the DDP wrapper is bound to; fully_shard's module).
The finding's facts say where the forward and the optimizer step were called (`lines`); the accumulation
loop is the innermost `for` holding the forward, in one of the two shapes people write:

    for i, (x, y) in enumerate(loader):          # (a) the step under an `if` of the same loop
        loss = model(x, y) / accum
        loss.backward()
        if (i + 1) % accum == 0:                 #     LAST is the `if`'s condition
            optimizer.step()

    for step in range(steps):                    # (b) a loop of micro-steps inside the step loop
        for micro in range(accum):               #     LAST is `micro == accum - 1`
            loss = model(x) / accum
            loss.backward()
        optimizer.step()

FSDP2: `model.set_requires_gradient_sync(LAST)` becomes the first statement of the micro-step loop's body.
The next statement is `model.set_reshard_after_backward(LAST, recurse=False)`: the root unit's gathered
parameters stay between micro-steps instead of being gathered again by the next forward, which gathers them
first thing anyway (and FSDP2 by default does not reshard the root after its forward): the peak memory does
not grow. `recurse=False` leaves any per-block units (written now or later by
fsdp_root_only) resharding as they did; keeping every block gathered is fsdp_reshard's trade, judged from
the measured memory. Where one unit holds the whole model this saves all but one gather per step.
DDP: the statements of the micro-step (in (a) those before the `if`, in (b) the whole body) run under
`with contextlib.nullcontext() if LAST else model.no_sync():` (DDP reads the flag at the forward, so the
forward must be inside), and `contextlib` is imported.

Refused (left alone, with the reason): a wrapper not bound to a name, a forward that does not call that
name, an optimizer step neither under an `if` after the forward nor after a `for ... in range(N)` loop of
micro-steps, a condition that calls anything but len/min/max/int or reads a name the micro-step assigns
(it is evaluated before the forward now), a loop whose lines moved away from the profiled ones.

Fix safety: safe (the reduction is linear: reducing the accumulated sum once gives the same gradients up
to float rounding; FSDP2 keeps unsharded gradients between micro-steps, which costs memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import DDP_NAMES, FULLY_SHARD_NAMES, code, nodes_of, resolves_to
from opadvisor.rules.distributed.parallel_facts import GradSyncFacts

PURE_CALLS = frozenset({"len", "min", "max", "int"})
COMMENT = (
    "# gradients synchronised only on the micro-step that steps the optimizer (opadvisor grad_accum_sync)"
)


@dataclass
class _Edit:
    """What to do to one micro-step loop."""

    target: Target
    wrapper: str  # "ddp" | "fsdp"
    model: str
    last: str  # the expression that is true on the last micro-step
    stop: int | None  # (a) DDP: the statements before this index run under no_sync; None: the whole body


class GradAccumSyncCodemod(RuleCodemod):
    """Only the last accumulation micro-step synchronises (DDP's no_sync, FSDP2's set_requires_gradient_sync)."""

    RULE: ClassVar[str] = "grad_accum_sync"
    FACTS = GradSyncFacts
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False
    COMPOSES: ClassVar[bool] = True  # ddp_find_unused / ddp_small_bucket edit the wrapper's own line
    NO_KERNEL_OP: ClassVar[str] = "fewer collectives, no op of its own"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def __init__(self, context, targets=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(context, targets)
        self._edits: dict[int, _Edit] = {}  # id(original For) -> its edit

    def visit_Module(self, node: cst.Module) -> bool:
        if not self.targets:
            return False
        for target in self.targets:
            planned = self._plan(node, target)
            if isinstance(planned, str):
                self.skipped.append(Note(target.line, planned))
            elif planned is not None:
                loop, edit = planned
                self._edits[id(loop)] = edit
        return bool(self._edits)

    def leave_For(self, original_node: cst.For, updated_node: cst.For) -> cst.For:
        edit = self._edits.get(id(original_node))
        if edit is None:
            return updated_node
        body = cst.ensure_type(updated_node.body, cst.IndentedBlock)
        statements = list(body.body)
        if edit.wrapper == "fsdp":
            statements[:0], what = self._fsdp_calls(edit)
        else:
            stop = len(statements) if edit.stop is None else edit.stop
            statements = [self._no_sync(edit, statements[:stop]), *statements[stop:]]
            AddImportsVisitor.add_needed_import(self.context, "contextlib")
            what = f"the micro-step runs under {edit.model}.no_sync() unless {edit.last}"
        loop_line = self.lines_of(original_node)[0]
        self.changes.append(Note(edit.target.line, f"{what} (the loop at line {loop_line})"))
        return updated_node.with_changes(body=body.with_changes(body=statements))

    @staticmethod
    def _fsdp_calls(edit: _Edit) -> tuple[list[cst.BaseStatement], str]:
        """The statements that open an FSDP2 micro-step, and what they do in words."""
        calls = [
            f"{edit.model}.set_requires_gradient_sync({edit.last})",
            f"{edit.model}.set_reshard_after_backward({edit.last}, recurse=False)",
        ]
        statements = [cst.parse_statement(c + "\n") for c in calls]
        statements[0] = statements[0].with_changes(
            leading_lines=[cst.EmptyLine(comment=cst.Comment(COMMENT))]
        )
        return statements, " and ".join(calls) + " before the forward"

    @staticmethod
    def _no_sync(edit: _Edit, statements: list[cst.BaseStatement]) -> cst.With:
        item = cst.WithItem(
            cst.parse_expression(f"contextlib.nullcontext() if {edit.last} else {edit.model}.no_sync()")
        )
        first = statements[0]
        inner = [first.with_changes(leading_lines=[]), *statements[1:]]
        return cst.With(
            items=[item],
            body=cst.IndentedBlock(body=inner),
            leading_lines=[*first.leading_lines, cst.EmptyLine(comment=cst.Comment(COMMENT))],
        )

    # ---- planning, on the original tree --------------------------------------------------------------
    def _plan(self, module: cst.Module, target: Target) -> tuple[cst.For, _Edit] | str | None:
        facts = target_facts(target, GradSyncFacts)
        if facts is None:
            return "the finding carries no accumulation facts (profile again with this version)"
        model = self._model_name(module, target, facts.wrapper)
        if model.startswith("!"):
            return model[1:]
        forward, step = (target.step_line(k) for k in ("forward", "step"))
        if not forward or not step:
            return "the forward or the optimizer step was called in another file: change the loop by hand"
        loop = self._innermost_loop(module, forward[0])
        if loop is None:
            return f"the forward (line {forward[0]}) is in no for loop"
        if self._already(loop, model):
            self.already = f"the loop already decides {model}'s gradient sync per micro-step"
            return None
        if not self._calls_model(loop, forward[0], model):
            return f"line {forward[0]} calls no `{model}(...)`: the loop moved since it was profiled"
        found = self._shape(loop, forward[0], step[0])
        if isinstance(found, str):
            return found
        last, stop = found
        return loop, _Edit(target, facts.wrapper, model, last, stop)

    def _model_name(self, module: cst.Module, target: Target, wrapper: str) -> str:
        """The model's expression, or "!" + why there is none."""
        for stmt in nodes_of(module, cst.SimpleStatementLine):
            start, end = self.lines_of(stmt)
            if end < target.line or start > target.end_line or len(stmt.body) != 1:
                continue
            small = stmt.body[0]
            value = small.value if isinstance(small, cst.Assign | cst.Expr) else None
            if not isinstance(value, cst.Call):
                continue
            if wrapper == "ddp" and resolves_to(self, value.func, DDP_NAMES):
                if isinstance(small, cst.Assign) and len(small.targets) == 1:
                    return code(small.targets[0].target)
                return "!the DDP wrapper is not bound to one name"
            if wrapper == "fsdp" and resolves_to(self, value.func, FULLY_SHARD_NAMES):
                first = value.args[0] if value.args and value.args[0].keyword is None else None
                return code(first.value) if first is not None else "!fully_shard's module is not positional"
        return f"!no {'DistributedDataParallel' if wrapper == 'ddp' else 'fully_shard'}(...) statement on these lines"

    def _innermost_loop(self, module: cst.Module, line: int) -> cst.For | None:
        best = None
        for loop in nodes_of(module, cst.For):
            start, end = self.lines_of(loop)
            if start <= line <= end and (best is None or start >= self.lines_of(best)[0]):
                best = loop
        return best

    def _already(self, loop: cst.For, model: str) -> bool:
        wanted = {f"{model}.no_sync", f"{model}.set_requires_gradient_sync"}
        return any(code(c.func) in wanted for c in nodes_of(loop, cst.Call))

    def _calls_model(self, loop: cst.For, line: int, model: str) -> bool:
        for call in nodes_of(loop.body, cst.Call):
            start, end = self.lines_of(call)
            if start <= line <= end and code(call.func) == model:
                return True
        return False

    def _shape(self, loop: cst.For, forward: int, step: int) -> tuple[str, int | None] | str:
        """(LAST, where the micro-step's statements stop (None: the whole body)), or why neither shape."""
        body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else []
        at = [i for i, s in enumerate(body) if _holds(self, s, forward)]
        steps = [i for i, s in enumerate(body) if _holds(self, s, step)]
        if at and steps and isinstance(body[steps[0]], cst.If) and at[0] < steps[0]:
            test = cst.ensure_type(body[steps[0]], cst.If).test
            why = _unsafe_condition(test, body[: steps[0]])
            return why if why else (code(test), steps[0])
        if not steps and step > self.lines_of(loop)[1]:
            return _range_last(loop)
        return "the optimizer step is neither under an `if` after the forward nor after a loop of micro-steps"


def _holds(visitor: RuleCodemod, stmt: cst.CSTNode, line: int) -> bool:
    start, end = visitor.lines_of(stmt)
    return start <= line <= end


def _range_last(loop: cst.For) -> tuple[str, None] | str:
    """`for m in range(N):` -> ("m == N - 1", None); else why not."""
    it = loop.iter
    ok = isinstance(it, cst.Call) and code(it.func) == "range" and isinstance(loop.target, cst.Name)
    args = list(it.args) if isinstance(it, cst.Call) else []
    if not ok or any(a.keyword or a.star for a in args) or not 1 <= len(args) <= 2:
        return "the micro-step loop is no `for NAME in range(N)`: mark its last micro-step by hand"
    if len(args) == 2 and code(args[0].value) != "0":
        return "the micro-step loop's range does not start at 0"
    bound = args[-1].value
    why = _unsafe_condition(bound, list(cst.ensure_type(loop.body, cst.IndentedBlock).body))
    if why:
        return why
    return f"{code(loop.target)} == {_atom(bound)} - 1", None


def _atom(node: cst.BaseExpression) -> str:
    text = code(node)
    return text if isinstance(node, cst.Name | cst.Attribute | cst.Integer | cst.Call) else f"({text})"


def _unsafe_condition(expr: cst.BaseExpression, before: list[cst.BaseStatement]) -> str | None:
    """Why `expr` cannot be evaluated before the micro-step's statements (None: it can)."""
    for call in nodes_of(expr, cst.Call):
        if code(call.func) not in PURE_CALLS:
            return f"the condition `{code(expr)}` calls {code(call.func)}(): it would run once more"
    assigned = {n for stmt in before for n in _assigned(stmt)}
    read = _read_names(expr) & assigned
    if read:
        return f"the condition reads {', '.join(sorted(read))}, which the micro-step assigns"
    return None


def _read_names(expr: cst.CSTNode) -> set[str]:
    attrs = {id(a.attr) for a in nodes_of(expr, cst.Attribute)}
    return {n.value for n in nodes_of(expr, cst.Name) if id(n) not in attrs}


def _assigned(stmt: cst.CSTNode) -> set[str]:
    """The names `stmt` binds (assignments, loop and `with ... as` targets, `:=`); attributes and
    subscripts bind none."""
    out: set[str] = set()
    for node in nodes_of(
        stmt, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For, cst.AsName, cst.NamedExpr)
    ):
        target = node.name if isinstance(node, cst.AsName) else node.target
        out |= _bound(target)
    return out


def _bound(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        return set().union(*(_bound(e.value) for e in target.elements))
    return set()
