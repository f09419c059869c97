"""A fixable rule is declared once: its codemod is found by its id, every codemod belongs to a listed rule."""

from __future__ import annotations

from pathlib import Path

import pytest

import opadvisor.rewrite as rewrite_package
from opadvisor.errors import UserError
from opadvisor.rewrite import registry
from opadvisor.rewrite.base import RuleCodemod
from opadvisor.rules.registry import rule_ids

# modules of opadvisor/rewrite/ that are the engine, not a rule's codemod; `library` holds the library
# fixes' codemods (registry.LIBRARY_CODEMODS: fixes for findings in installed packages, not rules)
ENGINE = {"__init__", "base", "check", "engine", "registry", "library"}


def test_every_codemod_module_is_a_listed_rules_and_found_by_its_id():
    modules = {p.stem for p in Path(rewrite_package.__file__).parent.glob("*.py")}
    codemods = {m for m in modules if not m.startswith("_") and m not in ENGINE}
    assert codemods <= set(rule_ids()), "a codemod module without a rule in opadvisor/rules/registry.py"
    assert set(registry.fixable_rules()) == codemods
    for rule in codemods:
        cls = registry.get_codemod(rule)
        assert issubclass(cls, RuleCodemod) and cls.RULE == rule and cls.SAFETY in ("safe", "unsafe")
    for fix in registry.LIBRARY_CODEMODS:
        assert issubclass(registry.get_codemod(fix), RuleCodemod) and not registry.has_codemod(fix)


def test_a_rule_without_a_codemod_says_so():
    fixable = set(registry.fixable_rules())
    without = [r for r in rule_ids() if r not in fixable]
    assert without, "expected display-only rules (host_sync ...)"
    assert not registry.has_codemod(without[0])
    with pytest.raises(UserError, match="has no automatic fix"):
        registry.get_codemod(without[0])
    assert not registry.has_codemod("../engine") and not registry.has_codemod("_chain")
