"""A fixable rule is declared once: its codemod is found by its id, every codemod belongs to a listed rule."""

from __future__ import annotations

from pathlib import Path

import pytest

import opadvisor.rewrite as rewrite_package
import opadvisor.rules as rules_package
from opadvisor.errors import UserError
from opadvisor.rewrite import registry
from opadvisor.rewrite.base import RuleCodemod
from opadvisor.rules.registry import FIX_SUFFIX, fix_module_name, module_name, rule_ids

# modules of opadvisor/rewrite/ that are the engine, not a rule's codemod; `library` holds the library
# fixes' codemods (registry.LIBRARY_CODEMODS: fixes for findings in installed packages, not rules);
# `toolkit` the helpers of the fixes in family packages
ENGINE = {"__init__", "base", "check", "engine", "registry", "library", "toolkit"}
RULES = Path(rules_package.__file__).parent


def _dotted(path: Path) -> str:
    return ".".join(["opadvisor", "rules", *path.relative_to(RULES).with_suffix("").parts])


def test_every_codemod_module_is_a_listed_rules_and_found_by_its_id():
    modules = {p.stem for p in Path(rewrite_package.__file__).parent.glob("*.py")}
    stray = {m for m in modules if not m.startswith("_") and m not in ENGINE}
    assert not stray, f"a rule's fix belongs beside its detect module in its family package: {stray}"
    # a family's fixes: opadvisor/rules/<family>/<rule>_fix.py, beside the rule's detect module
    in_families = {p.stem.removesuffix(FIX_SUFFIX): _dotted(p) for p in RULES.glob(f"*/*{FIX_SUFFIX}.py")}
    codemods = set(in_families)
    assert codemods <= set(rule_ids()), "a codemod module without a rule in opadvisor/rules/registry.py"
    for rule, dotted in in_families.items():
        assert fix_module_name(rule) == dotted and module_name(rule) == dotted.removesuffix(FIX_SUFFIX)
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


def test_every_rule_is_in_a_family_package():
    for rule in rule_ids():
        family = module_name(rule).split(".")[2:-1]
        assert len(family) == 1, f'{rule}: its registry line names no family package ("<family>.{rule}")'
        assert (RULES / family[0] / f"{rule}.py").is_file()


def test_every_rule_module_of_a_family_is_listed():
    """A detect module in a family package (a module defining `detect`) has its line in the registry."""
    listed = {module_name(r) for r in rule_ids()}
    for path in RULES.glob("*/*.py"):
        if path.stem.startswith("_") or path.stem.endswith(FIX_SUFFIX):
            continue
        if "\ndef detect(" in path.read_text():
            assert _dotted(path) in listed, f"{path.name}: a rule module not in opadvisor/rules/registry.py"
