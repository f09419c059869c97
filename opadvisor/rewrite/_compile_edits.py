"""Source edits the torch.compile fixes share (graph_break, recompile): the name the file imports torch as
(fp32_gemm reads it too), the top-level config lines (found and placed), the forms of a scalar read, and
`torch.where` for an `if`.

Everything here reads or builds libcst nodes; the codemods decide where (from the profile's targets).
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m

from opadvisor.rewrite._match import code, unparen

# ---- the file's imports ------------------------------------------------------------------------------------


def torch_binding(stmt: cst.BaseStatement) -> str | None:
    """The name a top-level `import torch` / `import torch as th` / `import torch.nn` statement binds."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return None
    for small in stmt.body:
        if isinstance(small, cst.Import):
            for alias in small.names:
                name = code(alias.name)
                if alias.asname is None and name.split(".")[0] == "torch":
                    return "torch"
                if alias.asname is not None and name == "torch":
                    return alias.asname.name.value  # type: ignore[union-attr]
    return None


def imported_names(stmt: cst.BaseStatement) -> set[str]:
    """The names a top-level import statement binds (`import a.b` binds a, `from x import y as z` binds z)."""
    names: set[str] = set()
    if not isinstance(stmt, cst.SimpleStatementLine):
        return names
    for small in stmt.body:
        if isinstance(small, cst.Import | cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
            for alias in small.names:
                names.add(alias.evaluated_alias or code(alias.name).split(".")[0])
    return names


def _is_import_line(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]))


def after_docstring_and_imports(body: Sequence[cst.BaseStatement]) -> int:
    """The index of the first top-level statement after the module docstring and the leading imports."""
    at = 1 if body and _is_docstring(body[0]) else 0
    while at < len(body) and _is_import_line(body[at]):
        at += 1
    return at


def after_imports(body: Sequence[cst.BaseStatement], names: set[str]) -> int:
    """Where top-level lines go: after the docstring and the leading imports, and after the statements
    that import `names` (the lines read them), wherever those come."""
    at = after_docstring_and_imports(body)
    for i, stmt in enumerate(body):
        if imported_names(stmt) & names or ("torch" in names and torch_binding(stmt)):
            at = max(at, i + 1)
    return at


def config_block(groups: Sequence[tuple[str, Sequence[str]]]) -> list[cst.BaseStatement]:
    """The statements of `groups` ((comment, lines) each), a blank line and the comment before each group."""
    out: list[cst.BaseStatement] = []
    for comment, lines in groups:
        for i, line in enumerate(lines):
            stmt = cst.parse_statement(line)
            if i == 0:
                stmt = stmt.with_changes(
                    leading_lines=[cst.EmptyLine(), cst.EmptyLine(comment=cst.Comment(comment))]
                )
            out.append(stmt)
    return out


# ---- scalar reads: `v = t.item()`, `float(t)`, `int(t)` ----------------------------------------------------
# methods and functions whose result may share the tensor's memory (a view, or the tensor itself): the kept
# 0-d tensor is copied then, as `.item()` copied the number (a later in-place change must not reach it)
ALIASING = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "squeeze",
        "unsqueeze",
        "select",
        "narrow",
        "t",
        "transpose",
        "permute",
        "movedim",
        "expand",
        "expand_as",
        "diagonal",
        "detach",
        "contiguous",
        "float",
        "double",
        "half",
        "bfloat16",
        "long",
        "int",
        "bool",
        "to",
        "type",
        "type_as",
        "cpu",
        "cuda",
        "real",
        "imag",
        "as_strided",
        "unbind",
        "split",
        "chunk",
    }
)
# the conversion after `.detach()` that gives the number's own type: float() a float, int() truncates
CONVERSION = {"item": None, "float": "float", "int": "long"}


def scalar_read(value: cst.BaseExpression) -> tuple[str, cst.BaseExpression] | None:
    """("item", t) for `t.item()`, ("float", t) for `float(t)`, ("int", t) for `int(t)`; None otherwise."""
    if not isinstance(value, cst.Call):
        return None
    func = value.func
    if isinstance(func, cst.Attribute) and func.attr.value == "item" and not value.args:
        return "item", func.value
    if isinstance(func, cst.Name) and func.value in ("float", "int") and len(value.args) == 1:
        arg = value.args[0]
        if arg.keyword is None and not arg.star:
            return func.value, arg.value
    return None


