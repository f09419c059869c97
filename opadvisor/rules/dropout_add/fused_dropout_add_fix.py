"""fused_dropout_add: (bias add ->) dropout -> residual add into `opadvisor.kernels.bias_dropout_add`.

Before::

    x = self.norm1(x + self.out_dropout(self.out_proj(ctx)))

After::

    x = self.norm1(bias_dropout_add(self.out_proj(ctx), None, x, p=self.out_dropout.p,
                                    training=self.out_dropout.training))

`bias_dropout_add(x, bias, residual, p, training=True)` computes `residual + dropout(x + bias)` (bias may be
None) in one kernel. Recognised: `residual + drop(h)` and `drop(h) + residual`, with `drop` an nn.Dropout
module assigned in `__init__` (its `p` and `training` are read at run time: `self.drop.p`,
`self.drop.training`), `F.dropout(h, p, training)` or `torch.dropout(h, p, train)`; the dropout result held
in a temporary the next statement adds (`h = self.drop(h)` then `x = x + h`); and the in-place
`x += drop(h)`, which becomes `x = bias_dropout_add(...)`. When the dropout's input is `a + b` and `b` reads
as a bias (a name or attribute called `...bias`), the bias add is fused too.

Left alone, with the reason: a temporary read again elsewhere, and `x += ...` where `x` may share its
tensor with something else (a function argument, or a name it was copied from), since the rewrite no
longer updates that tensor in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider

from opadvisor.rewrite import toolkit as mt
from opadvisor.rewrite.base import Target, target_facts
from opadvisor.rewrite.toolkit import (
    BlockEdit,
    BlockRewriter,
    Chain,
    ChainFinder,
    Segment,
    Step,
    block_index,
)
from opadvisor.rewrite.toolkit import assign_name as _assign_name
from opadvisor.rewrite.toolkit import small_statement as _small
from opadvisor.rules.dropout_add.fused_dropout_add import DropoutAddFacts
from opadvisor.rules.patterns import DROPOUT, RESIDUAL

KERNEL = "opadvisor.kernels.bias_dropout_add"
PARAMETER = frozenset({"torch.nn.Parameter", "torch.nn.parameter.Parameter"})
RESHAPING = frozenset(
    {"unsqueeze", "expand", "expand_as", "view", "reshape", "to", "type_as", "repeat", "contiguous"}
)
FILLED = frozenset({"torch.zeros", "torch.ones", "torch.empty", "torch.randn", "torch.rand", "torch.full"})


def _add_read(
    finder: ChainFinder, stmts: Sequence[cst.BaseStatement], index: int, drop: Step, link: bool
) -> tuple[cst.BaseExpression, cst.BaseStatement, tuple[str, cst.BaseExpression] | None]:
    """(what the add reads: the dropout call, or the temporary holding it; the statement of the add;
    statement `index` as `name = value`, None when it is not one)."""
    stmt = stmts[index]
    read: cst.BaseExpression = drop.node
    add_stmt = stmt
    assign = _assign_name(stmt)
    if link and assign is not None and assign[1] is drop.node and index + 1 < len(stmts):
        reads = finder._reads_of(assign[0], stmts[index + 1])
        if len(reads) == 1:
            read, add_stmt = reads[0], stmts[index + 1]
    return read, add_stmt, assign


def _dropout_keywords(drop: Step, carried: list[cst.CSTNode]) -> list[tuple[str, cst.BaseExpression]]:
    """The kernel's p= and training= as the dropout had them (a module's: `m.p`, `m.training`); what they
    read is added to `carried`."""
    module = drop.params.get("module")
    if module is not None:
        from opadvisor.rewrite.toolkit import template

        carried.append(module)
        return [
            ("p", template("__m__.p", m=module)),
            ("training", template("__m__.training", m=module)),
        ]
    p, training = drop.params["p"], drop.params.get("training")
    assert p is not None
    carried.extend(n for n in (p, training) if n is not None)
    return [("p", p)] + ([("training", training)] if training is not None else [])


def _innermost(functions: list[tuple[str, int, int]], line: int) -> tuple[str, int] | None:
    """(name, first line) of the innermost def holding `line`."""
    holding = [(end - start, name, start) for name, start, end in functions if start <= line <= end]
    return min(holding)[1:] if holding else None


def _one_dim(finder: ChainFinder, node: cst.BaseExpression) -> bool:
    """The source shows `node` is a 1-D tensor: a Linear's `.bias`, or `nn.Parameter(torch.zeros(n))`."""
    node = mt.unparen(node)
    if isinstance(node, cst.Attribute) and node.attr.value == "bias" and mt.self_attr(node.value):
        owner = finder.class_value(node.value)
        if isinstance(owner, cst.Call) and mt.resolves_to(finder.cm, owner.func, mt.LINEAR_CLASSES):
            return True
    value = finder.class_value(node) if mt.self_attr(node) else None
    if not (isinstance(value, cst.Call) and mt.resolves_to(finder.cm, value.func, PARAMETER)):
        return False
    inner = value.args[0].value if value.args else None
    if not (isinstance(inner, cst.Call) and mt.resolves_to(finder.cm, inner.func, FILLED)):
        return False
    sizes = [a for a in inner.args if a.keyword is None]
    return len(sizes) == 1 and not isinstance(sizes[0].value, cst.Tuple | cst.List)


