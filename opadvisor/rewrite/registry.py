"""Which codemod fixes which rule: rule id -> "module:Class" (imported only when needed)."""

from __future__ import annotations

import importlib

from opadvisor.errors import UserError
from opadvisor.rewrite.base import RuleCodemod

CODEMODS: dict[str, str] = {
    "fused_softmax": "opadvisor.rewrite.fused_softmax:FusedSoftmaxCodemod",
    "sdpa_attention": "opadvisor.rewrite.sdpa_attention:SdpaAttentionCodemod",
    "fused_dropout_add": "opadvisor.rewrite.fused_dropout_add:FusedDropoutAddCodemod",
    "fused_cross_entropy": "opadvisor.rewrite.fused_cross_entropy:FusedCrossEntropyCodemod",
    "gemm_align": "opadvisor.rewrite.gemm_align:GemmAlignCodemod",
    "fused_optimizer": "opadvisor.rewrite.fused_optimizer:FusedOptimizerCodemod",
    "dataloader_stall": "opadvisor.rewrite.dataloader_stall:DataLoaderCodemod",
    "manual_layernorm": "opadvisor.rewrite.manual_layernorm:ManualLayerNormCodemod",
    "fp32_gemm": "opadvisor.rewrite.fp32_gemm:Fp32GemmCodemod",
    "sparse_launch": "opadvisor.rewrite.sparse_launch:CudaGraphsCodemod",
    "fuse_region": "opadvisor.rewrite.fuse_region:FuseRegionCodemod",
}


# Fixes for findings in library code (opadvisor/libraries.py), keyed by fix: not rules of their own, they
# serve the findings of the rules above whose pattern is in an installed package (see rewrite/library.py).
# In the order apply runs them: each inserts right after the model's line, so the patch ends up last.
LIBRARY_CODEMODS: dict[str, str] = {
    "library_patch": "opadvisor.rewrite.library:LibraryPatchCodemod",
    "hf_attn_implementation": "opadvisor.rewrite.library:HfAttnImplementationCodemod",
    "mha_need_weights": "opadvisor.rewrite.library:MhaNeedWeightsCodemod",
}


def has_codemod(rule_id: str) -> bool:
    return rule_id in CODEMODS


def get_codemod(rule_id: str) -> type[RuleCodemod]:
    spec = CODEMODS.get(rule_id) or LIBRARY_CODEMODS.get(rule_id)
    if spec is None:
        raise UserError(
            f"rule {rule_id!r} has no automatic fix; `opadvisor explain {rule_id}` says what to do"
        )
    module_name, _, cls_name = spec.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)
