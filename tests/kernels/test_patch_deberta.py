"""opadvisor.patch on DeBERTa-v2/v3 (tiny DebertaV2ForMaskedLM models from config objects, nothing downloaded):
the disentangled self-attention as disentangled_bias + one SDPA (hf_deberta_attention), the output blocks as
BERT's (hf_bert_output), the masked-LM loss (hf_mlm_loss). The patched model computes the original's loss,
logits and gradients (padded positions and fully padded rows included), comes back exactly after unpatch,
refuses a changed class by name, falls back where its first-call check fails, and composes with
torch.compile(fullgraph=True)."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
from patch_testlib import fixes, forwards, sgd_losses, with_replacement

import opadvisor
from opadvisor.libraries import deberta_v2_class
from opadvisor.patching import deberta as deberta_patch
from opadvisor.patching.bert import _check_bert_output
from opadvisor.patching.fingerprint import source_fingerprint
from opadvisor.patching.lm_loss import _check_bert_mlm
from opadvisor.patching.shared import STATE

transformers = pytest.importorskip("transformers")
deberta = importlib.import_module("transformers.models.deberta_v2.modeling_deberta_v2")

VOCAB = 101
FIXES = {"hf_deberta_attention", "hf_deberta_positions", "hf_bert_output", "hf_mlm_loss", "padded_linear"}
# DeBERTa-v3's attention (shared keys, log buckets, both terms), v2's (own position projections, no buckets),
# one term only, and no relative attention at all
CONFIGS = {
    "v3": dict(
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_buckets=8, norm_rel_ebd="layer_norm"
    ),
    "v2": dict(share_att_key=False, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
    "c2p": dict(share_att_key=False, pos_att_type=["c2p"], position_buckets=8),
    "absolute": dict(relative_attention=False, pos_att_type=["c2p", "p2c"], position_biased_input=True),
}


def tiny(kind: str = "v3", layers: int = 2, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    overrides = {"relative_attention": True, "position_biased_input": False, **CONFIGS[kind]}
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=0, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.DebertaV2ForMaskedLM(config)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Three sequences of 12: whole, padded after 7 (padded query rows see no key), wholly padded."""
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def run(model: nn.Module, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, logits, gradients) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(**(kwargs or batch()))
    out.loss.backward()
    grads = {
        n.removeprefix("_orig_mod."): p.grad.clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return out.loss.detach(), out.logits.detach(), grads


def assert_same_training(original: nn.Module, patched: nn.Module, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no first-call check may fail
        got = run(patched, **kwargs)
    want = run(original, **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_patched_deberta_trains_as_the_original_and_unpatches_exactly(kind, reference_path) -> None:
    original = tiny(kind)
    model = copy.deepcopy(original)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = forwards(model)
    opadvisor.patch(model, unsafe=True, quiet=True)
    # without relative attention the encoder builds no positions: nothing to patch there, nothing said
    assert fixes(model) == FIXES - ({"hf_deberta_positions"} if kind == "absolute" else set())
    assert not opadvisor.patch_report(model).left
    assert_same_training(original, model)
    opadvisor.unpatch(model)
    assert forwards(model) == before and not any(STATE in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


def test_the_report_names_every_deberta_block(capsys, reference_path) -> None:
    opadvisor.patch(tiny(), quiet=False)
    err = capsys.readouterr().err
    assert (
        "DisentangledSelfAttention x2 (hf_deberta_attention: deberta.encoder.layer.*.attention.self)" in err
    )
    assert "DebertaV2SelfOutput x2 (hf_bert_output" in err and "DebertaV2Output x2 (hf_bert_output" in err
    assert "DebertaV2ForMaskedLM x1 (hf_mlm_loss: <model>)" in err
    assert "DebertaV2Encoder x1 (hf_deberta_positions: deberta.encoder)" in err
    assert "unknown architecture" not in err and "left" not in err  # no container, no SDPA switch reported


def test_the_kernels_run_through_the_interpreter_and_keep_the_losses() -> None:
    """The Triton kernels themselves (TRITON_INTERPRET=1, set by conftest), two SGD steps of a one-layer model."""
    from opadvisor.kernels import dispatch_counts, reset_dispatch_counts

    original = tiny(layers=1)
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_deberta_attention"], quiet=True)
    reset_dispatch_counts()
    losses = [sgd_losses(m, batch) for m in (original, model)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert dispatch_counts()["disentangled_bias"].get("kernel", 0) > 0


def test_the_attention_alone_matches_for_every_way_it_is_called(reference_path) -> None:
    """Called directly: positions built inside (relative_pos None) or given 2-D, separate query states, a
    padding mask; output_attentions runs the original (SDPA forms no probabilities) and stays patched."""
    config = tiny(layers=1).config
    torch.manual_seed(3)
    original = deberta.DisentangledSelfAttention(config)
    module = opadvisor.patch(copy.deepcopy(original), quiet=True)
    x, query = torch.randn(2, 10, 32), torch.randn(2, 10, 32)
    keep = torch.ones(2, 10)
    keep[0, 6:] = 0
    mask = deberta.DebertaV2Encoder.get_attention_mask(None, keep)
    rel = torch.randn(16, 32, requires_grad=True)
    positions = deberta.build_relative_position(x, x, bucket_size=8, max_position=32)[0]
    for kwargs in ({}, {"relative_pos": positions}, {"query_states": query}):
        got = module(x, mask, rel_embeddings=rel, **kwargs)
        want = original(x, mask, rel_embeddings=rel, **kwargs)
        assert got[1] is None and want[1] is None
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    got = module(x, mask, output_attentions=True, rel_embeddings=rel)
    want = original(x, mask, output_attentions=True, rel_embeddings=rel)
    torch.testing.assert_close(got[1], want[1])
    assert fixes(module) == {"hf_deberta_attention"}


def test_under_bf16_autocast_no_first_call_check_falls_back(reference_path) -> None:
    model = opadvisor.patch(tiny(), unsafe=True, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch()).loss
        loss.backward()
    assert fixes(model) == FIXES and not opadvisor.patch_report(model).left


def test_a_changed_class_is_refused_by_name(monkeypatch, capsys, reference_path) -> None:
    cls = deberta.DisentangledSelfAttention

    def changed(self, hidden_states, attention_mask, output_attentions=False, **kwargs):  # a new release
        return hidden_states, None

    monkeypatch.setattr(cls, "forward", changed)
    model = opadvisor.patch(tiny(), quiet=False)
    err = capsys.readouterr().err
    assert "left DisentangledSelfAttention x2: transformers" in err
    assert "changed DisentangledSelfAttention.forward" in err
    assert "hf_deberta_attention" not in fixes(model) and "hf_bert_output" in fixes(model)


def test_a_changed_helper_is_refused_by_name(monkeypatch, reference_path) -> None:
    def scaled_size_sqrt(query_layer, scale_factor: int):  # scales otherwise
        return torch.tensor(float(query_layer.size(-1) * scale_factor))

    monkeypatch.setattr(deberta, "scaled_size_sqrt", scaled_size_sqrt)
    model = opadvisor.patch(tiny(), quiet=True)
    left = {
        why
        for _, cls, why in opadvisor.patch_report(model).left
        if cls == deberta_v2_class("DisentangledSelfAttention")
    }
    assert len(left) == 1 and "changed deberta_v2.scaled_size_sqrt" in left.pop()


def test_a_replaced_dropout_is_left_with_the_reason(reference_path) -> None:
    model = tiny()
    model.deberta.encoder.layer[0].attention.self.pos_dropout = nn.Identity()
    opadvisor.patch(model, quiet=True)
    left = [(path, why) for path, _, why in opadvisor.patch_report(model).left]
    assert left == [
        (
            "deberta.encoder.layer.0.attention.self",
            "its pos_dropout is a Identity, not Dropout (wrapped or replaced)",
        )
    ]


def test_a_replacement_that_differs_falls_back_at_its_first_call(monkeypatch, reference_path) -> None:
    def wrong(module, state, hidden_states, *args, **kwargs):
        out, weights = deberta_patch._deberta_attention(module, state, hidden_states, *args, **kwargs)
        return out * 1.1, weights

    with_replacement(monkeypatch, "hf_deberta_attention", wrong)
    original = tiny()
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_deberta_attention"], quiet=True)
    with pytest.warns(RuntimeWarning, match=r"layer\.0\.attention\.self .*keeps its original forward"):
        got = model(**batch()).loss
    torch.testing.assert_close(got, original(**batch()).loss)
    assert all("forward" not in m.__dict__ for m in model.modules())
    fell_back = [
        path
        for path, _, why in opadvisor.patch_report(model).left
        if why.startswith("fell back at its first")
    ]
    assert len(fell_back) == 2 and not opadvisor.patch_report(model).patched


def test_the_installed_transformers_is_the_code_the_deberta_patches_reproduce() -> None:
    """The fingerprints hold for the installed transformers; a @torch.jit.script helper (5.17 scripts
    scaled_size_sqrt and build_rpos) is read through its Python function, so it hashes as the plain one."""
    checks = {
        "DisentangledSelfAttention": deberta_patch._check_deberta_attention,
        "DebertaV2Encoder": deberta_patch._check_deberta_encoder,
        "DebertaV2ForMaskedLM": _check_bert_mlm,
        "DebertaV2Output": _check_bert_output,
    }
    for name, check in checks.items():
        cls = getattr(importlib.import_module(deberta_v2_class(name).rpartition(".")[0]), name)
        assert check(cls(tiny(layers=1).config)) is None, name
    plain = deberta.scaled_size_sqrt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, 5.17 uses it
        scripted = torch.jit.script(plain)
    assert source_fingerprint(scripted) == source_fingerprint(plain) is not None


def test_compiled_with_fullgraph_after_one_eager_step(reference_path) -> None:
    """torch.compile(patched model, fullgraph=True) traces without a graph break and keeps loss and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    original = tiny(layers=1)
    model = opadvisor.patch(copy.deepcopy(original), quiet=True)
    run(model)  # the first-call checks run eagerly
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    assert_same_training(original, compiled)
    assert counter.frame_count == 1


def test_positions_and_mask_terms_are_built_once(monkeypatch, reference_path) -> None:
    """After the first call (its checks): the encoder's relative positions once per length, the mask's
    additive form once per forward (not once per layer), rebuilt for a mask changed in place."""
    original = tiny(layers=3)
    model = opadvisor.patch(copy.deepcopy(original), quiet=True)
    run(model)
    calls = {"positions": 0, "mask": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        deberta, "build_relative_position", counted("positions", deberta.build_relative_position)
    )
    monkeypatch.setattr(
        deberta_patch, "_deberta_build_mask_terms", counted("mask", deberta_patch._deberta_build_mask_terms)
    )
    assert_same_training(original, model)
    # positions: the original's (the patched encoder's were built at the first call); mask terms: one for three layers
    assert calls == {"positions": 1, "mask": 1}
    short = {k: v[:, :9].contiguous() for k, v in batch().items()}
    assert_same_training(original, model, **short)
    assert calls == {"positions": 3, "mask": 2}  # a new length: built once more by the patched encoder too
    config = original.config
    reference = deberta.DisentangledSelfAttention(config)
    attention = opadvisor.patch(copy.deepcopy(reference), quiet=True)
    x, rel = torch.randn(1, 6, 32), torch.randn(16, 32)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    attention(x, mask, rel_embeddings=rel)
    mask[..., 3:] = False  # the same tensor, changed in place
    got = attention(x, mask, rel_embeddings=rel)[0]
    torch.testing.assert_close(got, reference(x, mask, rel_embeddings=rel)[0], rtol=1e-5, atol=1e-5)


# ---- on the GPU (the lead's: `pytest -m gpu tests/kernels/test_patch_deberta.py`) ------------------------------
def _v3_small(device: str) -> nn.Module:
    """DeBERTa-v3's attention at head size 64, 2 layers; dropout off (the losses are compared step by step)."""
    config = transformers.DebertaV2Config(
        vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=512, relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm",
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, type_vocab_size=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DebertaV2ForMaskedLM(config).to(device)


def _gpu_batch(device: str, seq: int = 512) -> dict[str, torch.Tensor]:
    """Eight sequences (the score tables [32, seq, 512]: the kernel's size), one padded after 400."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (8, seq), generator=generator).to(device)
    mask = torch.ones(8, seq, dtype=torch.long, device=device)
    mask[1, 400:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _adamw_losses(model: nn.Module, data: dict[str, torch.Tensor], steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no first-call check may fail, no capture either
            with torch.autocast(data["input_ids"].device.type, dtype=torch.bfloat16):
                loss = model(**data).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
def test_on_cuda_under_bf16_autocast_the_kernels_run_and_keep_the_losses() -> None:
    """Every first-call check passes under bf16 autocast (SDPA gives the relative-position bias its gradient:
    cuDNN, which gives none, is left out), disentangled_bias runs its Triton kernel, and three AdamW steps give
    the original's losses (bf16 rounding apart)."""
    from opadvisor.kernels import dispatch_counts, reset_dispatch_counts

    original = _v3_small("cuda")
    model = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    reset_dispatch_counts()
    want = _adamw_losses(original, _gpu_batch("cuda"))
    got = _adamw_losses(model, _gpu_batch("cuda"))
    assert got == pytest.approx(want, rel=5e-3)
    assert fixes(model) >= FIXES - {"padded_linear"} and not opadvisor.patch_report(model).left
    assert dispatch_counts()["disentangled_bias"].get("kernel", 0) > 0


@pytest.mark.gpu
def test_on_cuda_the_patched_model_is_captured_by_cuda_graphed() -> None:
    """With the positions built once (hf_deberta_positions) nothing in the patched model copies from the host:
    `cuda_graphed` captures forward and backward, and its steps give the eager patched model's losses."""
    from opadvisor.kernels import cuda_graphed

    eager = opadvisor.patch(_v3_small("cuda"), unsafe=True, quiet=True)
    graphed = opadvisor.patch(_v3_small("cuda"), unsafe=True, quiet=True)  # the same weights (one seed)
    _adamw_losses(eager, _gpu_batch("cuda"), steps=1)  # the first-call checks, eagerly
    _adamw_losses(graphed, _gpu_batch("cuda"), steps=1)
    graphed = cuda_graphed(graphed)
    want = _adamw_losses(eager, _gpu_batch("cuda"))
    got = _adamw_losses(graphed, _gpu_batch("cuda"))  # a failed capture warns: an error here
    assert graphed.forward.graphs and not graphed.forward.failed
    assert got == pytest.approx(want, rel=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["custom_op", "backward_op"])
def test_on_cuda_compiled_the_relative_bias_runs_its_kernels_and_keeps_the_losses(path, monkeypatch) -> None:
    """torch.compile (inductor) of the patched model after one eager step: disentangled_bias is traced as its
    kernels (COMPILE_PATH), not as gathers whose backward inductor writes as 16-bit atomics, and the steps give
    the eager patched model's losses."""
    from opadvisor.kernels import dispatch_counts, relpos, reset_dispatch_counts

    monkeypatch.setattr(relpos, "COMPILE_PATH", path)
    eager = opadvisor.patch(_v3_small("cuda"), unsafe=True, quiet=True)
    compiled = opadvisor.patch(_v3_small("cuda"), unsafe=True, quiet=True)  # the same weights (one seed)
    _adamw_losses(eager, _gpu_batch("cuda"), steps=1)
    _adamw_losses(compiled, _gpu_batch("cuda"), steps=1)
    want = _adamw_losses(eager, _gpu_batch("cuda"))
    torch._dynamo.reset()
    reset_dispatch_counts()
    got = _adamw_losses(torch.compile(compiled), _gpu_batch("cuda"))
    assert got == pytest.approx(want, rel=5e-3)
    assert dispatch_counts()["disentangled_bias"].keys() == {"kernel"}  # recorded where it was traced
