"""Which codemod fixes which rule, found by name: the codemod of rule R is the `RuleCodemod` subclass whose
`RULE == "R"` in R's fix module, `opadvisor.rules.<family>.R_fix` beside its detect module
(`rules.registry.fix_module_name`).

There is no list to keep in step: a rule is listed once, in `opadvisor/rules/registry.py`, and it has an
automatic fix exactly when its fix module exists. Modules are imported only when needed (`has_codemod`
looks for the file, so `opadvisor suggest` and `opadvisor rules` import no codemod).
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

from opadvisor.errors import UserError
from opadvisor.rewrite.base import RuleCodemod

# Fixes for findings in library code (opadvisor/libraries.py), keyed by fix: not rules of their own, they
# serve the findings of the rules whose pattern is in an installed package (see rewrite/library.py).
# In the order apply runs them: each inserts right after the model's line, so the patch ends up last.
LIBRARY_CODEMODS: dict[str, str] = {
    "library_patch": "opadvisor.rewrite.library:LibraryPatchCodemod",
    "hf_attn_implementation": "opadvisor.rewrite.library:HfAttnImplementationCodemod",
    "mha_need_weights": "opadvisor.rewrite.library:MhaNeedWeightsCodemod",
    "timm_fused_attn": "opadvisor.rewrite.library:TimmFusedAttnCodemod",
    "timm_fused_attn_experimental": "opadvisor.rewrite.library:TimmFusedAttnExperimentalCodemod",
}


@cache
def has_codemod(rule_id: str) -> bool:
    """Whether `rule_id` has an automatic fix: a rule of the registry whose fix module exists (the
    package's other public modules, such as `engine`, are no rules)."""
    from opadvisor.rules.registry import fix_module_name, rule_ids

    if rule_id not in rule_ids():
        return False
    return importlib.util.find_spec(fix_module_name(rule_id)) is not None


def fixable_rules() -> list[str]:
    """The rules with an automatic fix, in the order `opadvisor rules` lists them (and `--rule all` applies)."""
    from opadvisor.rules.registry import rule_ids

    return [r for r in rule_ids() if has_codemod(r)]


def get_codemod(rule_id: str) -> type[RuleCodemod]:
    """The codemod class of `rule_id` (or of a library fix in LIBRARY_CODEMODS); UserError for a rule
    without one."""
    spec = LIBRARY_CODEMODS.get(rule_id)
    if spec is not None:
        module_name, _, cls_name = spec.partition(":")
        return getattr(importlib.import_module(module_name), cls_name)
    if not has_codemod(rule_id):
        raise UserError(
            f"rule {rule_id!r} has no automatic fix; `opadvisor explain {rule_id}` says what to do"
        )
    from opadvisor.rules.registry import fix_module_name

    module_name = fix_module_name(rule_id)
    module = importlib.import_module(module_name)
    found = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, RuleCodemod) and obj.RULE == rule_id
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"{module_name} must define exactly one RuleCodemod with RULE = {rule_id!r} (found {len(found)})"
        )
    return found[0]
