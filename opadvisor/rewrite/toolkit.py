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
from opadvisor.rewrite._match import (
    bind_args,
    code,
    is_method,
    nodes_of,
    number_value,
    parent,
    qualified,
    resolves_to,
    unparen,
)
from opadvisor.rewrite._names import reference
from opadvisor.rewrite._walk import Transformer, Visitor

__all__ = [
    "Transformer",
    "Visitor",
    "append_keywords",
    "bind_args",
    "code",
    "has_star_args",
    "is_method",
    "keyword",
    "layout",
    "nodes_of",
    "number_value",
    "parent",
    "positional_count",
    "qualified",
    "reference",
    "remove_keyword",
    "replace_keyword_value",
    "resolves_to",
    "unparen",
]
