"""Codemod for `zero_grad_set_to_none`: drop the False from `zero_grad(set_to_none=False)`.

Profile mode only (the profile shows whether every zeroed gradient gets a new one). At each target, the
`<x>.zero_grad(...)` call that passes False loses it, leaving PyTorch's default (set_to_none=True):

    optimizer.zero_grad(set_to_none=False)  ->  optimizer.zero_grad()
    model.zero_grad(False)                  ->  model.zero_grad()

Refused (left alone, with the reason): a value other than the literal False (`set_to_none=flag`: change
it where it is set); and, unless unsafe fixes are allowed (`--unsafe`), a call whose finding saw zeroed
gradients that got no new one (unused parameters), or a loop that uses `.grad` between the call and the
next `.backward()` (it would see None where it saw zeros). Already at the default: nothing to do.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider

from opadvisor.rewrite.base import RuleCodemod, Target
from opadvisor.rewrite.toolkit import code, keyword, nodes_of, parent, positional_count, remove_keyword
from opadvisor.rules.optimizer.zero_grad_set_to_none import ID, ZeroGradFacts, grad_use_before_backward

KEYWORD = "set_to_none"


class ZeroGradSetToNoneCodemod(RuleCodemod):
    """`set_to_none=False` (or a positional False) removed from the targeted zero_grad calls."""

    RULE: ClassVar[str] = ID
    FACTS = ZeroGradFacts
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False  # only where the profile saw every zeroed gradient get a new one
    NO_KERNEL_OP: ClassVar[str] = "drops an argument: no op is called"
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = ("zero_grad",)
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, ParentNodeProvider)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = original_node.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "zero_grad":
            return updated_node
        target = self.targeted(original_node)
        if target is None:
            return updated_node
        arg = _set_to_none(original_node)
        if arg is None or code(arg.value) == "True":
            self.already = "zero_grad() already uses set_to_none=True"
            return updated_node
        self.answered.add(target)
        reason = self._refusal(original_node, arg, target)
        if reason is not None:
            self.skip(original_node, reason)
            return updated_node
        self.record_change(
            original_node, f"{code(arg)} removed: zero_grad drops the gradients (set_to_none=True)"
        )
        call = (
            remove_keyword(updated_node, KEYWORD)
            if arg.keyword
            else updated_node.with_changes(args=updated_node.args[1:])
        )
        if not call.args:  # `zero_grad(\n    set_to_none=False,\n)` becomes `zero_grad()`, not a lone `)`
            call = call.with_changes(whitespace_before_args=cst.SimpleWhitespace(""))
        return call

    def _refusal(self, call: cst.Call, arg: cst.Arg, target: Target) -> str | None:
        """Why this call is left alone, None to rewrite it."""
        if code(arg.value) != "False":
            return f"set_to_none={code(arg.value)}: set it to True where that value comes from"
        if getattr(self, "allow_unsafe", False):
            return None
        facts = self.facts_of(target)
        if facts is not None and facts.without_gradient is None:
            return (
                "the profile could not tell which gradients zero_grad zeroed (a foreach zeroing is one kernel), "
                "so not whether each gets a new one (allowed with --unsafe)"
            )
        if facts is not None and facts.without_gradient:
            return (
                f"{facts.without_gradient} zeroed gradient(s) per step got no new gradient (unused parameters): "
                "with set_to_none the optimizer would skip them (allowed with --unsafe)"
            )
        line = self._grad_use_before_backward(call)
        if line is not None:
            return f"line {line} uses .grad before the next backward: it would be None there (allowed with --unsafe)"
        return None

    def _grad_use_before_backward(self, call: cst.Call) -> int | None:
        """The first line using `.grad` after `call` and before the next `.backward(...)`, in the order the
        innermost loop holding the call runs its body (wrapping round to the body's start); without a loop,
        to the end of the enclosing function or module. None when there is none."""
        scope = self._scope(call)
        backwards = [self.lines_of(c)[0] for c in nodes_of(scope, cst.Call) if _attr(c.func) == "backward"]
        grads = [self.lines_of(a)[0] for a in nodes_of(scope, cst.Attribute) if a.attr.value == "grad"]
        loop = isinstance(scope, cst.For | cst.While)
        return grad_use_before_backward(self.lines_of(call)[1], loop, backwards, grads)

    def _scope(self, node: cst.CSTNode) -> cst.CSTNode:
        """The innermost loop holding `node`, else its function, else the module."""
        current = parent(self, node)
        while current is not None and not isinstance(current, cst.For | cst.While | cst.FunctionDef):
            current = parent(self, current)
        return current if current is not None else self._file

    def visit_Module(self, node: cst.Module) -> bool:
        self._file = node
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no zero_grad(set_to_none=False) call on these lines")
        return updated_node


def _set_to_none(call: cst.Call) -> cst.Arg | None:
    """The argument giving set_to_none (by keyword, or zero_grad's one positional parameter), or None."""
    arg = keyword(call, KEYWORD)
    if arg is None and positional_count(call) >= 1:
        arg = call.args[0]
    return arg


def _attr(func: cst.BaseExpression) -> str | None:
    return func.attr.value if isinstance(func, cst.Attribute) else None
