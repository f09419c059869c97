"""Call-argument edits the codemods share: find a keyword, append keywords in the call's own layout,
replace a keyword's value, and tell `*args` / `**kwargs` apart; comments and trailing commas are kept."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
from libcst.metadata import PositionProvider

from opadvisor.rewrite._edit import MAX_LINE
from opadvisor.rewrite._match import code


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def has_star_args(call: cst.Call) -> str | None:
    """'**kwargs' / '*args' when the call unpacks arguments (which may set anything), else None."""
    for arg in call.args:
        if arg.star == "**":
            return "**" + code(arg.value)
        if arg.star == "*":
            return "*" + code(arg.value)
    return None


def positional_count(call: cst.Call) -> int:
    return sum(1 for a in call.args if a.keyword is None and not a.star)


def _without_comment(ws: cst.BaseParenthesizableWhitespace) -> cst.BaseParenthesizableWhitespace:
    """The same line break and indentation, without the comment and blank lines it carried."""
    if isinstance(ws, cst.ParenthesizedWhitespace):
        return ws.with_changes(first_line=cst.TrailingWhitespace(), empty_lines=[])
    return ws


def append_keywords(
    call: cst.Call,
    items: Sequence[tuple[str, cst.BaseExpression]],
    *,
    column: int | None = None,
    indent: str = "    ",
) -> cst.Call:
    """`call` with `name=value` arguments appended, in the layout of the existing arguments.

    One-argument-a-line calls get one new line per argument at the same indentation; a trailing comma
    stays trailing; a comment after the last argument stays on that argument's line. A call on one line
    that starts at `column` and would end past MAX_LINE is laid out one argument a line (`indent` deeper
    than the statement, a trailing comma, the `)` on a line of its own).
    """
    if not items:
        return call
    new = _append(call, items)
    if column is not None and "\n" not in code(call) and column + len(code(new)) > MAX_LINE:
        return one_per_line(new, indent)
    return new


def one_per_line(call: cst.Call, indent: str) -> cst.Call:
    """The call with each argument on its own line (for a call that was on one line)."""
    arg_line = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent))
    close_line = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(""))
    args = [
        a.with_changes(
            comma=cst.Comma(whitespace_after=arg_line if i < len(call.args) - 1 else close_line),
            whitespace_after_arg=cst.SimpleWhitespace(""),
        )
        for i, a in enumerate(call.args)
    ]
    return call.with_changes(args=args, whitespace_before_args=arg_line)


def layout(codemod: cst.MetadataDependent, node: cst.Call) -> dict:
    """`append_keywords` keywords for a call of the file being rewritten: its column, the file's indent."""
    module = codemod.context.module  # type: ignore[attr-defined]
    return {
        "column": codemod.get_metadata(PositionProvider, node).start.column,
        "indent": module.default_indent if module is not None else "    ",
    }


def _append(call: cst.Call, items: Sequence[tuple[str, cst.BaseExpression]]) -> cst.Call:
    new_args = [
        cst.Arg(
            value=value,
            keyword=cst.Name(name),
            equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
        )
        for name, value in items
    ]
    args = list(call.args)
    if not args:
        sep: cst.BaseParenthesizableWhitespace = cst.SimpleWhitespace(" ")
        joined = [a.with_changes(comma=cst.Comma(whitespace_after=sep)) for a in new_args[:-1]] + [
            new_args[-1]
        ]
        return call.with_changes(args=joined)

    last = args[-1]
    trailing_comma = isinstance(last.comma, cst.Comma)
    closing = last.comma.whitespace_after if trailing_comma else last.whitespace_after_arg  # before ")"

    # The whitespace that separates arguments: that after the last-but-one comma, or, for a single
    # argument on its own line, that after the "(".
    if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma):
        sep = _without_comment(args[-2].comma.whitespace_after)
    elif isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        sep = _without_comment(call.whitespace_before_args)
    else:
        sep = cst.SimpleWhitespace(" ")
    multiline = isinstance(sep, cst.ParenthesizedWhitespace)

    # The old last argument gets a comma; a comment that followed it stays on its line.
    if multiline and isinstance(closing, cst.ParenthesizedWhitespace):
        after_old_last: cst.BaseParenthesizableWhitespace = closing.with_changes(
            indent=sep.indent, last_line=sep.last_line
        )
        closing_new: cst.BaseParenthesizableWhitespace = _without_comment(closing)
    else:
        after_old_last = sep
        closing_new = closing
    if trailing_comma:
        old_last = last.with_changes(comma=last.comma.with_changes(whitespace_after=after_old_last))
    else:
        old_last = last.with_changes(
            comma=cst.Comma(whitespace_after=after_old_last), whitespace_after_arg=cst.SimpleWhitespace("")
        )

    added = [a.with_changes(comma=cst.Comma(whitespace_after=sep)) for a in new_args[:-1]]
    if trailing_comma:
        added.append(new_args[-1].with_changes(comma=last.comma.with_changes(whitespace_after=closing_new)))
    else:
        added.append(new_args[-1].with_changes(whitespace_after_arg=closing_new))
    return call.with_changes(args=[*args[:-1], old_last, *added])


def remove_keyword(call: cst.Call, name: str) -> cst.Call:
    """`call` without its `name=` argument; the last argument left takes the removed one's comma and
    closing whitespace when it was the last (a trailing comma stays trailing, none stays none)."""
    args = list(call.args)
    index = next((i for i, a in enumerate(args) if a.keyword is not None and a.keyword.value == name), None)
    if index is None:
        return call
    removed = args.pop(index)
    if index == len(args) and args:
        args[-1] = args[-1].with_changes(
            comma=removed.comma, whitespace_after_arg=removed.whitespace_after_arg
        )
    return call.with_changes(args=args)


def replace_keyword_value(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    args = [
        a.with_changes(value=value) if a.keyword is not None and a.keyword.value == name else a
        for a in call.args
    ]
    return call.with_changes(args=args)


# ---- the codemod ---------------------------------------------------------------------------------------------
