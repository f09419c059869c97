"""Building replacement code: calls laid out like hand-written code, comments kept, precedence respected.

A rewrite reuses the user's own expression nodes (the mask, the fill value, the scale ...) so whatever is
inside them, comments included, survives byte for byte. Comments that sat in code the rewrite removes are
collected (`orphaned_comments`) and put back as comment lines above the rewritten statement: a fix never
drops a comment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import libcst as cst

from opadvisor.rewrite._match import code, contains
from opadvisor.rewrite._walk import Transformer, Visitor

MAX_LINE = 100  # past this (indentation included) a built call is laid out one argument per line

_ATOMIC = (
    cst.Name,
    cst.Attribute,
    cst.Call,
    cst.Subscript,
    cst.Integer,
    cst.Float,
    cst.Imaginary,
    cst.SimpleString,
    cst.ConcatenatedString,
    cst.FormattedString,
    cst.List,
    cst.Tuple,
    cst.Dict,
    cst.Set,
    cst.ListComp,
    cst.SetComp,
    cst.DictComp,
    cst.GeneratorExp,
    cst.Ellipsis,
)


def atomic(node: cst.BaseExpression) -> cst.BaseExpression:
    """The node, parenthesised unless it binds tighter than any operator (a name, call, subscript ...)."""
    if isinstance(node, _ATOMIC) or getattr(node, "lpar", None):
        return node
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def operand(node: cst.BaseExpression) -> cst.BaseExpression:
    """The node as an operand of a unary or arithmetic operator (parenthesised where needed)."""
    if isinstance(node, cst.UnaryOperation) and not isinstance(node.operator, cst.Not):
        return node
    return atomic(node)


def reciprocal(node: cst.BaseExpression) -> cst.BaseExpression:
    """`1 / node` (for a scale given as a divisor)."""
    return cst.BinaryOperation(
        left=cst.Integer("1"),
        operator=cst.Divide(
            whitespace_before=cst.SimpleWhitespace(" "), whitespace_after=cst.SimpleWhitespace(" ")
        ),
        right=operand(node),
    )


def invert(node: cst.BaseExpression) -> cst.BaseExpression:
    """The logical negation of a boolean mask, simplified where it is plainly one: `~m` -> `m`,
    `a == b` <-> `a != b`, `m.logical_not()` -> `m`, else `~(m)`."""
    bare = node.with_changes(lpar=[], rpar=[]) if getattr(node, "lpar", None) else node
    if isinstance(bare, cst.UnaryOperation) and isinstance(bare.operator, cst.BitInvert):
        return bare.expression
    if isinstance(bare, cst.Comparison) and len(bare.comparisons) == 1:
        target = bare.comparisons[0]
        op = target.operator
        if isinstance(op, cst.Equal):
            new_op: cst.BaseCompOp = cst.NotEqual(
                whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after
            )
        elif isinstance(op, cst.NotEqual):
            new_op = cst.Equal(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)
        else:
            new_op = None  # type: ignore[assignment]
        if new_op is not None:
            return bare.with_changes(comparisons=[target.with_changes(operator=new_op)])
    if (
        isinstance(bare, cst.Call)
        and isinstance(bare.func, cst.Attribute)
        and bare.func.attr.value == "logical_not"
        and not bare.args
    ):
        return bare.func.value
    return cst.UnaryOperation(operator=cst.BitInvert(), expression=atomic(node))


def template(text: str, **nodes: cst.BaseExpression) -> cst.BaseExpression:
    """Parse a one-line expression and put the given nodes where the names `__NAME__` stand."""
    parsed = cst.parse_expression(text)

    class _Fill(Transformer):
        def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
            if (
                updated.value.startswith("__")
                and updated.value.endswith("__")
                and updated.value[2:-2] in nodes
            ):
                return nodes[updated.value[2:-2]]
            return updated

    return parsed.visit(_Fill())  # type: ignore[return-value]


def build_call(
    func: cst.BaseExpression,
    positional: Sequence[cst.BaseExpression],
    keywords: Sequence[tuple[str, cst.BaseExpression]],
    *,
    exploded: bool = False,
    indent_unit: str = "    ",
) -> cst.Call:
    """`func(a, b, k=v)`; exploded: one argument per line, trailing comma, closing parenthesis on its own."""
    values: list[tuple[str | None, cst.BaseExpression]] = [(None, v) for v in positional] + list(keywords)
    values = [(k, _bare(v)) for k, v in values]
    args: list[cst.Arg] = []
    for i, (keyword, value) in enumerate(values):
        last = i == len(values) - 1
        if exploded:
            after: cst.BaseParenthesizableWhitespace = cst.ParenthesizedWhitespace(
                first_line=cst.TrailingWhitespace(),
                empty_lines=[],
                indent=True,
                last_line=cst.SimpleWhitespace("" if last else indent_unit),
            )
            comma: cst.Comma | cst.MaybeSentinel = cst.Comma(whitespace_after=after)
        else:
            comma = (
                cst.MaybeSentinel.DEFAULT if last else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            )
        args.append(
            cst.Arg(
                value=value,
                keyword=cst.Name(keyword) if keyword else None,
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
                )
                if keyword
                else cst.MaybeSentinel.DEFAULT,
                comma=comma,
            )
        )
    whitespace_before_args: cst.BaseParenthesizableWhitespace = cst.SimpleWhitespace("")
    if exploded:
        whitespace_before_args = cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(),
            empty_lines=[],
            indent=True,
            last_line=cst.SimpleWhitespace(indent_unit),
        )
    return cst.Call(func=func, args=args, whitespace_before_args=whitespace_before_args)


def _bare(value: cst.BaseExpression) -> cst.BaseExpression:
    """An argument without outer parentheses it does not need (`scale=(1.0 / d)` -> `scale=1.0 / d`)."""
    if (
        getattr(value, "lpar", None)
        and not isinstance(value, cst.Tuple | cst.GeneratorExp | cst.Yield)
        and "\n" not in code(value.with_changes(lpar=[], rpar=[]))
    ):
        return value.with_changes(lpar=[], rpar=[])
    return value


def fits(statement_text: str, indent: str) -> bool:
    first = statement_text.split("\n", 1)[0]
    return "\n" not in statement_text.rstrip("\n") and len(indent) + len(first) <= MAX_LINE


def orphaned_comments(removed: Iterable[cst.CSTNode], kept: Iterable[cst.CSTNode]) -> list[cst.Comment]:
    """Comments inside `removed` that are not inside any of the `kept` (reused) nodes, in source order."""
    kept = list(kept)
    out: list[cst.Comment] = []
    for root in removed:

        class _Comments(Visitor):
            def on_visit(self, node: cst.CSTNode) -> bool:
                if any(node is k for k in kept):
                    return False
                if isinstance(node, cst.Comment):
                    out.append(node)
                return True

        root.visit(_Comments())
    return out


def comment_lines(comments: Iterable[cst.Comment]) -> list[cst.EmptyLine]:
    return [cst.EmptyLine(indent=True, whitespace=cst.SimpleWhitespace(""), comment=c) for c in comments]


def statement_with_leading(
    stmt: cst.SimpleStatementLine, leading: Sequence[cst.EmptyLine]
) -> cst.SimpleStatementLine:
    return stmt.with_changes(leading_lines=[*leading, *stmt.leading_lines])


def trailing_comment_lines(stmt: cst.SimpleStatementLine) -> list[cst.EmptyLine]:
    """The statement's own leading lines plus its end-of-line comment as a comment line."""
    lines = list(stmt.leading_lines)
    if stmt.trailing_whitespace.comment is not None:
        lines.extend(comment_lines([stmt.trailing_whitespace.comment]))
    return lines


def replace_nodes(root: cst.CSTNode, mapping: dict[int, cst.CSTNode]) -> cst.CSTNode:
    """Copy of root with the nodes whose id() is in mapping replaced (children of a replaced node are not
    visited further)."""

    class _Replace(Transformer):
        def on_visit(self, node: cst.CSTNode) -> bool:
            return id(node) not in mapping

        def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:  # type: ignore[override]
            return mapping.get(id(original), updated)

    return root.visit(_Replace())


__all__ = [
    "atomic",
    "build_call",
    "code",
    "comment_lines",
    "contains",
    "fits",
    "invert",
    "operand",
    "orphaned_comments",
    "reciprocal",
    "replace_nodes",
    "statement_with_leading",
    "template",
    "trailing_comment_lines",
]
