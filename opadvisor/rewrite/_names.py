"""How a rewrite spells a function it calls: reuse the file's own imports and aliases, else add one import.

`reference(codemod, module, "torch.nn.functional.scaled_dot_product_attention")` gives, in this order:
the alias of a `from torch.nn.functional import scaled_dot_product_attention [as X]`; `F.scaled_dot_...`
when the file has `import torch.nn.functional as F` or `from torch.nn import functional as F`;
`nn.functional.scaled_dot_...` after `from torch import nn`;
`torch.nn.functional.scaled_dot_...` when `torch` is imported; otherwise it schedules
`from torch.nn.functional import scaled_dot_product_attention` with `AddImportsVisitor` (added once, after
the transform) and uses the bare name — or, when that name is already used for something else in the
file, `import torch.nn.functional` and the dotted name.
"""

from __future__ import annotations

from functools import lru_cache

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.helpers import get_full_name_for_node

from opadvisor.rewrite._walk import Visitor


def _dotted(name: str) -> cst.BaseExpression:
    parts = name.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def _top_level_imports(module: cst.Module) -> list[cst.Import | cst.ImportFrom]:
    out: list[cst.Import | cst.ImportFrom] = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            out.extend(s for s in stmt.body if isinstance(s, cst.Import | cst.ImportFrom))
    return out


class _UsedNames(Visitor):
    """Names a module binds or reads: not attribute names (`F.cross_entropy`), keyword names (`dim=`) or
    the original name of an aliased import (`import x as y` binds only y)."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_ImportAlias(self, node: cst.ImportAlias) -> bool:
        local = node.evaluated_alias or (get_full_name_for_node(node.name) or "").split(".")[0]
        self.names.add(local)
        return False


@lru_cache(maxsize=4)
def names_used(module: cst.Module) -> frozenset[str]:
    """Every name `module` binds or reads anywhere (see `_UsedNames`); once per module (a pass asks at
    each rewrite, and a walk of a large file takes a good part of a second)."""
    visitor = _UsedNames()
    module.visit(visitor)
    return frozenset(visitor.names)


def reference(context: CodemodContext, module: cst.Module, qualified_name: str) -> cst.BaseExpression:
    """An expression naming `qualified_name` in this module (see the module docstring)."""
    module_path, _, obj = qualified_name.rpartition(".")
    imports = _top_level_imports(module)
    bound_root = False
    module_alias: str | None = None
    parent_alias: tuple[str, str] | None = None  # (local name, its module) for `from torch import nn`
    for imp in imports:
        if isinstance(imp, cst.ImportFrom):
            if imp.relative or imp.module is None or isinstance(imp.names, cst.ImportStar):
                continue
            source = get_full_name_for_node(imp.module)
            for alias in imp.names:
                imported = get_full_name_for_node(alias.name)
                local = alias.evaluated_alias or imported
                if source == module_path and imported == obj:
                    return cst.Name(local)  # from pkg.mod import obj [as X]
                if f"{source}.{imported}" == module_path and module_alias is None:
                    module_alias = local  # from pkg import mod [as X]
                elif module_path.startswith(f"{source}.{imported}.") and source == "torch" and local:
                    parent_alias = (local, f"{source}.{imported}")  # from torch import nn: nn.functional.X
        else:
            for alias in imp.names:
                imported = get_full_name_for_node(alias.name) or ""
                if alias.asname is not None:
                    if imported == module_path and module_alias is None:
                        module_alias = alias.evaluated_alias  # import pkg.mod as X
                elif imported.split(".")[0] == module_path.split(".")[0]:
                    # `import torch` (or `import torch.nn`) binds `torch`; the submodule must be imported
                    # for the dotted name to work: torch imports torch.nn.functional itself, others may not.
                    if (
                        imported == module_path
                        or module_path.startswith(imported + ".")
                        and imported == "torch"
                    ):
                        bound_root = True
    if module_alias is not None:
        return cst.Attribute(value=cst.Name(module_alias), attr=cst.Name(obj))
    if parent_alias is not None:  # torch imports its own submodules: `nn.functional` always resolves
        local, parent_module = parent_alias
        return _dotted(local + qualified_name[len(parent_module) :])
    if bound_root:
        return _dotted(qualified_name)
    if obj not in names_used(module):
        AddImportsVisitor.add_needed_import(context, module_path, obj)
        return cst.Name(obj)
    AddImportsVisitor.add_needed_import(context, module_path)
    return _dotted(qualified_name)
