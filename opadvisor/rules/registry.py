"""The rule registry: every rule module, in the order `opadvisor rules` lists them.

A rule module has: a docstring in four parts (What it finds / Why it is slow / Example / Fix and its
safety), `ID` (str), `TITLE` (str, a few words), `FIX` ("safe" | "unsafe" | "none": the safety of its
usual fix), optionally `FIX_CAVEAT` (str: where a finding's fix differs from FIX, e.g. "unsafe where
masked rows are zeroed after softmax"; `opadvisor rules` shows it), and `detect(profile: Profile) ->
list[Finding]`. Adding a rule adds one line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from opadvisor.errors import UserError

RULE_MODULES: tuple[str, ...] = (
    "fused_softmax",
    "sdpa_attention",
    "fused_dropout_add",
    "fused_cross_entropy",
    "gemm_align",
    "sparse_launch",
    "host_sync",
    "dataloader_stall",
    "fp32_gemm",
    "manual_layernorm",
    "fused_optimizer",
    "activation_checkpointing",
    "rnn_cell_loop",
    "cudnn_rnn",
    "fuse_region",
    "graph_break",
    "recompile",
    "regional_compile",
    "ddp_find_unused",
    "ddp_small_bucket",
    "ddp_bucket_view",
    "grad_accum_sync",
    "fsdp_root_only",
    "fsdp_fp32_gather",
    "fsdp_reshard",
    "fsdp_prefetch",
)


def rule_ids() -> list[str]:
    return list(RULE_MODULES)


def get_rule(rule_id: str) -> ModuleType:
    if rule_id not in RULE_MODULES:
        raise UserError(f"unknown rule {rule_id!r}; known rules: {', '.join(RULE_MODULES)}")
    return importlib.import_module(f"opadvisor.rules.{rule_id}")


def fix_safety(rule: ModuleType) -> str:
    """The safety of a rule's fixes in words: FIX, and where findings differ from it ("safe; unsafe where ...")."""
    caveat = getattr(rule, "FIX_CAVEAT", "")
    return f"{rule.FIX}; {caveat}" if caveat else rule.FIX


def all_rules() -> list[ModuleType]:
    return [get_rule(r) for r in RULE_MODULES]
