"""libcst's visitor and transformer without the per-attribute hooks, for the walks of this package.

libcst calls `on_visit_attribute` / `on_leave_attribute` for every field of every node it walks, each
looking up a `visit_<Node>_<field>` method by name: about a tenth of a walk's time, for hooks no visitor
here defines. These bases skip them (RuleCodemod does the same for the codemods).
"""

from __future__ import annotations

import libcst as cst


class Visitor(cst.CSTVisitor):
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        return None

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        return None


class Transformer(cst.CSTTransformer):
    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        return None

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        return None