def _learned_table(finder: ChainFinder, node: cst.BaseExpression, depth: int = 0) -> bool:
    """The source shows `node` is a parameter (or a slice of one) or an nn.Embedding lookup."""
    node = mt.unparen(node)
    while isinstance(node, cst.Subscript) or _reshaping_call(node):
        node = mt.unparen(node.value if isinstance(node, cst.Subscript) else node.func.value)  # type: ignore[union-attr]
    if isinstance(node, cst.Name):
        # bounded: `h = h.reshape(...)` names itself among its own values
        return depth < 3 and any(
            _learned_table(finder, v, depth + 1) for v in mt.local_values(finder.cm, node)
        )
    if isinstance(node, cst.Call):
        module = finder.class_value(node.func) if mt.self_attr(node.func) else None
        return isinstance(module, cst.Call) and mt.resolves_to(finder.cm, module.func, mt.EMBEDDING_CLASSES)
    value = finder.class_value(node) if mt.self_attr(node) else None
    return isinstance(value, cst.Call) and mt.resolves_to(finder.cm, value.func, PARAMETER)


def _reshaping_call(node: cst.BaseExpression) -> bool:
    """`t.unsqueeze(0)`, `t.expand(...)`, `t.view(...)`, `t.to(...)` ...: the same values, reshaped or cast."""
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value in RESHAPING
        and not m.matches(node.func.value, m.Name("self"))
    )


def _dropout_in_place(finder: ChainFinder, drop: Step) -> bool:
    """`nn.Dropout(..., inplace=True)` in __init__, or `F.dropout(..., inplace=True)`."""
    call = drop.node
    ctor = finder.class_value(call.func) if isinstance(call, cst.Call) and mt.self_attr(call.func) else None
    for node in (ctor, call):
        if isinstance(node, cst.Call):
            for arg in node.args:
                if arg.keyword is not None and arg.keyword.value == "inplace":
                    return not m.matches(arg.value, m.Name("False"))
    return False


def _read_after(
    cm: cst.MetadataDependent, stmts: Sequence[cst.BaseStatement], index: int, name: str
) -> int | None:
    """The line of the first read of `name` after statement `index` in the block (before it is rebound)."""
    for stmt in stmts[index + 1 :]:
        small = _small(stmt)
        reading: cst.CSTNode = small.value if isinstance(small, cst.Assign) else stmt
        for node in mt.names_in(reading):
            par = mt.parent(cm, node)
            if node.value == name and not (isinstance(par, cst.Attribute) and par.attr is node):
                return cm.get_metadata(PositionProvider, node).start.line
        if _assign_name(stmt) is not None and _assign_name(stmt)[0] == name:
            return None  # rebound before any read
    return None


def _is_op_like(node: cst.BaseExpression) -> bool:
    """A computed tensor (a call or arithmetic) rather than a bias read from a name or attribute."""
    return isinstance(mt.unparen(node), cst.Call | cst.BinaryOperation)


