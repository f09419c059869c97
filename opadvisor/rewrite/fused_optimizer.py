"""Codemod for `fused_optimizer`: construct Adam, AdamW and SGD with `fused=True`.

What it rewrites: `torch.optim.Adam(...)`, `torch.optim.AdamW(...)` and `torch.optim.SGD(...)` calls, however
the class was imported (`import torch.optim as optim; optim.AdamW`, `from torch.optim import AdamW as W`),
get `fused=True` appended to their arguments, in the call's own layout (one argument a line stays one a
line, a trailing comma stays, comments stay where they were).

Fix safety: safe where every parameter is a floating-point tensor on a device with fused kernels: the
fused step computes the same update (on CPU in torch 2.13 it matched the for-loop step bit for bit). Checked
on torch 2.13: `fused=True` works for CUDA and CPU parameters of Adam, AdamW and SGD (CPU kernels since
torch 2.4; older torch raised on CPU); it raises at the first `step()` for complex or integer parameters,
for SGD with sparse gradients (`nn.Embedding(sparse=True)`), and at construction with `differentiable=True`
or `foreach=True`. In profile mode the finding's details say where the parameters live
(`param_devices`, `param_dtypes`, recorded when the optimizer was built); in static mode nothing is known,
and a display-only note (`notes`) says the fix needs floating-point parameters on CUDA (or CPU).

Refused (left alone, with the reason): calls with `**kwargs` or `*args` (they may set `fused` already),
an explicit `fused=` or `foreach=` (the user chose an implementation; `fused` and `foreach=True` cannot be
combined), `differentiable=` other than False, devices or dtypes from the profile that the fused kernels
do not take, and SGD in a file that builds sparse embeddings.

The call-argument helpers below (`append_keywords`, `keyword`, `has_star_args`, ...) are shared with the
dataloader_stall codemod.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite._edit import MAX_LINE
from opadvisor.rewrite._match import code, qualified
from opadvisor.rewrite.base import RuleCodemod, Target

OPTIMIZERS: dict[str, str] = {
    "torch.optim.Adam": "Adam",
    "torch.optim.adam.Adam": "Adam",
    "torch.optim.AdamW": "AdamW",
    "torch.optim.adamw.AdamW": "AdamW",
    "torch.optim.SGD": "SGD",
    "torch.optim.sgd.SGD": "SGD",
}
# Device types whose fused Adam/AdamW/SGD kernels exist in every torch the project supports (>= 2.4).
FUSED_DEVICES = frozenset({"cuda", "cpu"})
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "half", "float", "double"})
SPARSE_EMBEDDINGS = frozenset(
    {
        "torch.nn.Embedding",
        "torch.nn.EmbeddingBag",
        "torch.nn.modules.sparse.Embedding",
        "torch.nn.modules.sparse.EmbeddingBag",
    }
)


# ---- call-argument helpers (shared with dataloader_stall) --------------------------------------------------


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


def replace_keyword_value(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    args = [
        a.with_changes(value=value) if a.keyword is not None and a.keyword.value == name else a
        for a in call.args
    ]
    return call.with_changes(args=args)


# ---- the codemod ---------------------------------------------------------------------------------------------


class FusedOptimizerCodemod(RuleCodemod):
    """Add `fused=True` to Adam/AdamW/SGD constructions (details used: param_devices, param_dtypes)."""

    RULE: ClassVar[str] = "fused_optimizer"
    SAFETY: ClassVar[str] = "safe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self._sparse_embedding_line: int | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._sparse_embedding_line = None
        for call in m.findall(
            node, m.Call(args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("sparse")), m.ZeroOrMore()])
        ):
            value = keyword(call, "sparse").value
            if m.matches(value, m.Name("False")) or not qualified(self, call.func) & SPARSE_EMBEDDINGS:
                continue
            self._sparse_embedding_line = self.lines_of(call)[0]
            break

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        names = qualified(self, original_node.func) & OPTIMIZERS.keys()
        if not names:
            return updated_node
        target = self.targeted(original_node)
        if target is None:
            return updated_node
        cls = OPTIMIZERS[sorted(names)[0]]
        reason = self._refusal(original_node, cls, target)
        if reason is not None:
            self.skip(original_node, reason)
            return updated_node
        devices = sorted({str(d).split(":")[0] for d in target.details.get("param_devices") or []})
        where = f" (parameters on {', '.join(devices)})" if devices else ""
        self.record_change(
            original_node, f"{cls}(..., fused=True): one fused kernel for all parameters{where}"
        )
        if not devices:
            self.note(
                original_node,
                f"fused {cls} requires floating-point parameters on CUDA (or CPU, torch >= 2.4); without a "
                "profile this was not checked",
            )
        return append_keywords(updated_node, [("fused", cst.Name("True"))], **layout(self, original_node))

    def _refusal(self, call: cst.Call, cls: str, target: Target) -> str | None:
        star = has_star_args(call)
        if star is not None:
            return (
                f"{cls}(...) unpacks {star}, which may set fused or foreach already; add fused=True by hand"
            )
        arg = keyword(call, "fused")
        if arg is not None:
            return f"{cls}(...) already sets fused={code(arg.value)}"
        arg = keyword(call, "foreach")
        if arg is not None:
            return (
                f"{cls}(...) sets foreach={code(arg.value)}: the user chose an implementation "
                "(fused and foreach=True cannot be combined)"
            )
        arg = keyword(call, "differentiable")
        if arg is not None and not (isinstance(arg.value, cst.Name) and arg.value.value == "False"):
            return f"{cls}(...) sets differentiable={code(arg.value)}, which fused=True does not support"
        if not call.args:
            return f"{cls}() has no parameters argument"
        devices = [str(d) for d in target.details.get("param_devices") or []]
        unsupported = sorted({d for d in devices if d.split(":")[0] not in FUSED_DEVICES})
        if unsupported:
            return f"parameters on {', '.join(unsupported)}: fused {cls} needs CUDA (or CPU) parameters"
        dtypes = [str(d).removeprefix("torch.") for d in target.details.get("param_dtypes") or []]
        odd = sorted({d for d in dtypes if d not in FLOAT_DTYPES})
        if odd:
            return f"parameters of dtype {', '.join(odd)}: fused {cls} needs floating-point parameters"
        if cls == "SGD" and self._sparse_embedding_line is not None:
            return (
                f"the file builds a sparse embedding (line {self._sparse_embedding_line}): fused SGD does not "
                "support sparse gradients"
            )
        return None
