"""Codemod for `graph_break`: remove the torch.compile graph breaks a profile found, at their lines.

Profile mode only (the breaks are what dynamo reported while the script ran: static mode rewrites
nothing). Each target is the statement holding one break; its facts (`GraphBreakFacts`) say the kind:

- "print": `print(...)` of a tensor (or `logging.info(...)`, any module-level function of `logging`) is made
  reorderable, once per file, after the file's imports:

      torch._dynamo.config.reorderable_logging_functions.add(print)

  dynamo then runs the print after the graph, with the same values. Refused: a logger's method
  (`logger.info`: a bound method, not a function dynamo can match), a logging function not imported at the
  top of the file, and a print that formats its values into a string (an f-string, `%`, `.format`, `str()`):
  under the reorder dynamo formats the number, not the tensor, so the text would differ.
- "scalar_read": `v = t.item()` (`float(t)`, `int(t)`) whose every read in its function is an operand of
  arithmetic with another value, an argument of a `torch.*` call, the value of an augmented assignment or
  a returned value becomes `v = t.detach()` (`float(t)` -> `t.detach().float()`, `int(t)` ->
  `t.detach().long()`, which truncate as they do; `.clone()` before the conversion where `t` may share
  memory with another tensor, a name, an index or a view, as `.item()` copied the number): the number stays a
  0-d tensor on the device, with no gradient through it, as `.item()` gave none. Elsewhere (a read as a
  Python number: a comparison, an index, `range(v)`, a call of another function, a read in a nested
  function; a scalar read that is not such an assignment) dynamo is told to trace scalar reads, once per
  file, after the imports: `torch._dynamo.config.capture_scalar_outputs = True` (left as it is where the
  file sets it already, to any value).
- "tensor_branch": `if c: y = a` [`else: y = b`] (or `y op= a`) becomes `y = torch.where(c, a, b)`
  (`b` is `y` itself without an `else`; `y op a` for an augmented assignment, now out of place); the `if`'s
  comments stay, as comment lines above (the assignment's own on its line). Refused: an `elif`, a branch
  of several statements or anything but one assignment to one name (a `return`, a call), an `else` that
  assigns another name, a call in the condition or a branch that is not a `torch.*`/`math.*` function or a
  tensor's out-of-place method (a module call, a helper: both branches would run), an in-place method,
  a method that changes the shape or dtype (`sum`, `view`, `float`: `torch.where` would broadcast the
  two), `and`/`or`/`not` in the condition (they read the tensor as a bool), a name not bound before the
  `if` (no `else`), an augmented assignment to a parameter of the function (its in-place update reaches the
  caller), and a `while` on a tensor.
- "unsupported_call": the smallest function (`def`) around the break's line gets `@torch.compiler.disable`
  (innermost decorator): dynamo runs it eagerly instead of breaking inside it (one break at its call, the
  graphs around it whole). Refused: a line outside any function, and the compiled function itself
  (`facts.compiled_function`/`compiled_line`, or a function decorated with `torch.compile`; without those
  facts, a `forward`): disabling it would turn compilation off for all of it.
- "other": nothing; the break gets advice only.

`torch` is spelled as the file imports it (`import torch as th`); `import torch` is added where the file has
none. Re-running is a no-op: a config line already in the file (any value) is not added again, a function
already decorated with `torch.compiler.disable` (or `torch._dynamo.disable`) is left.

Fix safety: safe (the same values and gradients). `torch.where` computes both branches: where a branch
would produce inf or nan that the `if` avoided, its gradient reaches the other (the rule says so); scalar
arithmetic on a kept number runs in the tensor's dtype instead of Python's double (equal up to rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import (
    FunctionScope,
    ParentNodeProvider,
    PositionProvider,
    QualifiedNameProvider,
    ScopeProvider,
)

from opadvisor.rewrite.base import Note, RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import (
    after_imports,
    assignment,
    block_index,
    block_statements,
    branch_value,
    check_budget,
    code,
    comments_of,
    config_block,
    imported_names,
    kept_tensor,
    nodes_of,
    number_value,
    parent,
    qualified,
    scalar_read,
    torch_binding,
    where_call,
)
from opadvisor.rules.compile_facts import GraphBreakFacts

SCALAR_SETTING = "torch._dynamo.config.capture_scalar_outputs"
REORDERABLE_ADD = "torch._dynamo.config.reorderable_logging_functions.add"
DISABLES = frozenset({"torch.compiler.disable", "torch._dynamo.disable", "torch._dynamo.eval_frame.disable"})
COMPILES = frozenset({"torch.compile"})
LOGGING_FUNCTIONS = frozenset(
    f"logging.{name}"
    for name in ("debug", "info", "warning", "warn", "error", "critical", "exception", "log")
)
LOGGER_METHODS = frozenset(name.partition(".")[2] for name in LOGGING_FUNCTIONS)
STRING_FORMATTERS = frozenset({"builtins.str", "builtins.repr", "builtins.format"})
# tensor methods a branch of `torch.where` must not call: they change the shape or dtype (torch.where then
# broadcasts or promotes the two branches); the condition may (`y.max() > 0`)
SHAPE_OR_DTYPE = frozenset(
    {
        *("sum", "mean", "max", "min", "amax", "amin", "prod", "norm", "std", "var", "any", "all"),
        *("view", "reshape", "flatten", "squeeze", "unsqueeze", "transpose", "permute", "t", "expand"),
        *("repeat", "to", "type", "float", "double", "half", "bfloat16", "long", "int", "bool", "cpu"),
        *("cuda", "argmax", "argmin", "size", "dim", "numel"),
    }
)
# calls that leave the graph or act on the world: never in a torch.where
NOT_TRACEABLE = frozenset({"item", "tolist", "numpy", "backward", "print"})
PRINT_COMMENT = (
    "# torch.compile runs these prints after the graph instead of breaking it (opadvisor graph_break)"
)
SCALAR_COMMENT = "# torch.compile traces .item() reads instead of breaking the graph (opadvisor graph_break)"


def facts_of(target: Target) -> GraphBreakFacts | None:
    return target_facts(target, GraphBreakFacts)


def _break_line(target: Target, facts: GraphBreakFacts) -> int:
    """The line dynamo broke at; the target's first line where the facts do not say, or where their line is
    outside the target (an earlier rewrite moved the target's lines, and the engine moves only those)."""
    if facts.line is not None and target.line <= facts.line <= target.end_line:
        return facts.line
    return target.line


class GraphBreakCodemod(RuleCodemod):
    """Per break kind: a reorderable print, a kept 0-d tensor or scalar capture, torch.where, a disabled helper."""

    RULE: ClassVar[str] = "graph_break"
    FACTS = GraphBreakFacts
    STATIC_MODE: ClassVar[bool] = False  # the breaks are what dynamo reported while the script ran
    SAFETY: ClassVar[str] = "safe"
    NO_KERNEL_OP: ClassVar[str] = (
        "the fixes change what torch.compile traces (a config line, torch.where, a disabled helper): "
        "PyTorch's own ops run"
    )
    METADATA_DEPENDENCIES: ClassVar[tuple] = (
        PositionProvider,
        QualifiedNameProvider,
        ParentNodeProvider,
        ScopeProvider,
    )

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self._torch: str | None = None  # the name the file imports torch as
        self._top_imports: set[str] = set()
        self._existing: dict[str, tuple[int, str]] = {}  # config key -> (its line, the value it sets)
        # the config lines to add, in order: a function made reorderable (as the file spells it), SCALAR_SETTING
        self._wanted: dict[str, None] = {}
        self._handled: set[int] = set()  # ids of the targets dealt with (`_answer`)

    # ---- the module: what it imports and sets, and the config lines at the end ------------------------------
    def visit_Module(self, node: cst.Module) -> bool:
        self._torch = next((b for b in map(torch_binding, node.body) if b), None)
        self._top_imports = set().union(*map(imported_names, node.body))
        self._existing = self._settings(node)
        return self.targets is not None  # static mode: nothing to do

    def _settings(self, module: cst.Module) -> dict[str, tuple[int, str]]:
        """The config lines already at the file's top level: capture_scalar_outputs and reorderable functions."""
        found: dict[str, tuple[int, str]] = {}
        for stmt in module.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            line = self.lines_of(stmt)[0]
            for small in stmt.body:
                if isinstance(small, cst.Assign) and any(
                    SCALAR_SETTING in qualified(self, t.target) for t in small.targets
                ):
                    found[SCALAR_SETTING] = (line, code(small.value))
                elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                    call = small.value
                    if REORDERABLE_ADD in qualified(self, call.func) and len(call.args) == 1:
                        found[code(call.args[0].value)] = (line, "added")
        return found

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.targets is None:
            return updated_node
        for target in self.targets:
            facts = facts_of(target)
            if facts is not None and facts.kind == "scalar_read" and id(target) not in self._handled:
                self._capture_scalars(target, "the read is in a compound statement's header")
        for target in self.targets:
            reason = self._unreached(target) if id(target) not in self._handled else None
            if reason is not None:
                self.skipped.append(Note(target.line, reason))
        self.changes.sort(key=lambda n: n.line)
        self.skipped.sort(key=lambda n: n.line)
        if not self._wanted:
            return updated_node
        body = list(updated_node.body)
        functions = [key for key in self._wanted if key != SCALAR_SETTING]
        at = after_imports(body, {"torch", *(fn.split(".")[0] for fn in functions)})
        return updated_node.with_changes(body=[*body[:at], *self._config_lines(functions), *body[at:]])

    def _config_lines(self, functions: list[str]) -> list[cst.BaseStatement]:
        """The lines asked for, spelling torch as the file does: the functions made reorderable, then the
        scalar capture, each group after a comment that says why."""
        torch = self._torch_name()
        reorderable = [f"{torch}._dynamo.config.reorderable_logging_functions.add({fn})" for fn in functions]
        capture = (
            [f"{torch}._dynamo.config.capture_scalar_outputs = True"]
            if SCALAR_SETTING in self._wanted
            else []
        )
        return config_block(
            [(c, lines) for c, lines in ((PRINT_COMMENT, reorderable), (SCALAR_COMMENT, capture)) if lines]
        )

    def _unreached(self, target: Target) -> str | None:
        facts = facts_of(target)
        if facts is None:
            return "the finding carries no graph-break facts (profile again with this version)"
        line = _break_line(target, facts)
        if facts.kind == "other":
            return f"dynamo's reason: {facts.reason or 'not recorded'}: this kind of break gets advice only"
        return {
            "print": f"no print or logging call at line {line} to make reorderable",
            "tensor_branch": f"no `if` on a tensor at line {line} to rewrite",
            "unsupported_call": f"line {line} is not inside a function to run eagerly",
        }.get(facts.kind, f"no fix for a {facts.kind!r} break")

    def _torch_name(self) -> str:
        """The file's name for torch; `import torch` is added where it has none."""
        if self._torch is None:
            AddImportsVisitor.add_needed_import(self.context, "torch")
            self._torch = "torch"
        return self._torch

    def _answer(self, target: Target) -> None:
        """`target` is dealt with (by identity: two findings on one line are equal Targets)."""
        self.answered.add(target)
        self._handled.add(id(target))

    def _want(self, key: str) -> None:
        self._wanted.setdefault(key, None)

    # ---- which targets a node answers ------------------------------------------------------------------------
    def _targets_at(self, node: cst.CSTNode, kind: str) -> list[tuple[Target, GraphBreakFacts]]:
        """The unanswered targets of `kind` whose break line lies in `node`'s lines."""
        if not self.targets:
            return []
        start, end = self.lines_of(node)
        found = []
        for target in self.targets:
            facts = facts_of(target)
            if facts is not None and facts.kind == kind and id(target) not in self._handled:
                if (
                    start <= _break_line(target, facts) <= end
                    and target.line <= end
                    and start <= target.end_line
                ):
                    found.append((target, facts))
        return found

    # ---- "print" and "scalar_read": the statement holding the break ------------------------------------------
    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        for target, _ in self._targets_at(original_node, "print"):
            self._print(original_node, target)
        for target, _ in self._targets_at(original_node, "scalar_read"):
            self._answer(target)
            updated_node = self._scalar(original_node, updated_node, target)
        return updated_node

    def _print(self, stmt: cst.SimpleStatementLine, target: Target) -> None:
        calls = [s.value for s in stmt.body if isinstance(s, cst.Expr) and isinstance(s.value, cst.Call)]
        call = next((c for c in calls if self._logging_function(c) is not None), None)
        if call is None:
            method = next((c for c in calls if _logger_method(c)), None)
            if method is not None:
                self._answer(target)
                self.skip(
                    stmt,
                    f"{code(method.func)}(...) is a logger's method: dynamo reorders only the functions in "
                    "reorderable_logging_functions (use logging.info, or log after the compiled code)",
                )
            return  # _unreached says so
        self._answer(target)
        fn = self._logging_function(call)
        assert fn is not None
        reason = self._print_refusal(call, fn)
        if reason is not None:
            self.skip(stmt, reason)
        elif fn in self._existing:
            self.skip(stmt, f"the file already makes {fn} reorderable (line {self._existing[fn][0]})")
        else:
            self._want(fn)
            self.changes.append(
                Note(
                    target.line,
                    f"{fn} made reorderable (torch._dynamo.config.reorderable_logging_functions.add({fn})): "
                    "dynamo runs it after the graph, with the same values",
                )
            )

    def _logging_function(self, call: cst.Call) -> str | None:
        """The call's function as the file spells it, for print or a module-level logging function."""
        names = qualified(self, call.func)
        if "builtins.print" in names:
            return "print"
        if names & LOGGING_FUNCTIONS:
            return code(call.func)
        return None

    def _print_refusal(self, call: cst.Call, fn: str) -> str | None:
        if fn != "print" and fn.split(".")[0] not in self._top_imports:
            return f"{fn} is not imported at the top of the file, where the config line goes"
        for arg in call.args:
            if self._formats(arg.value):
                return (
                    f"{fn}(...) formats its values into a string ({code(arg.value)[:40]}) in the compiled code: "
                    "under the reorder dynamo would format the number, not the tensor; pass the tensors as "
                    f'arguments of their own ({fn}("loss", loss))'
                )
        return None

    def _formats(self, value: cst.BaseExpression) -> bool:
        """An f-string with values, `"..." % x`, `"...".format(x)` or `str(x)`/`repr(x)`/`format(x)`."""
        if any(nodes_of(value, cst.FormattedStringExpression)):
            return True
        for op in nodes_of(value, cst.BinaryOperation):
            if isinstance(op.operator, cst.Modulo) and isinstance(op.left, cst.SimpleString):
                return True
        for call in nodes_of(value, cst.Call):
            if qualified(self, call.func) & STRING_FORMATTERS:
                return True
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "format":
                return True
        return False

    def _scalar(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, target: Target
    ) -> cst.SimpleStatementLine:
        small = original.body[0] if len(original.body) == 1 else None
        read = None
        if (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
        ):
            read = scalar_read(small.value)
        if read is None and not any(_reads_scalar(c) for c in nodes_of(original, cst.Call)):
            self.skip(original, "no scalar read (.item(), float(t), int(t), .tolist()) on this line")
            return updated
        why = (
            "not an assignment `v = t.item()`"
            if read is None
            else self._scalar_refusal(small.targets[0].target)  # type: ignore[union-attr]
        )
        if why is not None:
            self._capture_scalars(target, why)
            return updated
        form, tensor = read
        name = small.targets[0].target.value  # type: ignore[union-attr]
        kept = kept_tensor(form, tensor)
        shown = {
            "item": f"{code(tensor)}.item()",
            "float": f"float({code(tensor)})",
            "int": f"int({code(tensor)})",
        }
        self.changes.append(
            Note(
                target.line,
                f"{name} = {shown[form]} -> {name} = {code(kept)}: the number stays a 0-d tensor on the "
                f"device (no read of {name} needs a Python number), no break",
            )
        )
        new_assign = updated.body[0].with_changes(value=kept)  # type: ignore[union-attr]
        return updated.with_changes(body=[new_assign])

    def _capture_scalars(self, target: Target, why: str) -> None:
        """`capture_scalar_outputs = True` after the imports (once), unless the file sets it already."""
        self._answer(target)
        existing = self._existing.get(SCALAR_SETTING)
        if existing is not None:
            line, value = existing
            what = "sets it to False, left as the user chose" if value == "False" else "already sets it"
            self.skipped.append(Note(target.line, f"capture_scalar_outputs: the file {what} (line {line})"))
            return
        self._want(SCALAR_SETTING)
        self.changes.append(
            Note(
                target.line,
                "torch._dynamo.config.capture_scalar_outputs = True: dynamo traces the scalar read instead of "
                f"breaking the graph (the number stays a Python number: {why})",
            )
        )

    def _scalar_refusal(self, name: cst.Name) -> str | None:
        """Why `name`'s value must stay a Python number (a read that is not tensor arithmetic), or None."""
        scope = self.get_metadata(ScopeProvider, name, None)
        if not isinstance(scope, FunctionScope):
            return "not in a function"
        binding = next((a for a in scope.assignments[name.value] if getattr(a, "node", None) is name), None)
        if binding is None:
            return "its binding is not known"
        for access in binding.references:
            check_budget()
            if access.scope is not scope:
                return f"{name.value} is read in a nested function or comprehension"
            if not self._feeds_tensors(access.node):
                return f"{name.value} is read as a Python number"
        return None

    def _feeds_tensors(self, read: cst.CSTNode) -> bool:
        """Whether this read of the number is tensor work: an operand of arithmetic with another value, an
        argument of a torch.* call, the value of an augmented assignment, or returned."""
        top, others = read, []
        above = parent(self, top)
        while isinstance(above, cst.BinaryOperation) or (
            isinstance(above, cst.UnaryOperation) and isinstance(above.operator, cst.Minus | cst.Plus)
        ):
            if isinstance(above, cst.BinaryOperation):
                others.append(above.right if above.left is top else above.left)
            top, above = above, parent(self, above)
        if isinstance(above, cst.Return) or (isinstance(above, cst.AugAssign) and above.value is top):
            return True
        if isinstance(above, cst.Arg) and above.value is top:
            call = parent(self, above)
            if isinstance(call, cst.Call) and any(q.startswith("torch.") for q in qualified(self, call.func)):
                return True
        return any(number_value(other) is None for other in others)

    # ---- "tensor_branch": `if c: y = a` -> `y = torch.where(c, a, y)` ---------------------------------------
    def leave_If(self, original_node: cst.If, updated_node: cst.If) -> cst.BaseStatement:
        hits = self._targets_at_header(original_node, original_node.test)
        if not hits:
            return updated_node
        for target in hits:
            self._answer(target)
        reason = self._branch_refusal(original_node)
        if reason is not None:
            self.skip(original_node, reason)
            return updated_node
        return self._where(updated_node, hits[0])

    def leave_While(self, original_node: cst.While, updated_node: cst.While) -> cst.BaseStatement:
        for target in self._targets_at_header(original_node, original_node.test):
            self._answer(target)
            self.skip(
                original_node,
                "a while loop on a tensor's value cannot become torch.where: bound its iterations, or run the "
                "loop outside the compiled code",
            )
        return updated_node

    def _targets_at_header(self, node: cst.If | cst.While, test: cst.BaseExpression) -> list[Target]:
        """The tensor_branch targets whose break line is the statement's `if`/`while` line (its test)."""
        start, end = self.lines_of(node)[0], self.lines_of(test)[1]
        return [
            t for t, facts in self._targets_at(node, "tensor_branch") if start <= _break_line(t, facts) <= end
        ]

    def _branch_refusal(self, node: cst.If) -> str | None:
        above = parent(self, node)
        if isinstance(above, cst.If) and above.orelse is node or isinstance(node.orelse, cst.If):
            return (
                "an if/elif chain: torch.where takes one condition (rewrite it by hand, nesting torch.where)"
            )
        body = branch_value_of(node.body)
        if body is None:
            return (
                "the if's body is not exactly one assignment to a name (torch.where takes one value a branch)"
            )
        name, _ = body
        if node.orelse is not None:
            other = branch_value_of(node.orelse.body)
            if other is None or other[0] != name:
                return f"the else is not exactly one assignment to {name}"
        reason = self._impure(node)
        if reason is not None:
            return reason
        if node.orelse is None and not self._bound_before(node, name):
            return f"{name} is not bound before the if (no else to take its value from)"
        return self._augmented_parameter(node, name)

    def _impure(self, node: cst.If) -> str | None:
        """Why the condition and branches cannot all run as one expression: an and/or/not, a call with side
        effects, a branch whose call changes the shape or dtype."""
        if nodes_of(node.test, cst.BooleanOperation) or any(
            isinstance(op.operator, cst.Not) for op in nodes_of(node.test, cst.UnaryOperation)
        ):
            return "the condition uses and/or/not, which read the tensor as a bool: write it with & | ~"
        for part, in_branch in ((node.test, False), *((s, True) for s in _branch_statements(node))):
            for call in nodes_of(part, cst.Call):
                method = code(call.func).rpartition(".")[2]
                if not self._pure_call(call) or method in NOT_TRACEABLE:
                    return f"{code(call.func)}(...) may have side effects (torch.where runs both branches)"
                if in_branch and method in SHAPE_OR_DTYPE:
                    return (
                        f"{code(call.func)}(...) may change the shape or dtype of a branch (torch.where would "
                        "broadcast the two)"
                    )
        return None

    def _pure_call(self, call: cst.Call) -> bool:
        """A torch.*/math.* function or a method of a value (not of `self`: a module), neither in place."""
        names = qualified(self, call.func)
        in_place = code(call.func).endswith("_")
        if any(n.startswith(("torch.", "math.")) for n in names):
            return not in_place
        func = call.func
        if not isinstance(func, cst.Attribute):  # a plain function
            return False
        root = func.value
        while isinstance(root, cst.Attribute | cst.Call | cst.Subscript):
            root = root.func if isinstance(root, cst.Call) else root.value
        imported = isinstance(root, cst.Name) and root.value in self._top_imports  # np.exp, np.random.rand
        module_call = isinstance(func.value, cst.Name) and func.value.value == "self"  # self.proj(x)
        return not (in_place or imported or module_call)

    def _bound_before(self, node: cst.If, name: str) -> bool:
        """Whether `name` is bound before the `if` in its function: a parameter, or a statement of an
        enclosing block before the one holding the `if`."""
        child: cst.CSTNode = node
        above = parent(self, child)
        while above is not None and not isinstance(above, cst.Module):
            check_budget()
            if isinstance(above, cst.IndentedBlock):
                index = next((i for i, s in enumerate(above.body) if s is child), None)
                if index is not None and block_index(above.body).lookup(name, before=index) is not None:
                    return True
            if isinstance(above, cst.FunctionDef):
                return name in _parameters(above)
            child, above = above, parent(self, above)
        return False

    def _augmented_parameter(self, node: cst.If, name: str) -> str | None:
        statements = _branch_statements(node)
        augmented = any(isinstance(s.body[0], cst.AugAssign) for s in statements)  # type: ignore[attr-defined]
        function = self._enclosing_function(node)
        if augmented and function is not None and name in _parameters(function):
            return (
                f"{name} is a parameter updated in place: the caller sees the change, which torch.where "
                "(out of place) would not make"
            )
        return None

    def _where(self, node: cst.If, target: Target) -> cst.SimpleStatementLine:
        name, value = branch_value_of(node.body)  # type: ignore[misc]
        other = branch_value_of(node.orelse.body)[1] if node.orelse is not None else cst.Name(name)  # type: ignore[index,union-attr]
        torch = self._torch_name()
        where = cst.Attribute(value=cst.Name(torch), attr=cst.Name("where"))
        call = where_call(where, node.test, value, other)
        first = _branch_statements(node)[0]
        trailing = first.trailing_whitespace.comment  # type: ignore[attr-defined]
        inner = [c for c in comments_of(node.with_changes(leading_lines=[])) if c is not trailing]
        leading = [*node.leading_lines, *(cst.EmptyLine(comment=c) for c in inner)]
        self.changes.append(
            Note(
                target.line,
                f"if {code(node.test)}: {name} = ... -> {name} = {torch}.where(...): one graph, both branches "
                "computed",
            )
        )
        return assignment(name, call, leading, trailing)

    # ---- "unsupported_call": @torch.compiler.disable on the smallest function around the break --------------
    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        hits = self._targets_at(original_node, "unsupported_call")
        if not hits:
            return updated_node
        for target, _ in hits:
            self._answer(target)
        target, facts = hits[0]
        reason = self._disable_refusal(original_node, facts)
        if reason is not None:
            for t, _ in hits:
                self.skipped.append(Note(t.line, reason))
            return updated_node
        torch = self._torch_name()
        disable = cst.Decorator(decorator=cst.parse_expression(f"{torch}.compiler.disable"))
        name = original_node.name.value
        for t, f in hits:
            self.changes.append(
                Note(
                    t.line,
                    f"@{torch}.compiler.disable on {name}(): dynamo runs it eagerly instead of breaking inside "
                    f"it ({f.reason or 'an untraceable call'})",
                )
            )
        return updated_node.with_changes(decorators=[*updated_node.decorators, disable])

    def _disable_refusal(self, node: cst.FunctionDef, facts: GraphBreakFacts) -> str | None:
        name = node.name.value
        decorators = [
            d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator for d in node.decorators
        ]
        if any(qualified(self, d) & DISABLES for d in decorators):
            return f"{name}() is already decorated with torch.compiler.disable"
        if facts.function is not None and facts.function != name:
            return f"the function around the break is {name}(), the profile names {facts.function}(): profile again"
        if self._is_compiled(node, decorators, facts):
            return (
                f"the break is in {name}(), the compiled function itself: disabling it would turn compilation "
                "off for all of it; move the untraceable call into a helper function"
            )
        return None

    def _is_compiled(
        self, node: cst.FunctionDef, decorators: list[cst.BaseExpression], facts: GraphBreakFacts
    ) -> bool:
        """Whether `node` is the function torch.compile compiled: the facts say the break's function is the
        compiled one (by name, and by `def` line where both are known), its lines hold the compiled line, it
        is decorated with torch.compile, or (no compiled function known) it is a `forward`."""
        name = node.name.value
        if any(qualified(self, d) & COMPILES for d in decorators):
            return True
        if facts.compiled_function is None:
            return name == "forward"
        lines = (facts.function_line, facts.compiled_line)
        if facts.function == facts.compiled_function == name and (None in lines or lines[0] == lines[1]):
            return True
        def_line = self.lines_of(node)[0]
        first_line = self.lines_of(node.decorators[0])[0] if node.decorators else def_line
        return facts.compiled_function == name and (
            facts.compiled_line is None or first_line <= facts.compiled_line <= def_line
        )

    def _enclosing_function(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        above = parent(self, node)
        while above is not None and not isinstance(above, cst.FunctionDef):
            above = parent(self, above)
        return above


def branch_value_of(block: cst.BaseSuite) -> tuple[str, cst.BaseExpression] | None:
    statements = block_statements(block)
    return branch_value(statements[0]) if len(statements) == 1 else None


def _branch_statements(node: cst.If) -> list[cst.BaseStatement]:
    statements = list(block_statements(node.body))
    if node.orelse is not None:
        statements.extend(block_statements(node.orelse.body))
    return statements


def _parameters(function: cst.FunctionDef) -> set[str]:
    params = function.params
    every = [*params.posonly_params, *params.params, *params.kwonly_params]
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            every.append(star)
    return {p.name.value for p in every}


def _reads_scalar(call: cst.Call) -> bool:
    """`t.item()`, `float(t)`, `int(t)` or `t.tolist()`."""
    func = call.func
    return scalar_read(call) is not None or (isinstance(func, cst.Attribute) and func.attr.value == "tolist")


def _logger_method(call: cst.Call) -> bool:
    """`logger.info(...)`, `self.log.warning(...)`: a logging level called as a method of an object."""
    return isinstance(call.func, cst.Attribute) and call.func.attr.value in LOGGER_METHODS