def aliases(node: cst.BaseExpression) -> bool:
    """Whether the tensor `node` evaluates to may share memory with another (a name, an index, a view):
    a reduction, arithmetic or any other call gives a fresh tensor."""
    node = unparen(node)
    if isinstance(node, cst.Name | cst.Attribute | cst.Subscript):
        return True
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        name = node.func.attr.value
        return name in ALIASING or name.endswith("_")
    return False


def _atom(node: cst.BaseExpression) -> cst.BaseExpression:
    """`node`, in parentheses where a method call on it needs them (`(a - b).detach()`)."""
    if node.lpar or isinstance(node, cst.Name | cst.Attribute | cst.Call | cst.Subscript):  # type: ignore[attr-defined]
        return node
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _method(value: cst.BaseExpression, name: str) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=value, attr=cst.Name(name)))


def kept_tensor(form: str, tensor: cst.BaseExpression) -> cst.Call:
    """`t.detach()` for `t.item()` (`.float()` after it for `float(t)`, `.long()` for `int(t)`), with
    `.clone()` where `t` may share memory."""
    kept = _method(_atom(tensor), "detach")
    if aliases(tensor):
        kept = _method(kept, "clone")
    conversion = CONVERSION[form]
    return _method(kept, conversion) if conversion else kept


# ---- tensor branches: `if c: y = a` [else: y = b] -> `y = torch.where(c, a, b)` -----------------------------
def branch_value(stmt: cst.BaseStatement) -> tuple[str, cst.BaseExpression] | None:
    """(name, new value) of a statement that is exactly `name = value` or `name op= value`; None else."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return None
    small = stmt.body[0]
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target = small.targets[0].target
        return (target.value, small.value) if isinstance(target, cst.Name) else None
    if isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name):
        operator = getattr(cst, type(small.operator).__name__.removesuffix("Assign"))()
        right = small.value
        if not isinstance(
            unparen(right), cst.Name | cst.Attribute | cst.Call | cst.Subscript | cst.Integer | cst.Float
        ):
            right = right.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return small.target.value, cst.BinaryOperation(
            left=cst.Name(small.target.value), operator=operator, right=right
        )
    return None


def block_statements(block: cst.BaseSuite) -> Sequence[cst.BaseStatement]:
    """The statements of an indented block, or of a one-line suite (`if c: y = a`) as one statement."""
    if isinstance(block, cst.IndentedBlock):
        return block.body
    return [cst.SimpleStatementLine(body=block.body)]  # type: ignore[attr-defined]


def where_call(
    where: cst.BaseExpression, cond: cst.BaseExpression, a: cst.BaseExpression, b: cst.BaseExpression
) -> cst.Call:
    """`where(cond, a, b)` on one line (the operands without their outer parentheses)."""
    comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    return cst.Call(
        func=where,
        args=[
            cst.Arg(unparen(cond), comma=comma),
            cst.Arg(unparen(a), comma=comma),
            cst.Arg(unparen(b)),
        ],
    )


def comments_of(node: cst.CSTNode) -> list[cst.Comment]:
    """Every comment inside `node`, in order (an `if`'s comments survive its rewrite as comment lines)."""
    found: list[cst.Comment] = []

    class _Comments(cst.CSTVisitor):
        def visit_Comment(self, comment: cst.Comment) -> None:
            found.append(comment)

    node.visit(_Comments())
    return found


def assignment(
    name: str, value: cst.BaseExpression, leading: Sequence[cst.EmptyLine], trailing: cst.Comment | None
) -> cst.SimpleStatementLine:
    """`name = value`, with comment lines before it and a comment after it."""
    return cst.SimpleStatementLine(
        body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(name))], value=value)],
        leading_lines=list(leading),
        trailing_whitespace=cst.TrailingWhitespace(
            whitespace=cst.SimpleWhitespace("  " if trailing else ""), comment=trailing
        ),
    )
