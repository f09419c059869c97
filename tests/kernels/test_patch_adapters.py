"""opadvisor.patch on models fine-tuned through adapters (PEFT's LoRA on the attention and MLP projections).

The attention and MLP patches call their projections as the original forward does, so a projection wrapped
by an adapter (a module around the nn.Linear, kept as `base_layer`) keeps them: before, every such module was
left ("its q_proj is a Linear, not Linear"). Where a patch reads the linear layer's weight itself (BERT's
output block fuses its bias, dropout and residual add), a wrapped layer is still left, and said by its
qualified class name."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_patch_checkpointing import assert_trains_as_the_original, build

import opadvisor

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = {
    "llama": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "gpt2": (["c_attn", "c_fc"], True),  # GPT-2's Conv1D projections: fan_in_fan_out
    "bert": (["query", "value", "dense"], False),
    "deberta": (["query_proj", "key_proj", "value_proj"], False),
}
KEPT = {  # the fixes that call the wrapped projections
    "llama": {"hf_llama_rope", "hf_swiglu_mlp", "hf_rms_norm", "hf_linear_cross_entropy"},
    "gpt2": {"hf_gpt2_attention", "hf_gelu_tanh", "hf_linear_cross_entropy"},
    "bert": {"hf_bert_self_attention", "hf_mlm_linear_cross_entropy"},
    "deberta": {"hf_deberta_attention", "hf_bert_output"},
}


def with_lora(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    modules, fan_in_fan_out = TARGETS[family]
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0, fan_in_fan_out=fan_in_fan_out,
        init_lora_weights=False,  # B is not zero: the adapters change the outputs and get gradients
    )  # fmt: skip
    return peft.get_peft_model(build(family), config).train()


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_lora_wrapped_projections_keep_the_fixes_and_train_as_the_original(
    family: str, reference_path
) -> None:
    original = with_lora(family)
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    fixes = {fix for _, _, fix in opadvisor.patch_report(patched).patched}
    assert KEPT[family] <= fixes
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every first-call check passes
        assert_trains_as_the_original(original, patched)
    assert {fix for _, _, fix in opadvisor.patch_report(patched).patched} == fixes


def test_a_patch_that_reads_the_weight_leaves_a_wrapped_layer_by_its_qualified_name(reference_path) -> None:
    patched = opadvisor.patch(with_lora("bert"), quiet=True)
    left = {why for _, cls, why in opadvisor.patch_report(patched).left if cls.endswith(".BertOutput")}
    assert left == {
        "its dense is a peft.tuners.lora.layer.Linear, not torch.nn.modules.linear.Linear (wrapped or replaced)"
    }
