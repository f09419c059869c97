"""opadvisor.patch's compile_blocks: a library model's repeated blocks (BertLayer, nn.TransformerEncoderLayer)
each run one torch.compile'd forward, shared by every instance of the class.

Most tests hand torch.compile a backend that counts the graphs it is given and runs them as traced (no
inductor: fast); one slow test compiles with inductor (its C++ backend on the CPU) and compares values and
gradients with the original.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from test_patch import batch, losses, tiny_bert, tiny_gpt2

import opadvisor
from opadvisor.libraries import repeated_blocks
from opadvisor.patching.compile_blocks import BLOCK_COMPILE_OPTIONS
from opadvisor.patching.shared import STATE

BLOCKS = ["compile_blocks"]


@pytest.fixture
def graphs(monkeypatch) -> list[int]:
    """Compile the blocks with a backend that records each graph it gets (node count) and runs it as is."""
    seen: list[int] = []

    def counting(gm, example_inputs):
        seen.append(len(gm.graph.nodes))
        return gm.forward

    monkeypatch.setitem(BLOCK_COMPILE_OPTIONS, "backend", counting)
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


def test_the_blocks_share_one_graph_and_never_recompile(graphs, capsys) -> None:
    model = tiny_bert(dropout=0.1)
    opadvisor.patch(model, rules=BLOCKS, check=False)
    assert "patched 2 modules: BertLayer x2 (compile_blocks: bert.encoder.layer.*)" in capsys.readouterr().err
    losses(model, 3)
    assert len(graphs) == 1, f"one graph for both layers and every step, got {len(graphs)}"
    # the first-call check runs with dropout off: one more graph (dropout's p is part of the guard), shared too
    graphs.clear()
    torch._dynamo.reset()
    model = tiny_bert(dropout=0.1)
    opadvisor.patch(model, rules=BLOCKS, quiet=True)
    losses(model, 3)
    assert len(graphs) == 2
    assert all(STATE in layer.__dict__ for layer in model.bert.encoder.layer)  # the check passed


def test_compile_blocks_is_asked_for_by_name_only(graphs, capsys) -> None:
    model = tiny_bert()
    opadvisor.patch(model, quiet=True)  # rules=None: every safe patch, but not this one (compile time)
    opadvisor.patch(tiny_bert(), rules=["fuse_region"], quiet=True)
    assert all(STATE not in layer.__dict__ for layer in model.bert.encoder.layer)
    losses(model, 1)
    assert graphs == []


def test_patch_then_unpatch_is_exact_and_trains_with_the_originals_losses(graphs, capsys) -> None:
    reference = tiny_bert()
    model = copy.deepcopy(reference)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opadvisor.patch(model, rules=[*BLOCKS, "fused_dropout_add", "fused_cross_entropy"])
    err = capsys.readouterr().err
    assert "left BertSelfOutput x2: inside a compiled BertLayer (compile_blocks" in err
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    got = losses(model, 3)
    assert got == pytest.approx(losses(reference, 3), rel=1e-5)
    opadvisor.unpatch(model)
    assert all("forward" not in m.__dict__ and STATE not in m.__dict__ for m in model.modules())
    assert opadvisor.patch_report(model) is None
    fresh = tiny_bert()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, fresh(**batch()).logits)


def test_a_compile_failure_is_one_line_and_the_original_forward(monkeypatch, capsys) -> None:
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setitem(BLOCK_COMPILE_OPTIONS, "backend", broken)
    torch._dynamo.reset()
    reference = tiny_bert()
    model = copy.deepcopy(reference)
    opadvisor.patch(model, rules=BLOCKS, quiet=True)
    assert losses(model, 2) == pytest.approx(losses(reference, 2), rel=1e-6)
    err = capsys.readouterr().err
    assert err.count("opadvisor.kernels.compile_region: BertLayer.forward runs uncompiled") == 1, err
    assert all(STATE not in layer.__dict__ for layer in model.bert.encoder.layer)
    report = opadvisor.patch_report(model)
    layers = [reason for _, cls, reason in report.left if cls.endswith("BertLayer")]
    assert not report.patched and len(layers) == 2 and all("torch.compile failed" in r for r in layers)
    torch._dynamo.reset()


def test_blocks_given_a_kv_cache_fall_back_to_their_parts_patches(graphs, capsys) -> None:
    """GPT-2 trains with use_cache=True by default: every block updates the cache at its own layer index,
    which would recompile a shared compiled forward per layer (and run uncompiled past dynamo's limit, 8).
    The blocks then keep their original forward, with a warning, and the patches left out inside them
    (the tanh GELU) are installed after all; with use_cache=False they compile."""
    reference = tiny_gpt2()
    model = copy.deepcopy(reference)
    opadvisor.patch(model, rules=[*BLOCKS, "fuse_region"], quiet=True)
    with pytest.warns(
        RuntimeWarning, match=r"GPT2Block x2 not compiled .*KV cache \(DynamicCache\).*hf_gelu_tanh x2"
    ):
        got = losses(model, 3)
    assert got == pytest.approx(losses(reference, 3), rel=1e-5)
    assert graphs == []
    report = opadvisor.patch_report(model)
    assert sorted(fix for _, _, fix in report.patched) == ["hf_gelu_tanh", "hf_gelu_tanh"]
    assert not any("inside a compiled" in reason for _, _, reason in report.left)
    blocks = [
        reason
        for path, _, reason in report.left
        if path.startswith("transformer.h.") and path.count(".") == 2
    ]
    assert len(blocks) == 2 and all("use_cache=False" in r for r in blocks)
    assert all(STATE not in block.__dict__ for block in model.transformer.h)

    model = tiny_gpt2()
    opadvisor.patch(model, rules=BLOCKS, quiet=True)
    model(**batch(), use_cache=False).loss.backward()
    assert len(graphs) >= 1 and all(STATE in block.__dict__ for block in model.transformer.h)


def test_inside_an_outer_compile_the_original_runs(graphs) -> None:
    model = tiny_bert()
    opadvisor.patch(model, rules=BLOCKS, quiet=True)
    outer = torch.compile(model, backend="eager")
    loss = outer(**batch()).loss
    loss.backward()
    assert graphs == []  # the outer graph traced the blocks' original forward, no nested compile
    assert torch.isfinite(loss)


def test_blocks_with_patched_parts_or_replaced_forwards_are_left_with_the_reason(graphs, capsys) -> None:
    model = tiny_bert()
    opadvisor.patch(model, rules=["fused_dropout_add"], quiet=True)
    opadvisor.patch(model, rules=BLOCKS)
    err = capsys.readouterr().err
    assert "left BertLayer x2: its attention.output is patched already (hf_bert_output)" in err
    model = tiny_bert()
    model.bert.encoder.layer[0].forward = model.bert.encoder.layer[0].forward  # an instance forward
    opadvisor.patch(model, rules=BLOCKS)
    err = capsys.readouterr().err
    assert "patched 1 modules: BertLayer x1" in err and "replaced on the instance" in err


def test_torch_encoder_layers_are_blocks_and_user_classes_are_not(graphs, capsys) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(2, 5, 16)
    want = model(x)
    opadvisor.patch(model, rules=BLOCKS)
    assert "TransformerEncoderLayer x2 (compile_blocks: layers.*)" in capsys.readouterr().err
    torch.testing.assert_close(model(x), want)
    assert len(graphs) == 2  # the first-call check (dropout off) and the call, for both layers

    class Block(nn.Module):  # the user's own code: the fix there is @compile_region on its function
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

    opadvisor.patch(Net(), rules=BLOCKS)
    assert "the model has no repeated library block" in capsys.readouterr().err


def test_repeated_blocks_are_the_outermost_repeated_library_class() -> None:
    bert = "transformers.models.bert.modeling_bert."
    modules = {
        "": bert + "BertForMaskedLM",
        "bert.encoder.layer": "torch.nn.modules.container.ModuleList",
        **{f"bert.encoder.layer.{i}": bert + "BertLayer" for i in range(3)},
        **{f"bert.encoder.layer.{i}.output": bert + "BertOutput" for i in range(3)},
        **{f"bert.encoder.layer.{i}.output.dense": "torch.nn.modules.linear.Linear" for i in range(3)},
        "cls.act": "transformers.activations.GELUActivation",
        "head.act": "transformers.activations.GELUActivation",  # two, but no modules of its own
    }
    assert repeated_blocks(modules, lambda cls: True) == {
        f"bert.encoder.layer.{i}": bert + "BertLayer" for i in range(3)
    }
    assert repeated_blocks(modules, lambda cls: not cls.endswith("BertLayer")) == {
        f"bert.encoder.layer.{i}.output": bert + "BertOutput" for i in range(3)
    }


@pytest.mark.slow
def test_inductor_gives_the_originals_values_and_gradients(capsys) -> None:
    """The real compiler (inductor, C++ on the CPU): outputs and every gradient match the original."""
    torch._dynamo.reset()
    reference = tiny_bert()
    model = copy.deepcopy(reference)
    opadvisor.patch(model, rules=BLOCKS)
    for m in (reference, model):
        out = m(**batch())
        out.loss.backward()
    torch.testing.assert_close(model(**batch()).logits, reference(**batch()).logits, rtol=1e-4, atol=1e-5)
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    report = opadvisor.patch_report(model)
    assert [fix for _, _, fix in report.patched] == ["compile_blocks"] * 2  # nothing fell back
    torch._dynamo.reset()
