"""The rule registry: every rule, one line each, in the order `opadvisor rules` lists them.

A line `"<family>.<rule id>"` names the rule's detect module below `opadvisor.rules`: the module
`opadvisor/rules/<family>/<rule id>.py` of its family package, its fix beside it as `<rule id>_fix.py`
where it has one (see docs/ADDING_A_RULE.md). The rule's id is the last part.

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
    "attention.fused_softmax",
    "attention.sdpa_attention",
    "dropout_add.fused_dropout_add",
    "loss.fused_cross_entropy",
    "gemm.gemm_align",
    "launch.sparse_launch",
    "launch.host_sync",
    "data.dataloader_stall",
    "gemm.fp32_gemm",
    "layernorm.manual_layernorm",
    "optimizer.fused_optimizer",
    "optimizer.zero_grad_set_to_none",
    "memory.activation_checkpointing",
    "rnn.rnn_cell_loop",
    "rnn.cudnn_rnn",
    "regions.fuse_region",
    "compile.graph_break",
    "compile.recompile",
    "compile.regional_compile",
    "distributed.ddp_find_unused",
    "distributed.ddp_small_bucket",
    "distributed.ddp_bucket_view",
    "distributed.grad_accum_sync",
    "distributed.fsdp_root_only",
    "distributed.fsdp_fp32_gather",
    "distributed.fsdp_reshard",
    "distributed.fsdp_prefetch",
)


PACKAGE = "opadvisor.rules"
# the fix of a family's rule R is the module `R_fix` beside R's detect module
FIX_SUFFIX = "_fix"

# rule id -> its line of RULE_MODULES
_LINES: dict[str, str] = {line.rpartition(".")[2]: line for line in RULE_MODULES}


def rule_ids() -> list[str]:
    return list(_LINES)


def _line(rule_id: str) -> str:
    if rule_id not in _LINES:
        raise UserError(f"unknown rule {rule_id!r}; known rules: {', '.join(_LINES)}")
    return _LINES[rule_id]


def module_name(rule_id: str) -> str:
    """The dotted name of the rule's detect module ("opadvisor.rules.optimizer.fused_optimizer")."""
    return f"{PACKAGE}.{_line(rule_id)}"


def fix_module_name(rule_id: str) -> str:
    """The dotted name the rule's fix (its codemod) has where it has one: `<detect module>_fix`, beside it in
    its family package."""
    return f"{module_name(rule_id)}{FIX_SUFFIX}"


def get_rule(rule_id: str) -> ModuleType:
    return importlib.import_module(module_name(rule_id))


def fix_safety(rule: ModuleType) -> str:
    """The safety of a rule's fixes in words: FIX, and where findings differ from it ("safe; unsafe where ...")."""
    caveat = getattr(rule, "FIX_CAVEAT", "")
    return f"{rule.FIX}; {caveat}" if caveat else rule.FIX


def all_rules() -> list[ModuleType]:
    return [get_rule(r) for r in rule_ids()]
