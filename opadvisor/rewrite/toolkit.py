"""The helpers a rule's fix builds on, for the fixes that live in their family's package
(`opadvisor/rules/<family>/<rule>_fix.py`): the public surface of this package's private modules.

A fix imports `RuleCodemod`, `Target` and `Note` from `opadvisor.rewrite.base` and every other helper from
here; the modules behind these names stay private to `opadvisor.rewrite` (tests/test_layout.py holds a
package's private modules to the package). A helper a fix needs and that is not here is added here, by
name, in the same change.
"""

from __future__ import annotations

from opadvisor.rewrite._args import (
    append_keywords,
    has_star_args,
    keyword,
    layout,
    positional_count,
    remove_keyword,
    replace_keyword_value,
)
from opadvisor.rewrite._bindings import block_index, nearest_before
from opadvisor.rewrite._budget import check as check_budget
from opadvisor.rewrite._compile_edits import (
    after_docstring_and_imports,
    after_imports,
    assignment,
    block_statements,
    branch_value,
    comments_of,
    config_block,
    imported_names,
    kept_tensor,
    scalar_read,
    torch_binding,
    where_call,
)
from opadvisor.rewrite._match import (
    EMBEDDING_CLASSES,
    LINEAR_CLASSES,
    bind_args,
    class_info,
    code,
    enclosing_class,
    int_value,
    is_method,
    names_in,
    nodes_of,
    number_value,
    parent,
    qualified,
    resolves_to,
    self_attr,
    unparen,
)
from opadvisor.rewrite._metadata import text_naming
from opadvisor.rewrite._names import reference
from opadvisor.rewrite._parallel import DDP_NAMES, FULLY_SHARD_NAMES, calls_to, targeted_ddp_call
from opadvisor.rewrite._walk import Transformer, Visitor

__all__ = [
    "DDP_NAMES",
    "EMBEDDING_CLASSES",
    "FULLY_SHARD_NAMES",
    "LINEAR_CLASSES",
    "Transformer",
    "Visitor",
    "after_docstring_and_imports",
    "after_imports",
    "append_keywords",
    "assignment",
    "bind_args",
    "block_index",
    "block_statements",
    "branch_value",
    "calls_to",
    "check_budget",
    "class_info",
    "code",
    "comments_of",
    "config_block",
    "enclosing_class",
    "has_star_args",
    "imported_names",
    "int_value",
    "is_method",
    "kept_tensor",
    "keyword",
    "layout",
    "names_in",
    "nearest_before",
    "nodes_of",
    "number_value",
    "parent",
    "positional_count",
    "qualified",
    "reference",
    "remove_keyword",
    "replace_keyword_value",
    "resolves_to",
    "scalar_read",
    "self_attr",
    "targeted_ddp_call",
    "text_naming",
    "torch_binding",
    "unparen",
    "where_call",
]
