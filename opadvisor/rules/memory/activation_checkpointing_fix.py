"""Codemod for `activation_checkpointing`: checkpoint the blocks where the model calls them.

Before::

    for block in self.blocks:
        x = block(x, mask=mask)

After::

    for block in self.blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, mask=mask, use_reentrant=False)

(`torch.utils.checkpoint.checkpoint` spelled as the file imports it; `from torch.utils.checkpoint import
checkpoint` added when the file does not import torch.) The call of each block keeps its arguments, their
comments and layout; the block goes first and `use_reentrant=False` last.

Why the call site and not a wrapper module: wrapping each block in a module (`checkpoint_wrapper`, or a
small class in the user's file) renames every parameter of the blocks in the state_dict, so checkpoints
saved before no longer load; rewriting the call changes no name, and the loop over a ModuleList (or calls
of `self.layers[i]`) is how the code people write calls its blocks.

Blocks of an `nn.Sequential` that the model calls as a whole (`x = self.blocks(x)`; the finding's
the facts' `form` is "sequential") get `torch.utils.checkpoint.checkpoint_sequential(self.blocks,
len(self.blocks), x, use_reentrant=False)`: one segment per block (the last runs unwrapped, as backward
needs it first).

Which calls: the finding names the blocks (the facts' `modules`: "blocks.0", "blocks.1", ... of one
ModuleList or Sequential) and the lines that call them. On those lines, a call is rewritten when its
callee is the blocks' container seen from the caller: a loop variable over `self.<container>` (also
through `enumerate(...)` or a slice), or `self.<container>[i]`, where `self.<container>` names the blocks'
parent path from the calling module (`self.layers` for "encoder.layers.<i>" called from the encoder,
`self.transformer.h` for "transformer.h.<i>" called from the model, as nanoGPT writes it). Refused, with the reason: another callee on the line, a keyword argument that
`checkpoint` takes itself (`use_reentrant`, `preserve_rng_state`, `context_fn`, `determinism_check`,
`debug`: it would not reach the block). Without a profile (static mode) nothing is rewritten: which blocks
hold the memory is what the profile measured.

Fix safety: safe (the same values and gradients; non-reentrant checkpoint restores the RNG state, so
dropout draws the same masks in the recomputation). The rule marks blocks holding BatchNorm unsafe.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import code, keyword, parent, reference
from opadvisor.rules.memory.activation_checkpointing import CheckpointFacts

CHECKPOINT = "torch.utils.checkpoint.checkpoint"
CHECKPOINT_SEQUENTIAL = "torch.utils.checkpoint.checkpoint_sequential"
OWN_KEYWORDS = ("use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug")


def _facts(target: Target) -> CheckpointFacts:
    """The finding's facts (an empty set when the target carries none: nothing matches then)."""
    return target_facts(target, CheckpointFacts) or CheckpointFacts()


def container_of(modules: list[str]) -> str | None:
    """ "encoder.layers" for ["encoder.layers.0", "encoder.layers.1"]: the path holding the blocks."""
    parents = {m.rpartition(".")[0] for m in modules}
    if len(parents) != 1:
        return None
    return parents.pop() or None


