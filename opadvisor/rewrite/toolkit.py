"""The helpers a rule's fix builds on, for the fixes that live in their family's package
(`opadvisor/rules/<family>/<rule>_fix.py`): the public surface of this package's private modules.

A fix imports `RuleCodemod`, `Target` and `Note` from `opadvisor.rewrite.base` and every other helper from
here; the modules behind these names stay private to `opadvisor.rewrite` (tests/test_layout.py holds a
package's private modules to the package). A helper a fix needs and that is not here is added here, by
name, in the same change.
"""

from __future__ import annotations

from opadvisor.rewrite._algebra import Converter, activation_of
from opadvisor.rewrite._args import (
    append_keywords,
    has_star_args,
    keyword,
    layout,
    positional_count,
    remove_keyword,
    replace_keyword_value,
)
from opadvisor.rewrite._bindings import Resolver, block_index, nearest_before, simple_binding
from opadvisor.rewrite._blocks import BlockEdit, BlockRewriter
from opadvisor.rewrite._budget import analysing
from opadvisor.rewrite._budget import check as check_budget
from opadvisor.rewrite._chain import (
    CAST,
    Chain,
    ChainFinder,
    Segment,
    SoftmaxChainRewriter,
    Step,
    cast_problem,
    guarded,
    upcast_problem,
)
from opadvisor.rewrite._chain import _assign_name as assign_name
from opadvisor.rewrite._chain import _float32_cast as float32_cast
from opadvisor.rewrite._chain import _small as small_statement
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
from opadvisor.rewrite._dropout_match import DropoutMatch, DropoutMatcher
from opadvisor.rewrite._edit import atomic, invert, reciprocal, template
from opadvisor.rewrite._match import (
    AUTOCASTS,
    EMBEDDING_CLASSES,
    LINEAR_CLASSES,
    ONES_FUNCS,
    TRIL_FUNCS,
    TRIU_FUNCS,
    bind_args,
    class_info,
    code,
    contains,
    enclosing_class,
    int_value,
    is_finfo_min,
    is_method,
    is_neg_inf,
    jit_scripted,
    local_values,
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
from opadvisor.rewrite._parallel import (
    DDP_NAMES,
    FULLY_SHARD_NAMES,
    calls_to,
    set_flag,
    targeted_call,
    targeted_ddp_call,
)
from opadvisor.rewrite._walk import Transformer, Visitor

__all__ = [
    "AUTOCASTS",
    "BlockEdit",
    "BlockRewriter",
    "CAST",
    "Chain",
    "ChainFinder",
    "Converter",
    "DDP_NAMES",
    "DropoutMatch",
    "DropoutMatcher",
    "EMBEDDING_CLASSES",
    "FULLY_SHARD_NAMES",
    "LINEAR_CLASSES",
    "ONES_FUNCS",
    "Resolver",
    "Segment",
    "SoftmaxChainRewriter",
    "Step",
    "TRIL_FUNCS",
    "TRIU_FUNCS",
    "Transformer",
    "Visitor",
    "activation_of",
    "after_docstring_and_imports",
    "after_imports",
    "analysing",
    "append_keywords",
    "assign_name",
    "float32_cast",
    "assignment",
    "atomic",
    "bind_args",
    "block_index",
    "block_statements",
    "branch_value",
    "calls_to",
    "cast_problem",
    "check_budget",
    "class_info",
    "code",
    "comments_of",
    "config_block",
    "contains",
    "enclosing_class",
    "guarded",
    "has_star_args",
    "imported_names",
    "int_value",
    "invert",
    "is_finfo_min",
    "is_method",
    "is_neg_inf",
    "jit_scripted",
    "kept_tensor",
    "keyword",
    "layout",
    "local_values",
    "names_in",
    "nearest_before",
    "nodes_of",
    "number_value",
    "parent",
    "positional_count",
    "qualified",
    "reciprocal",
    "reference",
    "remove_keyword",
    "replace_keyword_value",
    "resolves_to",
    "scalar_read",
    "self_attr",
    "set_flag",
    "simple_binding",
    "small_statement",
    "targeted_call",
    "targeted_ddp_call",
    "template",
    "text_naming",
    "torch_binding",
    "unparen",
    "upcast_problem",
    "where_call",
]
