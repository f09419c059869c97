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

import libcst as cst

from opadvisor.rewrite import _match as mt
from opadvisor.rewrite._blocks import BlockEdit, BlockRewriter
from opadvisor.rewrite._chain import Chain, ChainFinder, Segment, Step, _assign_name, _small

KERNEL = "opadvisor.kernels.bias_dropout_add"


def _is_bias(node: cst.BaseExpression) -> bool:
    node = mt.unparen(node)
    if isinstance(node, cst.Name):
        return node.value.endswith("bias")
    if isinstance(node, cst.Attribute):
        return node.attr.value.endswith("bias")
    return False


class FusedDropoutAddCodemod(BlockRewriter):
    RULE = "fused_dropout_add"
    KERNEL_OP = "bias_dropout_add"
    SAFETY = "safe"

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
            drops = [d for d in (finder.peel_post(c, "dropout") for c in mt.nodes_of(small, cst.Call)) if d]
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
        read: cst.BaseExpression = (
            drop.node
        )  # what the add reads: the dropout call, or the temporary holding it
        add_stmt = stmt
        assign = _assign_name(stmt)
        if link and assign is not None and assign[1] is drop.node and index + 1 < len(stmts):
            reads = finder._reads_of(assign[0], stmts[index + 1])
            if len(reads) == 1:
                read, add_stmt = reads[0], stmts[index + 1]
        residual, top = self._residual(finder, read, add_stmt)
        if residual is None:
            return None
        last = index if add_stmt is stmt else index + 1
        start, end = self.stmt_lines(stmts, first, last)
        if self.target_for_lines(start, end) is None:
            return None
        anchor = _small(stmts[first]) or stmts[first]
        x, bias = drop.input, None
        if isinstance(x, cst.BinaryOperation) and isinstance(x.operator, cst.Add) and not x.lpar:
            if _is_bias(x.right):
                x, bias = x.left, x.right
            elif _is_bias(x.left):
                x, bias = x.right, x.left
        module = drop.params.get("module")
        keywords: list[tuple[str, cst.BaseExpression]] = []
        carried: list[cst.CSTNode] = [x, residual] + ([bias] if bias is not None else [])
        if module is not None:
            from opadvisor.rewrite._edit import template

            keywords = [
                ("p", template("__m__.p", m=module)),
                ("training", template("__m__.training", m=module)),
            ]
            carried.append(module)
        else:
            p, training = drop.params["p"], drop.params.get("training")
            assert p is not None
            keywords = [("p", p)] + ([("training", training)] if training is not None else [])
            carried.extend(n for n in (p, training) if n is not None)
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
            problem = finder.temps_problem(chain, carried)
            if problem is not None:
                name, line, _ = problem
                self.skip(
                    anchor, f"not fused: `{name}` is read again at line {line}, so it cannot be folded away"
                )
                return None
        last_stmt = stmts[last]
        assert isinstance(last_stmt, cst.SimpleStatementLine)
        positional = [mt.unparen(x), bias if bias is not None else cst.Name("None"), residual]
        if isinstance(top, cst.AugAssign):
            assert isinstance(top.target, cst.Name)
            probe_call = self.call_for(self.ref(KERNEL), positional, keywords, last_stmt, top.value, indent)
            new: cst.CSTNode = cst.Assign(targets=[cst.AssignTarget(target=top.target)], value=probe_call)
        else:
            new = self.call_for(self.ref(KERNEL), positional, keywords, last_stmt, top, indent)
        what = "bias add -> dropout -> residual add" if bias is not None else "dropout -> residual add"
        self.record_change(anchor, f"{what} -> opadvisor.kernels.bias_dropout_add")
        return BlockEdit(first, last, {id(top): new}, carried)  # type: ignore[dict-item]

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
        for stmt in reversed(stmts[:index]):
            assign = _assign_name(stmt)
            if assign is not None and assign[0] == name:
                if isinstance(assign[1], cst.Name | cst.Attribute | cst.Subscript):
                    break
                for other in stmts:  # `y = x` makes y share x's tensor: `x +=` updates both
                    alias = _assign_name(other)
                    if alias is not None and isinstance(alias[1], cst.Name) and alias[1].value == name:
                        return f"`{name} += ...` also updates `{alias[0]}`, which shares its tensor"
                return None
        return (
            f"`{name} += ...` updates in place a tensor that may be shared (a function argument or a copy of a "
            "name); the fused call would not"
        )