def names_container(node: cst.BaseExpression, container: str) -> bool:
    """Whether `node` is `self.<...>` naming the container from the module that calls it: `self.layers`
    from the encoder for "encoder.layers", or `self.transformer.h` from the model for "transformer.h"."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not (isinstance(node, cst.Name) and node.value == "self") or not parts:
        return False
    chain = ".".join(reversed(parts))
    return container == chain or container.endswith("." + chain)


def _shown(container: str | None) -> str:
    return f"self.{container.rpartition('.')[2]}" if container else "the blocks"


class ActivationCheckpointingCodemod(RuleCodemod):
    """Wrap the calls of the profiled blocks in torch.utils.checkpoint.checkpoint (non-reentrant)."""

    RULE: ClassVar[str] = "activation_checkpointing"
    FACTS = CheckpointFacts
    STATIC_MODE: ClassVar[bool] = False  # which blocks hold the memory only a profile says
    NO_KERNEL_OP: ClassVar[str] = (
        "torch.utils.checkpoint recomputes the blocks with PyTorch's own ops; verify measures its effect, "
        "the peak memory"
    )
    SAFETY: ClassVar[str] = "safe"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self.targets is None:
            return updated_node  # static mode: the profile says which blocks hold the memory
        target = self.targeted(original_node)
        if target is None:
            return updated_node
        if _facts(target).form == "sequential":
            return self._sequential(original_node, updated_node, target)
        if not self._calls_the_blocks(original_node, target):
            return updated_node
        self.answered.add(target)
        clash = next((k for k in OWN_KEYWORDS if keyword(original_node, k) is not None), None)
        if clash is not None:
            self.skip(original_node, f"the block is called with {clash}=..., which checkpoint takes itself")
            return updated_node
        self.record_change(
            original_node,
            f"{code(original_node.func)}(...) -> checkpoint({code(original_node.func)}, ..., use_reentrant=False): "
            "the blocks keep only their inputs for backward",
        )
        return _wrapped(updated_node, reference(self.context, self._module, CHECKPOINT))

    def _sequential(self, original: cst.Call, updated: cst.Call, target: Target) -> cst.BaseExpression:
        """`self.blocks(x)` -> `checkpoint_sequential(self.blocks, len(self.blocks), x, use_reentrant=False)`."""
        container = container_of(_facts(target).modules)
        if container is None or not names_container(original.func, container):
            return updated
        self.answered.add(target)
        seq = code(original.func)
        if len(original.args) != 1 or original.args[0].keyword is not None or original.args[0].star:
            self.skip(original, f"{seq}(...) takes one positional input where checkpoint_sequential does")
            return updated
        self.record_change(
            original,
            f"{seq}(x) -> checkpoint_sequential({seq}, len({seq}), x, use_reentrant=False): each block keeps "
            "only its input for backward",
        )
        length = cst.Call(func=cst.Name("len"), args=[cst.Arg(updated.func)])
        segments = updated.with_changes(
            args=[
                cst.Arg(value=length, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                *updated.args,
            ]
        )
        return _wrapped(segments, reference(self.context, self._module, CHECKPOINT_SEQUENTIAL))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(self._unmatched)
        return updated_node

    def _unmatched(self, target: Target) -> str:
        where = _shown(container_of(_facts(target).modules))
        return f"no call of {where} on these lines to wrap (call them from a loop over {where})"

    # ---- matching ------------------------------------------------------------------------------------------
    def _calls_the_blocks(self, call: cst.Call, target: Target) -> bool:
        container = container_of(_facts(target).modules)
        if container is None:
            return False
        func = call.func
        if isinstance(func, cst.Subscript):
            return names_container(func.value, container)
        if isinstance(func, cst.Name):
            return self._loop_variable_over(call, func.value, container)
        return False

    def _loop_variable_over(self, node: cst.CSTNode, name: str, container: str) -> bool:
        """Whether `name` is the variable of an enclosing `for` over the container (or enumerate/slice)."""
        current = parent(self, node)
        while current is not None and not isinstance(current, cst.FunctionDef):
            if isinstance(current, cst.For) and _binds(current.target, name):
                return _iterates(current.iter, container)
            current = parent(self, current)
        return False


def _binds(target: cst.BaseAssignTargetExpression, name: str) -> bool:
    """`for name in ...` or `for i, name in enumerate(...)`."""
    if isinstance(target, cst.Name):
        return target.value == name
    if isinstance(target, cst.Tuple) and len(target.elements) == 2:
        second = target.elements[1].value
        return isinstance(second, cst.Name) and second.value == name
    return False


def _iterates(iterable: cst.BaseExpression, container: str) -> bool:
    """`self.<container>`, `self.<container>[a:b]`, or `enumerate(` either `)`."""
    if m.matches(iterable, m.Call(func=m.Name("enumerate"))) and iterable.args:  # type: ignore[union-attr]
        iterable = iterable.args[0].value  # type: ignore[union-attr]
    if isinstance(iterable, cst.Subscript):
        iterable = iterable.value
    return names_container(iterable, container)


def _wrapped(call: cst.Call, checkpoint: cst.BaseExpression) -> cst.Call:
    """`f(a, b=c)` -> `checkpoint(f, a, b=c, use_reentrant=False)` in the call's own layout."""
    args = list(call.args)
    between = cst.SimpleWhitespace(" ")
    if args and isinstance(args[0].comma, cst.Comma):
        between = args[0].comma.whitespace_after
    elif len(args) == 1 and "\n" in code(call.whitespace_before_args):
        between = call.whitespace_before_args
    first = cst.Arg(value=call.func, comma=cst.Comma(whitespace_after=between))
    flag = cst.Arg(
        keyword=cst.Name("use_reentrant"),
        value=cst.Name("False"),
        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
    )
    if args:
        last = args[-1]
        if isinstance(last.comma, cst.Comma):  # a trailing comma stays trailing, a comment stays on its arg
            ws = last.comma.whitespace_after
            if isinstance(ws, cst.ParenthesizedWhitespace) and isinstance(
                between, cst.ParenthesizedWhitespace
            ):
                kept = ws.with_changes(empty_lines=[], last_line=between.last_line)
                flag = flag.with_changes(
                    comma=last.comma.with_changes(
                        whitespace_after=ws.with_changes(first_line=cst.TrailingWhitespace())
                    )
                )
                args[-1] = last.with_changes(comma=last.comma.with_changes(whitespace_after=kept))
            else:
                flag = flag.with_changes(comma=last.comma)
                args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=between))
        else:
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(func=checkpoint, args=[first, *args, flag])
