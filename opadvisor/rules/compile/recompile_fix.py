"""Codemod for `recompile`: compile with `dynamic=True` where a changing size made torch.compile recompile.

Profile mode only (the recompiles are what dynamo reported while the script ran: static mode rewrites
nothing). Each target is the statement that compiled the function (`RecompileFacts.compile_line`); for a
recompile of kind "shape" (a size that changed) or "scalar" (a Python number that changed: dynamic=True
makes ints and floats symbolic too, torch 2.11-2.13) the compile gets `dynamic=True`, in its own layout
(one argument a line stays one a line, a trailing comma stays, comments stay where they were):

    model = torch.compile(model)                  ->  model = torch.compile(model, dynamic=True)
    model.compile(mode="max-autotune")            ->  model.compile(mode="max-autotune", dynamic=True)
    @torch.compile                                ->  @torch.compile(dynamic=True)
    @torch.compile(fullgraph=True)                ->  @torch.compile(fullgraph=True, dynamic=True)

`torch.compile` is resolved through the file's imports (`from torch import compile as c`); `<x>.compile(...)`
is `nn.Module.compile` (which passes its keywords to torch.compile) unless `x` is an imported module
(`re.compile`). A decorator is found from its own line or the `def` line.

Refused (left alone, with the reason): a compile that sets `dynamic=` already (any value: `dynamic=False`
is the user's choice of static shapes) or passes `**kwargs` (which may set it). Other kinds get advice only:
a dtype that changes, a module's `training` flag that flips (compile once per mode), anything else.

Fix safety: safe (the same values: dynamic shapes change how the graph is compiled, not what it computes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import (
    append_keywords,
    code,
    imported_names,
    keyword,
    layout,
    parent,
    qualified,
)
from opadvisor.rules.compile_facts import RecompileFacts

COMPILES = frozenset({"torch.compile"})
DYNAMIC_KINDS = frozenset({"shape", "scalar"})  # the recompiles `dynamic=True` ends


def facts_of(target: Target) -> RecompileFacts | None:
    return target_facts(target, RecompileFacts)


def advice(facts: RecompileFacts) -> str:
    """What to do for a recompile the codemod does not rewrite (every kind but DYNAMIC_KINDS)."""
    what = facts.input or "an argument"
    seen = f" (values {', '.join(facts.values[:4])})" if facts.values else ""
    return {
        "scalar": f"{what} is a Python number that changes{seen}: pass it as a 0-d tensor (torch.tensor(v)): "
        "dynamo guards on a number's value, not on a tensor's (advice)",
        "dtype": f"the dtype of {what} changes{seen}: cast it to one dtype before the compiled call (advice)",
        "training": "the module's training flag flips between train() and eval(): compile once per mode "
        "(one compiled callable for training, another for evaluation) (advice)",
    }.get(
        facts.kind,
        f"dynamo's guard: {facts.reasons[0] if facts.reasons else 'not recorded'}: advice only",
    )


def _what_changed(facts: RecompileFacts) -> str:
    if facts.kind == "scalar":
        return f"the number {facts.input}"
    return f"{facts.input}'s dim {facts.dim}" if facts.dim is not None else f"{facts.input}'s size"


class RecompileCodemod(RuleCodemod):
    """`dynamic=True` on the torch.compile call (or decorator) whose function recompiled for new sizes."""

    RULE: ClassVar[str] = "recompile"
    FACTS = RecompileFacts
    STATIC_MODE: ClassVar[bool] = False  # the recompiles are what dynamo reported while the script ran
    SAFETY: ClassVar[str] = "safe"
    COMPOSES: ClassVar[bool] = True  # adds a keyword to the call: another rule may have rewritten the line
    NO_KERNEL_OP: ClassVar[str] = "dynamic=True changes how torch.compile compiles the graph, not its ops"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, context: CodemodContext, targets: Sequence[Target] | None = None) -> None:
        super().__init__(context, targets)
        self._top_imports: set[str] = set()
        self._handled: set[int] = set()  # ids of the targets a rewrite or refusal answered

    def _answer(self, targets: list[Target]) -> None:
        """These targets are dealt with (by identity: two findings on one line are equal Targets)."""
        self.answered.update(targets)
        self._handled.update(map(id, targets))

    def visit_Module(self, node: cst.Module) -> bool:
        self._top_imports = set().union(*map(imported_names, node.body))
        return self.targets is not None  # static mode: nothing to do

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.targets is not None:
            for target in self.targets:
                facts = facts_of(target)
                if facts is not None and facts.kind not in DYNAMIC_KINDS:
                    self.answered.add(target)
                    self.skipped.append(Note(target.line, advice(facts)))
                elif id(target) not in self._handled:
                    self.skipped.append(Note(target.line, self._unreached(target)))
            self.changes.sort(key=lambda n: n.line)
            self.skipped.sort(key=lambda n: n.line)
        return updated_node

    @staticmethod
    def _unreached(target: Target) -> str:
        if facts_of(target) is None:
            return "the finding carries no recompile facts (profile again with this version)"
        return "no torch.compile(...) call, .compile(...) call or @torch.compile decorator on these lines"

    # ---- the compile call or decorator on a target's lines ----------------------------------------------------
    def _shape_targets(self, node: cst.CSTNode, def_line: int | None) -> list[Target]:
        """The DYNAMIC_KINDS targets on `node`'s lines (or, for a decorator, on its function's `def` line)."""
        start, end = self.lines_of(node)
        found = []
        for target in self.targets or []:
            facts = facts_of(target)
            if facts is None or facts.kind not in DYNAMIC_KINDS:
                continue
            if (start <= target.end_line and target.line <= end) or (
                def_line is not None and target.line <= def_line <= target.end_line
            ):
                found.append(target)
        return found

    def _def_line(self, decorator: cst.CSTNode | None) -> int | None:
        """The `def` line of the function a decorator decorates (None when `decorator` is no decorator)."""
        function = parent(self, decorator) if isinstance(decorator, cst.Decorator) else None
        return self.lines_of(function)[0] if isinstance(function, cst.FunctionDef) else None

    def _is_compile(self, func: cst.BaseExpression) -> bool:
        """`torch.compile` however imported, or `<x>.compile` where `x` is no imported module."""
        if qualified(self, func) & COMPILES:
            return True
        if not (isinstance(func, cst.Attribute) and func.attr.value == "compile"):
            return False
        root = func.value
        while isinstance(root, cst.Attribute | cst.Call | cst.Subscript):
            root = root.func if isinstance(root, cst.Call) else root.value
        return not (isinstance(root, cst.Name) and root.value in self._top_imports and root.value != "torch")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not self.targets or not self._is_compile(original_node.func):
            return updated_node
        targets = self._shape_targets(original_node, self._def_line(parent(self, original_node)))
        if not targets:
            return updated_node
        self._answer(targets)
        reason = self._refusal(original_node)
        if reason is not None:
            self.skipped.extend(Note(t.line, reason) for t in targets)
            return updated_node
        self._record(targets)
        return append_keywords(updated_node, [("dynamic", cst.Name("True"))], **layout(self, original_node))

    def leave_Decorator(self, original_node: cst.Decorator, updated_node: cst.Decorator) -> cst.Decorator:
        """A bare `@torch.compile` becomes `@torch.compile(dynamic=True)` (a call is leave_Call's)."""
        if not self.targets or isinstance(original_node.decorator, cst.Call):
            return updated_node
        if not self._is_compile(original_node.decorator):
            return updated_node
        targets = self._shape_targets(original_node, self._def_line(original_node))
        if not targets:
            return updated_node
        self._answer(targets)
        self._record(targets)
        flag = cst.Arg(
            keyword=cst.Name("dynamic"),
            value=cst.Name("True"),
            equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
        )
        return updated_node.with_changes(decorator=cst.Call(func=updated_node.decorator, args=[flag]))

    def _refusal(self, call: cst.Call) -> str | None:
        arg = keyword(call, "dynamic")
        if arg is not None:
            return f"{code(call.func)}(...) already sets dynamic={code(arg.value)}, left as the user chose"
        star = next((a for a in call.args if a.star == "**"), None)
        if star is not None:
            return f"{code(call.func)}(...) unpacks **{code(star.value)}, which may set dynamic; add dynamic=True by hand"
        return None

    def _record(self, targets: list[Target]) -> None:
        """One change a target, on its first line (a decorator found from its `def` line is outside it)."""
        facts = [f for f in map(facts_of, targets) if f is not None]
        sizes = sorted({_what_changed(f) for f in facts if f.input})
        what = f" ({', '.join(sizes)})" if sizes else ""
        kinds = "size" if all(f.kind == "shape" for f in facts) else "value"
        message = f"dynamic=True: one graph for every {kinds}{what} instead of a recompile for each new one"
        self.changes.extend(Note(t.line, message) for t in targets)
