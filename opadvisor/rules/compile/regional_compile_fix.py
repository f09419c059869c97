"""Codemod for `regional_compile`: compile a model's repeated blocks one at a time instead of the model whole.

Profile mode only (the blocks and the compile time are what the profile recorded at the `torch.compile`
call). Each target is the statement that compiled the model; its facts (`RegionalCompileFacts`) name the
containers of the blocks, relative to the compiled model. The statement becomes a loop that compiles each
block with the call's own arguments, and a name bound to the compiled model is bound to the model:

    model = torch.compile(model, mode="max-autotune")  ->  for block in model.blocks:
                                                               block.compile(mode="max-autotune")
    compiled = torch.compile(model)                     ->  for block in model.blocks:
                                                               block.compile()
                                                           compiled = model
    model.compile()                                     ->  for block in model.model.layers: ...

Several containers (an encoder's and a decoder's layers) are iterated together,
`for block in (*model.encoder.block, *model.decoder.block):`; a path through a numbered child is indexed
(`model.layers[0].blocks`). A comment line above the loop says what it does. The loop variable is `block`,
or the first of `block_`, `block_2`, ... that the file does not use.

Refused (left alone, with the reason): a compile inside a larger expression (`return torch.compile(m)`,
`Trainer(model=torch.compile(m))`), a model that is not a name or an attribute (`torch.compile(build())`),
the model passed by keyword, a statement line holding several statements, a file that reads the compiled
model's `_orig_mod` (which the model has not), and a block path that Python cannot spell as attributes and
indices.

Fix safety: safe (the same values; the modules outside the blocks run eagerly, which `verify` measures).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import code, imported_names, nodes_of, parent, qualified
from opadvisor.rules.compile_facts import RegionalCompileFacts

COMPILES = frozenset({"torch.compile"})
LOOP_NAME = "block"


def facts_of(target: Target) -> RegionalCompileFacts | None:
    return target_facts(target, RegionalCompileFacts)


def block_iterable(model: str, facts: RegionalCompileFacts) -> str | None:
    """The Python expression that iterates every block of `model` (None if a path cannot be spelled)."""
    containers = [_access(model, p) for p in facts.containers]
    singles = [_access(model, p) for p in facts.singles]
    if any(a is None for a in (*containers, *singles)) or not (containers or singles):
        return None
    if len(containers) == 1 and not singles:
        return containers[0]
    items = [*(f"*{c}" for c in containers), *singles]
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _access(model: str, path: str) -> str | None:
    """`model` + "layers.0.blocks" -> "model.layers[0].blocks"."""
    out = model
    for part in path.split("."):
        if part.isidentifier():
            out += f".{part}"
        elif part.isdigit():
            out += f"[{part}]"
        else:
            return None
    return out


class RegionalCompileCodemod(RuleCodemod):
    """A loop compiling each repeated block in place of the statement that compiled the model whole."""

    RULE: ClassVar[str] = "regional_compile"
    FACTS = RegionalCompileFacts
    STATIC_MODE: ClassVar[bool] = False  # the blocks are what the profile recorded at the compile call
    SAFETY: ClassVar[str] = "safe"
    COMPOSES: ClassVar[bool] = True  # recompile's `dynamic=True` on the same call is passed on to the blocks
    NO_KERNEL_OP: ClassVar[str] = "regional compilation changes what torch.compile compiles, not its ops"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self._top_imports: set[str] = set()
        self._names: set[str] = set()  # every name the file uses: the loop variable must be new
        self._reads_orig_mod = False

    def visit_Module(self, node: cst.Module) -> bool:
        if self.targets is None:
            return False  # static mode: nothing to do
        self._top_imports = set().union(*map(imported_names, node.body))
        source = node.code
        self._reads_orig_mod = "_orig_mod" in source
        self._names = {n.value for n in nodes_of(node, cst.Name)}
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for target in self.targets or []:
            if target not in self.answered:
                why = (
                    "the finding carries no regional-compile facts (profile again with this version)"
                    if facts_of(target) is None
                    else "no torch.compile(model) or model.compile() statement on these lines"
                )
                self.skipped.append(Note(target.line, why))
        self.changes.sort(key=lambda n: n.line)
        self.skipped.sort(key=lambda n: n.line)
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        targets = self._targets_on(original_node)
        if not targets:
            return updated_node
        facts = facts_of(targets[0])
        if facts is None:
            return updated_node
        self.answered.update(targets)
        found = self._compile_of(original_node, updated_node)
        if isinstance(found, str):
            self.skipped.extend(Note(t.line, found) for t in targets)
            return updated_node
        model, bound, args, layout = found
        iterable = block_iterable(model, facts)
        if iterable is None:
            self.skipped.extend(Note(t.line, "a block's path is no attribute or index") for t in targets)
            return updated_node
        self.changes.extend(
            Note(
                t.line,
                f"each of {facts.count} {facts.block} blocks compiled on its own (regional compilation)",
            )
            for t in targets
        )
        loop = self._loop(updated_node, facts, iterable, (args, layout), model, bound)
        return cst.FlattenSentinel(loop)

    def _targets_on(self, node: cst.CSTNode) -> list[Target]:
        start, end = self.lines_of(node)
        return [t for t in self.targets or [] if start <= t.end_line and t.line <= end]

    def _compile_of(
        self, original: cst.SimpleStatementLine, line: cst.SimpleStatementLine
    ) -> tuple[str, str | None, list[cst.Arg], cst.BaseParenthesizableWhitespace] | str:
        """(the model's expression, the name the compiled model is bound to (None: the model's own), the
        arguments for each block's compile: another fix may have added one, and the whitespace before
        them: a call written one argument a line stays so), or why the statement is not
        rewritten. Names resolve on the original statement (the updated one has no metadata)."""
        if len(line.body) != 1 or len(original.body) != 1:
            return "several statements on the line: compile the blocks by hand"
        if self._reads_orig_mod:
            return "the file reads the compiled model's `_orig_mod`, which the model itself has not"
        stmt = line.body[0]
        value = stmt.value if isinstance(stmt, cst.Assign | cst.Expr) else None
        if not isinstance(value, cst.Call):
            return "the compile is inside a larger expression: compile the blocks by hand"
        first = original.body[0]
        if isinstance(first, cst.Assign | cst.Expr) and isinstance(first.value, cst.Call):
            is_torch_compile = self._is_torch_compile(first.value.func)
        else:
            is_torch_compile = False
        if is_torch_compile:
            if not isinstance(stmt, cst.Assign) or len(stmt.targets) != 1:
                return "torch.compile(...)'s result is not assigned to one name"
            model_arg = (
                value.args[0] if value.args and not value.args[0].keyword and not value.args[0].star else None
            )
            if model_arg is None:
                return "the model is not torch.compile's first positional argument"
            model, bound = code(model_arg.value), code(stmt.targets[0].target)
            args = list(value.args[1:])
        elif (
            isinstance(value.func, cst.Attribute)
            and value.func.attr.value == "compile"
            and isinstance(stmt, cst.Expr)
        ):
            model, bound, args = code(value.func.value), None, list(value.args)
        elif self._compiles_inside(first):
            return "the compile is inside a larger expression: compile the blocks by hand"
        else:
            return "no torch.compile(model) or model.compile() here"
        if self._loop_variable_of(original) == model:
            return f"`{model}` is a block of a loop: compiled block by block already"
        if not _simple(cst.parse_expression(model)):
            return f"the model `{model}` is no name or attribute (it would be evaluated twice)"
        if model.split(".")[0] in self._top_imports and model.split(".")[0] != "torch":
            return f"`{model}` is an imported module"
        return model, (None if bound == model else bound), args, value.whitespace_before_args

    def _loop_variable_of(self, stmt: cst.SimpleStatementLine) -> str | None:
        """The variable of the `for` loop whose body `stmt` is (the loop this codemod writes)."""
        block = parent(self, stmt)
        loop = parent(self, block) if isinstance(block, cst.IndentedBlock) else None
        return code(loop.target) if isinstance(loop, cst.For) else None

    def _is_torch_compile(self, func: cst.BaseExpression) -> bool:
        return bool(qualified(self, func) & COMPILES)

    def _compiles_inside(self, stmt: cst.CSTNode) -> bool:
        """Whether a torch.compile(...) call is nested somewhere in `stmt` (an original node)."""
        calls = nodes_of(stmt, cst.Call)
        return any(self._is_torch_compile(c.func) for c in calls)

    def _loop(
        self,
        line: cst.SimpleStatementLine,
        facts: RegionalCompileFacts,
        iterable: str,
        call: tuple[list[cst.Arg], cst.BaseParenthesizableWhitespace],
        model: str,
        bound: str | None,
    ) -> list[cst.BaseStatement]:
        args, layout = call
        var = self._loop_variable()
        loop = cst.ensure_type(
            cst.parse_statement(f"for {var} in {iterable}:\n    {var}.compile()\n"), cst.For
        )
        loop = loop.with_deep_changes(
            _compile_call(loop), args=_without_trailing_comma(args), whitespace_before_args=layout
        )
        comment = cst.EmptyLine(
            comment=cst.Comment(
                f"# regional compilation: one compiled {facts.block} shared by its {facts.count} instances "
                "(opadvisor regional_compile)"
            )
        )
        trailing = line.trailing_whitespace
        loop = loop.with_changes(leading_lines=[*line.leading_lines, comment])
        if trailing.comment is not None:
            loop = loop.with_changes(body=loop.body.with_changes(header=trailing))
        out: list[cst.BaseStatement] = [loop]
        if bound is not None:
            out.append(cst.parse_statement(f"{bound} = {model}\n"))
        return out

    def _loop_variable(self) -> str:
        for name in (LOOP_NAME, f"{LOOP_NAME}_", *(f"{LOOP_NAME}_{i}" for i in range(2, 100))):
            if name not in self._names:
                return name  # loops in one scope may share it: each leaves it bound to a block
        return f"{LOOP_NAME}_compiled"


def _compile_call(loop: cst.For) -> cst.Call:
    stmt = cst.ensure_type(cst.ensure_type(loop.body, cst.IndentedBlock).body[0], cst.SimpleStatementLine)
    return cst.ensure_type(cst.ensure_type(stmt.body[0], cst.Expr).value, cst.Call)


def _without_trailing_comma(args: list[cst.Arg]) -> list[cst.Arg]:
    """The arguments as written (comments and line breaks kept), less a comma after the last one
    when the arguments lost their first (the model) and it ended the call on one line."""
    if not args:
        return []
    last = args[-1]
    if isinstance(last.comma, cst.Comma) and "\n" not in code(last.comma):
        args = [*args[:-1], last.with_changes(comma=cst.MaybeSentinel.DEFAULT)]
    return args


def _simple(node: cst.BaseExpression) -> bool:
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)
