"""Codemod for `fp32_gemm`: let float32 matrix products use tensor cores (TF32), or run the step in bf16.

Two fixes, both unsafe (they change numerics), chosen with the constructor's `mode`:

- `mode="tf32"` (the default) inserts, once, after the module docstring, `from __future__` imports and the
  leading imports (after the statement that imports torch, when that comes later):

      torch.backends.cuda.matmul.allow_tf32 = True
      torch.backends.cudnn.allow_tf32 = True

  Float32 matmuls and convolutions then round their inputs to TF32 (10-bit mantissa) on Ampere and newer
  GPUs. A line is not inserted when the file already sets that flag (any value, also
  `torch.set_float32_matmul_precision(...)` or the `fp32_precision` settings of torch >= 2.9); an explicit
  False is left as the user chose. In profile mode it inserts when any target names this file; the
  findings' lines are the matmuls, the flags are process-wide.

- `mode="autocast"` wraps the statements at the target lines (the forward and loss of the training step)
  in `with torch.autocast(device_type="cuda", dtype=torch.bfloat16):`. Only whole simple statements inside
  a loop body are wrapped; statements that call `.backward()`, `.step()` or `.zero_grad()` are left outside
  (backward under autocast is not recommended); targets on a compound statement (if/for/with), outside a
  loop, or already under `torch.autocast` are skipped with the reason. It needs targets: in static mode it
  rewrites nothing. On a machine without CUDA `torch.autocast("cuda")` warns and does nothing.

No finding facts are used.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import Note, RuleCodemod, Target
from opadvisor.rewrite.toolkit import (
    AUTOCASTS,
    after_docstring_and_imports,
    code,
    config_block,
    nodes_of,
    qualified,
    text_naming,
    torch_binding,
)

MODES = ("tf32", "autocast")
# the last part of every setting's name below: no setting where the text names none
_SETTING_WORDS = re.compile(r"allow_tf32|fp32_precision|set_float32_matmul_precision")
MATMUL_SETTINGS = frozenset(
    {
        "torch.backends.cuda.matmul.allow_tf32",
        "torch.backends.cuda.matmul.fp32_precision",
        "torch.backends.fp32_precision",
        "torch.set_float32_matmul_precision",
    }
)
CUDNN_SETTINGS = frozenset(
    {
        "torch.backends.cudnn.allow_tf32",
        "torch.backends.cudnn.conv.fp32_precision",
        "torch.backends.cudnn.fp32_precision",
        "torch.backends.fp32_precision",
    }
)
STEP_METHODS = frozenset({"backward", "step", "zero_grad"})
_KEYWORDS = {
    cst.If: "if",
    cst.For: "for",
    cst.While: "while",
    cst.With: "with",
    cst.Try: "try",
    cst.FunctionDef: "def",
    cst.ClassDef: "class",
    cst.Match: "match",
}
TF32_COMMENT = (
    "# TF32 tensor cores for float32 matmuls and convolutions (opadvisor fp32_gemm: changes numerics)"
)


class Fp32GemmCodemod(RuleCodemod):
    """TF32 flags at the script's start (default), or bf16 autocast around the step's forward (mode)."""

    RULE: ClassVar[str] = "fp32_gemm"
    NO_KERNEL_OP: ClassVar[str] = "a TF32 switch or bf16 autocast: PyTorch's own matrix products run"
    SAFETY: ClassVar[str] = "unsafe"
    # static mode (TF32 lines at the top) reads the module's top level and the settings already made
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (_SETTING_WORDS.pattern,)
    NEEDS_WORDS: ClassVar[bool] = False
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(
        self, context: CodemodContext, targets: Sequence[Target] | None = None, *, mode: str = "tf32"
    ) -> None:
        super().__init__(context, targets)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self._torch = "torch"
        self._torch_imported = False
        self._found: tuple[Sequence[cst.Assign], Sequence[cst.Call]] | None = None  # _candidates

    def visit_Module(self, node: cst.Module) -> None:
        self._torch = next((b for b in map(torch_binding, node.body) if b), "torch")
        self._torch_imported = any(torch_binding(s) for s in node.body)
        if self.mode == "autocast" and self.targets is None:
            self.skipped.append(
                Note(
                    1,
                    "autocast mode wraps the step's lines named by a profile: nothing to do without targets",
                )
            )

    # ---- mode "tf32" --------------------------------------------------------------------------------------
    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        module = self._tf32(original_node, updated_node) if self.mode == "tf32" else updated_node
        self.changes.sort(key=lambda n: n.line)
        self.skipped.sort(key=lambda n: n.line)
        return module

    def _tf32(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if self.targets is not None and not self.targets:
            return updated_node
        wanted = {
            "cuda.matmul": (MATMUL_SETTINGS, f"{self._torch}.backends.cuda.matmul.allow_tf32 = True"),
            "cudnn": (CUDNN_SETTINGS, f"{self._torch}.backends.cudnn.allow_tf32 = True"),
        }
        lines: list[str] = []
        for key, (settings, line) in wanted.items():
            existing = self._existing_setting(original_node, settings)
            if existing is None:
                lines.append(line)
            else:
                node, value = existing
                what = (
                    f"sets it to {value}, left as the user chose"
                    if value in ("False", "'highest'", '"highest"')
                    else "already sets it"
                )
                self.skipped.append(
                    Note(self.lines_of(node)[0], f"TF32 for {key}: the file {what} ({code(node).strip()})")
                )
        if not lines:
            return updated_node

        body = list(updated_node.body)
        at = after_docstring_and_imports(body)
        bound_at = next((i + 1 for i, s in enumerate(body) if torch_binding(s)), None)
        if bound_at is None:
            AddImportsVisitor.add_needed_import(self.context, "torch")
        else:
            at = max(at, bound_at)
        new = config_block([(TF32_COMMENT, lines)])
        line = self.lines_of(original_node.body[at - 1])[1] + 1 if at else 1
        self.changes.append(
            Note(
                line,
                "TF32 for float32 matmuls and convolutions: "
                + "; ".join(lines)
                + " (unsafe: numerics change)",
            )
        )
        return updated_node.with_changes(body=[*body[:at], *new, *body[at:]])

    def _existing_setting(self, module: cst.Module, names: frozenset[str]) -> tuple[cst.CSTNode, str] | None:
        assigns, calls = self._candidates(module)
        for assign in assigns:
            for t in assign.targets:
                if qualified(self, t.target) & names:
                    return assign, code(assign.value)
        for call in calls:
            if qualified(self, call.func) & names:
                return call, code(call.args[0].value) if call.args else ""
        return None

    def _candidates(self, module: cst.Module) -> tuple[Sequence[cst.Assign], Sequence[cst.Call]]:
        """The assignments and calls that may set TF32, found once per pass: none without a setting's name
        in the text (a walk of a 5,000-line file with matchers takes seconds)."""
        if self._found is None:
            if _SETTING_WORDS.search(text_naming(module).decode("utf-8", "replace")) is None:
                self._found = ((), ())
            else:
                found = nodes_of(module, (cst.Assign, cst.Call))  # one walk for both
                assigns = [n for n in found if isinstance(n, cst.Assign)]
                self._found = (assigns, [n for n in found if isinstance(n, cst.Call)])
        return self._found

    # ---- mode "autocast" ----------------------------------------------------------------------------------
    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if self.mode != "autocast" or not self.targets:
            return updated_node
        hit = [i for i, s in enumerate(original_node.body) if self.targeted(s) is not None]
        if not hit:
            return updated_node
        reason = self._block_refusal(original_node)
        if reason is not None:
            self.skip(original_node.body[hit[0]], reason)
            return updated_node
        groups = self._autocast_groups(original_node, hit)
        if not groups:
            return updated_node
        body = list(updated_node.body)
        for group in reversed(groups):
            first, last = group[0], group[-1]
            body[first : last + 1] = [self._autocast_with(original_node, body, first, last)]
        if not self._torch_imported:
            AddImportsVisitor.add_needed_import(self.context, "torch")
        return updated_node.with_changes(body=body)

    def _autocast_groups(self, original_node: cst.IndentedBlock, hit: list[int]) -> list[list[int]]:
        """The targeted statements of the block in runs of adjacent simple statements (each run goes under
        one `with torch.autocast`); compound, already-autocast and backward/optimizer statements skipped."""
        groups: list[list[int]] = []
        for i in hit:
            stmt = original_node.body[i]
            if not isinstance(stmt, cst.SimpleStatementLine):
                start, end = self.lines_of(stmt)
                if any(start <= note.line <= end for note in self.changes):
                    continue  # the targeted statements inside it were wrapped
                if isinstance(stmt, cst.With) and self._is_autocast_with(stmt):
                    self.skip(stmt, "already under torch.autocast")
                else:
                    kind = _KEYWORDS.get(type(stmt), type(stmt).__name__)
                    self.skip(
                        stmt, f"line {start} starts a compound `{kind}` statement: wrap its lines by hand"
                    )
                continue
            if self._is_step_statement(stmt):
                self.skip(stmt, "backward/optimizer statement left outside autocast")
                continue
            if groups and groups[-1][-1] == i - 1:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _autocast_with(
        self, original_node: cst.IndentedBlock, body: list[cst.BaseStatement], first: int, last: int
    ) -> cst.With:
        """Statements first..last of the block under `with torch.autocast("cuda", bfloat16)`, recorded."""
        inner = [*body[first : last + 1]]
        leading = inner[0].leading_lines  # type: ignore[attr-defined]
        inner[0] = inner[0].with_changes(leading_lines=[])
        t = self._torch
        with_stmt = cst.With(
            items=[
                cst.WithItem(cst.parse_expression(f'{t}.autocast(device_type="cuda", dtype={t}.bfloat16)'))
            ],
            body=cst.IndentedBlock(body=inner),
            leading_lines=leading,
        )
        start, end = (
            self.lines_of(original_node.body[first])[0],
            self.lines_of(original_node.body[last])[1],
        )
        span = f"line {start}" if start == end else f"lines {start}-{end}"
        self.record_change(
            original_node.body[first],
            f'{span} run under torch.autocast("cuda", bfloat16) (unsafe: numerics change)',
        )
        return with_stmt

    def _block_refusal(self, block: cst.IndentedBlock) -> str | None:
        in_loop = False
        node: cst.CSTNode | None = block
        while node is not None and not isinstance(node, cst.FunctionDef | cst.ClassDef | cst.Lambda):
            if isinstance(node, cst.With) and self._is_autocast_with(node):
                return "already under torch.autocast"
            if isinstance(node, cst.For | cst.While):
                in_loop = True
            node = self.get_metadata(ParentNodeProvider, node, None)
        return (
            None
            if in_loop
            else "not inside a loop body: autocast is applied to the training step's lines only"
        )

    def _is_autocast_with(self, stmt: cst.With) -> bool:
        return any(
            isinstance(item.item, cst.Call) and qualified(self, item.item.func) & AUTOCASTS
            for item in stmt.items
        )

    @staticmethod
    def _is_step_statement(stmt: cst.SimpleStatementLine) -> bool:
        return bool(
            m.findall(stmt, m.Call(func=m.Attribute(attr=m.OneOf(*(m.Name(n) for n in STEP_METHODS)))))
        )
