"""Codemod for `sparse_launch`: replay the model's forward and backward from CUDA graphs.

What it rewrites: the module whose parameters an optimizer trains, `model` in
`torch.optim.AdamW(model.parameters(), ...)` (any `torch.optim` class, however imported), gets
`model = cuda_graphed(model)` on the line before that construction, with
`from opadvisor.kernels import cuda_graphed` (or the file's own spelling of it). `cuda_graphed` returns the
same module with its `forward` replaced: per input signature it captures the forward and backward in CUDA
graphs on the first call and replays them afterwards, so a step that launches thousands of short kernels
launches two graphs (see opadvisor/kernels/graphs.py). The rest of the step (data, loss, optimizer) is left
as written.

Fix safety: unsafe. The rewritten program computes the same values (tested), but graphs freeze what
Python did while they were captured: outputs of the model are overwritten by its next call (code that keeps
an old step's output must clone it), Python side effects inside forward (prints, counters, Python-side
randomness) happen only at capture, dropout draws other (equally distributed) masks, and capture costs
four extra forward/backward passes per new input shape. `cuda_graphed` itself runs the original forward
wherever graphing cannot be right (no gradients, non-tensor or keyword arguments, hooks, changed
parameters, a second forward before the first backward, a capture that fails: it warns once).

Refused (left alone, with the reason): an optimizer whose first argument is not `NAME.parameters()` (a
parameter list or groups: which module to graph is not clear from the code), and a file that wraps a
module in `DistributedDataParallel` (its gradient hooks would run only at capture). A file that already
calls `cuda_graphed` is left as it is (idempotent).

Targets: sparse_launch's findings name the functions whose launches leave the GPU idle, not the
optimizer's line: a target anywhere in a file rewrites that file's optimizer constructions.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite._match import qualified
from opadvisor.rewrite._names import reference
from opadvisor.rewrite.base import RuleCodemod

KERNEL = "opadvisor.kernels.cuda_graphed"
KERNEL_NAMES = frozenset({KERNEL, "opadvisor.kernels.graphs.cuda_graphed"})
DDP_NAMES = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DataParallel",
        "torch.nn.parallel.DataParallel",
    }
)
_PARAMETERS_OF_NAME = m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("parameters")), args=[])


class CudaGraphsCodemod(RuleCodemod):
    """Wrap the optimized module in `cuda_graphed` before its optimizer is built."""

    RULE: ClassVar[str] = "sparse_launch"
    NO_KERNEL_OP: ClassVar[str] = (
        "opadvisor.kernels.cuda_graphed keeps no dispatch record (a replay runs no Python to count); "
        "verify's step times show whether the graphs ran"
    )
    SAFETY: ClassVar[str] = "unsafe"
    # it inserts `model = cuda_graphed(model)` before the optimizer's line, which fused_optimizer may have
    # given `fused=True`: the two compose
    COMPOSES: ClassVar[bool] = True
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        self._already = False
        self._ddp = False
        for call in m.findall(node, m.Call()):
            names = qualified(self, call.func)  # type: ignore[attr-defined]
            self._already = self._already or bool(names & KERNEL_NAMES)
            self._ddp = self._ddp or bool(names & DDP_NAMES)
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.targets and not self._already and not self.changes and not self.skipped:
            self.skip(
                original_node,
                "no torch.optim optimizer built from `model.parameters()` in this file: wrap the module that "
                "runs the step by hand: model = opadvisor.kernels.cuda_graphed(model)",
            )
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.BaseStatement | cst.FlattenSentinel[cst.BaseStatement]:
        if self._already or (self.targets is not None and not self.targets):
            return updated_node
        wrapped: list[str] = []
        for call in m.findall(original_node, m.Call()):
            if not any(name.startswith("torch.optim.") for name in qualified(self, call.func)):
                continue
            model = self._optimized_module(call)
            if model is not None and model not in wrapped:
                wrapped.append(model)
        if not wrapped:
            return updated_node
        graphed = reference(self.context, self._module, KERNEL)
        wraps = [
            cst.SimpleStatementLine(
                body=[
                    cst.Assign(
                        targets=[cst.AssignTarget(cst.Name(name))],
                        value=cst.Call(func=graphed, args=[cst.Arg(cst.Name(name))]),
                    )
                ]
            )
            for name in wrapped
        ]
        # blank lines go before the new lines, comments stay on the optimizer's
        lead = list(updated_node.leading_lines)
        cut = next((i for i, line in enumerate(lead) if line.comment is not None), len(lead))
        first = wraps[0].with_changes(leading_lines=lead[:cut])
        return cst.FlattenSentinel([first, *wraps[1:], updated_node.with_changes(leading_lines=lead[cut:])])

    def _optimized_module(self, call: cst.Call) -> str | None:
        """`NAME` of `torch.optim.X(NAME.parameters(), ...)`, or None (with the reason recorded)."""
        if self._ddp:
            self.skip(
                call,
                "the file wraps a module in DistributedDataParallel: its gradient hooks would run only "
                "while the graphs are captured; graph the module inside DDP by hand (DDP static_graph)",
            )
            return None
        first = call.args[0] if call.args and call.args[0].keyword is None and not call.args[0].star else None
        if first is None or not m.matches(first.value, _PARAMETERS_OF_NAME):
            self.skip(
                call,
                "the optimizer is not built from `model.parameters()`: which module to graph is not clear "
                "from the code; wrap it by hand: model = cuda_graphed(model)",
            )
            return None
        name = first.value.func.value.value  # type: ignore[attr-defined]
        self.record_change(
            call,
            f"{name} = cuda_graphed({name}): its forward and backward replay from CUDA graphs (per input shape)",
        )
        return name
