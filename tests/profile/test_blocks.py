"""The repeated blocks of real models, as torch.compile's call records them (profile/blocks.py), and the
loop regional_compile writes from them: the models of transformers, timm and torch itself, built tiny on
the CPU (nothing downloaded). The loop's expression, evaluated on the model, yields exactly the blocks.
"""

from __future__ import annotations

import pytest
import torch.nn as nn

from opadvisor.profile.blocks import repeated_blocks
from opadvisor.rules.compile.regional_compile_fix import block_iterable
from opadvisor.rules.compile_facts import RegionalCompileFacts


def _blocks_of(model: nn.Module) -> dict:
    """The record, and a check that the codemod's loop expression iterates every block once, in order."""
    found = repeated_blocks(model)
    assert found is not None
    facts = RegionalCompileFacts(containers=found["containers"], singles=found["singles"])
    iterable = block_iterable("model", facts)
    assert iterable is not None
    looped = list(eval(iterable, {}, {"model": model}))  # the expression the rewritten script runs
    expected = [m for m in model.modules() if type(m).__name__ == found["cls"]]
    assert [id(m) for m in looped] == [id(m) for m in expected]
    assert found["count"] == len(expected)
    return found


def _transformers_models():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))  # fmt: skip
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=2, d_kv=8, vocab_size=128))  # fmt: skip
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=128))  # fmt: skip
    return llama, t5, bert


def test_transformers_models_name_their_layers():
    llama, t5, bert = _transformers_models()
    found = _blocks_of(llama)
    assert (found["cls"], found["containers"], found["outside"]) == (
        "LlamaDecoderLayer",
        ["model.layers"],
        ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"],
    )
    found = _blocks_of(t5)  # 2 + 3 layers in two stacks, not the two stacks
    assert (found["cls"], found["count"], found["containers"]) == (
        "T5Block",
        5,
        ["encoder.block", "decoder.block"],
    )
    found = _blocks_of(bert)
    assert (found["cls"], found["containers"]) == ("BertLayer", ["bert.encoder.layer"])
    assert found["outside"] == ["bert.embeddings", "cls"]
    # numbered layers (`layer_idx` indexes the cache): one graph per layer under regional compilation
    assert found["variants"] == 2 and found["differs"] == ["attention.self.layer_idx"]


def test_timm_models_name_their_blocks():
    timm = pytest.importorskip("timm")
    found = _blocks_of(timm.create_model("vit_tiny_patch16_224", pretrained=False))
    assert (found["cls"], found["count"], found["containers"]) == ("Block", 12, ["blocks"])
    assert found["variants"] == 1  # alike: one graph for all twelve
    found = _blocks_of(timm.create_model("vit_tiny_patch16_224", pretrained=False, drop_path_rate=0.1))
    assert found["variants"] == 12 and "drop_path1.drop_prob" in found["differs"]
    found = _blocks_of(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False))
    assert found["cls"] == "SwinTransformerBlock" and found["containers"][1] == "layers.1.blocks"
    found = _blocks_of(timm.create_model("resnet18", pretrained=False))
    assert (found["cls"], found["containers"]) == ("BasicBlock", ["layer1", "layer2", "layer3", "layer4"])


def test_torch_transformer_layers_are_blocks_and_its_parts_are_not():
    model = nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32
    )
    found = _blocks_of(model)  # not its MultiheadAttention modules, which are torch's parts of a layer
    assert (found["cls"], found["containers"]) == ("TransformerDecoderLayer", ["decoder.layers"])


def test_blocks_outside_a_container_and_models_without_blocks():
    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Stage(), Stage()
            self.head = nn.Linear(3, 2)

    found = _blocks_of(Net())
    assert (found["containers"], found["singles"], found["outside"]) == ([], ["first", "second"], ["head"])
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) is None
    assert repeated_blocks(nn.Linear(2, 2)) is None