class FusedDropoutAddCodemod(BlockRewriter):
    RULE = "fused_dropout_add"
    FACTS = DropoutAddFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (
        "dropout",
        "bernoulli",
        "rand",
    )  # a dropout: a module or function, or a mask drawn by hand
    KERNEL_OP = "bias_dropout_add"
    SAFETY = "safe"

    def unmatched_reason(
        self, target: Target, functions: list[tuple[str, int, int]], lines: list[str]
    ) -> str | None:
        drop, add = target.step_line(DROPOUT), target.step_line(RESIDUAL)
        if drop is None or add is None:
            return None
        inner, outer = _innermost(functions, drop[0]), _innermost(functions, add[0])
        if inner is not None and inner != outer:
            return (
                f"not fused: the dropout (line {drop[0]}, in the {inner[0]} defined at line {inner[1]}) and the "
                f"residual add (line {add[0]}, in its caller) are in two functions; fusing them would change "
                "what the first one returns"
            )
        text = lines[drop[0] - 1].strip() if 0 < drop[0] <= len(lines) else ""
        return (
            f"not fused: no dropout call at line {drop[0]} (`{text}`): it runs inside a module or function "
            "called there (an nn.Sequential, a library layer), which this rewrite does not open"
        )

    def block_edits(self, stmts: Sequence[cst.BaseStatement], indent: str) -> list[BlockEdit]:
        finder = ChainFinder(self, stmts, sdpa=False)
        edits: list[BlockEdit] = []
        lower = 0
        for index, stmt in enumerate(stmts):
            if index < lower:
                continue
            small = _small(stmt)
            if small is None:
                continue
            drops = [d for d in (finder.peel_post(c, DROPOUT) for c in mt.nodes_of(small, cst.Call)) if d]
            for drop in drops:
                edit = self._edit_for(finder, stmts, index, drop, indent, link=len(drops) == 1)
                if edit is not None:
                    edits.append(edit)
                    lower = edit.last + 1
                    break
        return edits

    def _edit_for(
        self,
        finder: ChainFinder,
        stmts: Sequence[cst.BaseStatement],
        index: int,
        drop: Step,
        indent: str,
        link: bool,
    ) -> BlockEdit | None:
        stmt = stmts[index]
        small = _small(stmt)
        assert small is not None and drop.input is not None
        first = index
        read, add_stmt, assign = _add_read(finder, stmts, index, drop, link)
        residual, top = self._residual(finder, read, add_stmt)
        if residual is None:
            return None
        last = index if add_stmt is stmt else index + 1
        start, end = self.stmt_lines(stmts, first, last)
        target = self.target_for_lines(start, end)
        if target is None:
            return None
        anchor = _small(stmts[first]) or stmts[first]
        facts = target_facts(target, DropoutAddFacts)
        if facts is not None and not self._is_profiled_site(stmts, first, target):
            return None  # another dropout in the finding's lines: not the chain the profile saw
        problem = self._site_problem(finder, stmts, index, drop, residual, facts)
        if problem is not None:
            self.skip(anchor, f"not fused: {problem}")
            return None
        x, bias = self._split_bias(finder, drop.input, facts)
        carried: list[cst.CSTNode] = [x, residual] + ([bias] if bias is not None else [])
        keywords = _dropout_keywords(drop, carried)
        if isinstance(top, cst.AugAssign):
            problem = self._shared_in_place(finder, stmts, last, top)
            if problem:
                self.skip(anchor, f"not fused: {problem}")
                return None
        if last > first:
            chain = Chain(
                [
                    Segment(first, [drop], drop.input, drop.node, assign[0] if assign else None),
                    Segment(
                        last, [], read, top, _assign_name(add_stmt)[0] if _assign_name(add_stmt) else None
                    ),
                ],
                0,
            )
            if not self._temps_fold(finder, chain, carried, anchor):
                return None
        positional = [mt.unparen(x), bias if bias is not None else cst.Name("None"), residual]
        new = self._kernel_call(stmts[last], top, positional, keywords, indent)
        what = "bias add -> dropout -> residual add" if bias is not None else "dropout -> residual add"
        self.record_change(anchor, f"{what} -> opadvisor.kernels.bias_dropout_add")
        return BlockEdit(first, last, {id(top): new}, carried)  # type: ignore[dict-item]

    def _temps_fold(
        self, finder: ChainFinder, chain: Chain, carried: list[cst.CSTNode], anchor: cst.CSTNode
    ) -> bool:
        """Whether the temporary between the dropout and the add can be folded away (else a skip, said)."""
        problem = finder.temps_problem(chain, carried)
        if problem is None:
            return True
        name, line, _ = problem
        self.skip(anchor, f"not fused: `{name}` is read again at line {line}, so it cannot be folded away")
        return False

    def _kernel_call(
        self,
        last_stmt: cst.BaseStatement,
        top: cst.CSTNode,
        positional: list[cst.BaseExpression],
        keywords: list[tuple[str, cst.BaseExpression]],
        indent: str,
    ) -> cst.CSTNode:
        """The bias_dropout_add call that replaces `top` (an in-place `x += ...` becomes `x = call`)."""
        assert isinstance(last_stmt, cst.SimpleStatementLine)
        if isinstance(top, cst.AugAssign):
            assert isinstance(top.target, cst.Name)
            probe_call = self.call_for(self.ref(KERNEL), positional, keywords, last_stmt, top.value, indent)
            return cst.Assign(targets=[cst.AssignTarget(target=top.target)], value=probe_call)
        return self.call_for(self.ref(KERNEL), positional, keywords, last_stmt, top, indent)

    # ---- the facts of the site ------------------------------------------------------------------------
    def _is_profiled_site(self, stmts: Sequence[cst.BaseStatement], first: int, target: Target) -> bool:
        """Whether the dropout of statement `first` is the one profiled (a call: its line is exact; the
        residual add is found from it, and the profile may place an operator's line a little early)."""
        profiled = target.step_line(DROPOUT)
        start, end = self.stmt_lines(stmts, first, first)
        return profiled is None or (start <= profiled[1] and profiled[0] <= end)

    def _site_problem(
        self,
        finder: ChainFinder,
        stmts: Sequence[cst.BaseStatement],
        index: int,
        drop: Step,
        residual: cst.BaseExpression,
        facts: DropoutAddFacts | None,
    ) -> str | None:
        """Why this site may not become one bias_dropout_add call (the facts, else what the source shows)."""
        if mt.jit_scripted(self, stmts[index]):
            return "the function is compiled by TorchScript (@torch.jit.script), which cannot compile the fused call"
        if facts is not None:
            if (
                facts.residual_shape is not None
                and facts.shape is not None
                and facts.residual_shape != facts.shape
            ):
                return (
                    f"the residual {facts.residual_shape} is not of the dropout output's shape {facts.shape} "
                    "(it broadcasts); the fused call needs one shape"
                )
            if any(k in {"param", "frozen", "buffer"} for k in facts.residual_kinds):
                return "one side of the add is a parameter or buffer (an embedding), not a residual stream"
        elif _learned_table(finder, residual):
            return (
                f"`{mt.code(residual)}` is a parameter or an embedding lookup, whose shape need not be the "
                "dropout output's (a broadcast add); profile the script to check it"
            )
        inplace = (facts is not None and facts.dropout_inplace) or _dropout_in_place(finder, drop)
        if inplace and isinstance(drop.input, cst.Name):
            later = _read_after(self, stmts, index, drop.input.value)
            if later is not None:
                return (
                    f"the dropout works in place, so it also changes `{drop.input.value}`, which is read "
                    f"again at line {later}; the fused call would leave it unchanged"
                )
        return None

    def _split_bias(
        self, finder: ChainFinder, value: cst.BaseExpression, facts: DropoutAddFacts | None
    ) -> tuple[cst.BaseExpression, cst.BaseExpression | None]:
        """(x, bias) of the dropout's input `x + bias`: only a bias the profile saw as a separate 1-D add
        (or, without a profile, one the source shows is 1-D); else (value, None)."""
        if not (
            isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add) and not value.lpar
        ):
            return value, None
        if facts is not None:
            seen = facts.bias_operand
            if facts.bias != "add" or seen is None or seen.shape is None or len(seen.shape) != 1:
                return value, None
            # the 1-D side, as the source reads: the non-flowing operand of the add
            left, right = value.left, value.right
            return (left, right) if not _is_op_like(right) else (right, left)
        for x, bias in ((value.left, value.right), (value.right, value.left)):
            if _one_dim(finder, bias):
                return x, bias
        return value, None

    def _residual(
        self, finder: ChainFinder, read: cst.BaseExpression, stmt: cst.CSTNode
    ) -> tuple[cst.BaseExpression | None, cst.CSTNode]:
        """The residual added to `read`, and the node to replace (the addition, or a `+=` statement)."""
        small = _small(stmt)
        if (
            isinstance(small, cst.AugAssign)
            and isinstance(small.operator, cst.AddAssign)
            and small.value is read
        ):
            if isinstance(small.target, cst.Name):
                return cst.Name(small.target.value), small
            return None, stmt
        op = finder.enclosing_op(read)
        if isinstance(op, cst.BinaryOperation) and isinstance(op.operator, cst.Add):
            if op.right is read:
                return op.left, op
            if op.left is read:
                return op.right, op
        return None, stmt

    def _shared_in_place(
        self, finder: ChainFinder, stmts: Sequence[cst.BaseStatement], index: int, aug: cst.AugAssign
    ) -> str | None:
        name = aug.target.value  # type: ignore[union-attr]
        bound = block_index(stmts).simple_before(name, index)
        if bound is not None and not isinstance(bound.value, cst.Name | cst.Attribute | cst.Subscript):
            for other in stmts:  # `y = x` makes y share x's tensor: `x +=` updates both
                alias = _assign_name(other)
                if alias is not None and isinstance(alias[1], cst.Name) and alias[1].value == name:
                    return f"`{name} += ...` also updates `{alias[0]}`, which shares its tensor"
            return None
        return (
            f"`{name} += ...` updates in place a tensor that may be shared (a function argument or a copy of a "
            "name); the fused call would not"
        )
