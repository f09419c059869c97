"""opadvisor.patch's run-time attention switch (hf_attn_switch): transformers' own `set_attn_implementation`,
per instance, on the outermost transformers model, to transformers' SDPA attention registered as
"opadvisor_sdpa" (its masks skip themselves under tracing too: opadvisor/patching/hf_masks.py), after its first call
compared the two; `unpatch` puts back what ran before. Tiny models from config objects: nothing is downloaded."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import opadvisor

transformers = pytest.importorskip("transformers")

SWITCHED = "opadvisor_sdpa"


def _llama(attn: str = "eager"):
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _loss_and_grads(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def test_the_switch_keeps_values_and_gradients_and_is_undone() -> None:
    model = _llama()
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 101, (2, 16))
    opadvisor.patch(model, rules=["sdpa_attention"], quiet=True)
    assert ("", f"{type(model).__module__}.{type(model).__qualname__}", "hf_attn_switch") in (
        opadvisor.patch_report(model).patched
    )
    assert model.config._attn_implementation == "eager"  # set at the first call, after its check
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check passes: no fallback warning
        logits, grads = _loss_and_grads(model, ids)
    assert (
        model.config._attn_implementation == SWITCHED and model.model.config._attn_implementation == SWITCHED
    )
    want_logits, want_grads = _loss_and_grads(reference, ids)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5)
    opadvisor.unpatch(model)
    assert model.config._attn_implementation == "eager" and "forward" not in model.__dict__
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_the_inner_model_is_switched_with_the_outer_one_not_again() -> None:
    model = _llama()
    opadvisor.patch(model, rules=["hf_attn_switch"], quiet=True)
    report = opadvisor.patch_report(model)
    assert [path for path, _, fix in report.patched if fix == "hf_attn_switch"] == [""]
    assert not any(path == "model" for path, _, _ in report.left)


def _bert(**extra) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        attn_implementation="eager", **extra,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def test_an_sdpa_model_is_switched_and_undone_to_sdpa() -> None:
    model = _llama("sdpa")
    opadvisor.patch(model, rules=["hf_attn_switch"], quiet=True)
    model(input_ids=torch.randint(0, 101, (2, 16)))
    assert model.config._attn_implementation == SWITCHED
    opadvisor.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    opadvisor.patch(model, rules=["hf_attn_switch"], quiet=True)
    model(input_ids=torch.randint(0, 101, (2, 16)))
    opadvisor.patch(model, rules=["hf_attn_switch"], quiet=True)  # again: already patched, left alone
    assert model.config._attn_implementation == SWITCHED


def test_left_alone_where_opadvisor_has_its_own_causal_patch() -> None:
    config = transformers.GPT2Config(
        vocab_size=101, n_embd=32, n_layer=1, n_head=2, n_positions=32, attn_implementation="eager"
    )
    # opadvisor's GPT-2 attention reads eager's causal mask: under SDPA's masks (None: causal) it would not be
    for model in (transformers.GPT2LMHeadModel(config), _bert(is_decoder=True)):
        opadvisor.patch(model, rules=["sdpa_attention"], quiet=True)
        report = opadvisor.patch_report(model)
        (left,) = [e for e in report.left if e[0] == ""]
        assert "own attention patch" in left[2]
        assert any(fix in ("hf_gpt2_attention", "hf_bert_self_attention") for _, _, fix in report.patched)
        assert model.config._attn_implementation == "eager"


def test_a_bert_encoder_gets_the_switch_beside_its_own_attention_patch() -> None:
    # BERT's patched attention takes SDPA's masks (bool, or None: no padding) as it takes eager's; the switch
    # makes transformers build those, which a CUDA graph can capture (5.17's eager mask copies a host scalar)
    model = _bert()
    opadvisor.patch(model, rules=["sdpa_attention"], quiet=True)
    fixes = {(path, fix) for path, _, fix in opadvisor.patch_report(model).patched}
    assert ("", "hf_attn_switch") in fixes and (
        "bert.encoder.layer.0.attention.self",
        "hf_bert_self_attention",
    ) in fixes
    seen = []
    attention = model.bert.encoder.layer[0].attention.self
    attention.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
    )
    ids = torch.randint(0, 101, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    model(input_ids=ids, attention_mask=mask)  # the first call: checks, then the switch
    mask[1, 11:] = 0
    model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == SWITCHED
    assert seen[-1] is not None and seen[-1].dtype == torch.bool  # padding: SDPA's bool mask


def test_a_switch_whose_first_call_differs_falls_back_to_eager(monkeypatch) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from opadvisor.patching import hf_masks as _hf_masks

    _hf_masks.register()
    sdpa = ALL_ATTENTION_FUNCTIONS[SWITCHED]

    def wrong(*args, **kwargs):
        out, weights = sdpa(*args, **kwargs)
        return out * 2, weights

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, SWITCHED, wrong)
    model = _llama()
    ids = torch.randint(0, 101, (2, 16))
    opadvisor.patch(model, rules=["hf_attn_switch"], quiet=True)
    with pytest.warns(RuntimeWarning, match="keeps its original forward"):
        model(input_ids=ids, labels=ids)
    assert model.config._attn_implementation == "eager" and "forward" not in model.__dict__
    (left,) = [e for e in opadvisor.patch_report(model).left if e[0] == ""]
    assert "fell back at its first call" in left[2]


def test_an_unpadded_bert_call_gets_no_mask_under_tracing(monkeypatch) -> None:
    # Under torch.compile and inside a CUDA-graph capture transformers' own SDPA mask function cannot look at a
    # mask's values, so it builds an all-True mask even for a call without attention_mask, and SDPA leaves flash
    # attention. opadvisor_sdpa's mask function skips it. Simulated on the CPU by telling transformers' mask
    # code it is tracing.
    import torch.nn.functional as F
    from transformers import masking_utils

    model = _bert().eval()  # no dropout: the two calls compare
    ids = torch.randint(0, 101, (2, 16))
    opadvisor.patch(model, rules=["sdpa_attention"], quiet=True)
    with torch.no_grad():
        expected = model(input_ids=ids).logits  # the first call: checks, then the switch
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        got = model(input_ids=ids).logits
        assert seen == [None]  # no mask, though transformers' mask code was tracing
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        model(input_ids=ids, attention_mask=mask)
    assert seen[-1] is not None and seen[-1].dtype == torch.bool  # a real padding mask is kept
    torch.testing.assert_close(got, expected)


def test_a_causal_model_under_tracing_runs_is_causal_without_a_mask(monkeypatch) -> None:
    """GPT-2 running transformers' SDPA: switched, a call without padding gets no mask under tracing (SDPA's
    is_causal instead: the same values); a padded call, or one with a cache offset, keeps its mask."""
    from transformers import masking_utils

    from opadvisor.patching import hf_masks as _hf_masks

    config = transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(config).eval()
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_attn_switch"], quiet=True)
    ids = torch.randint(0, 101, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            torch.testing.assert_close(
                model(input_ids=ids, **kwargs).logits, original(input_ids=ids, **kwargs).logits
            )
    assert model.config._attn_implementation == SWITCHED
    causal = masking_utils.causal_mask_function
    plain = {"q_length": 16, "kv_length": 16, "mask_function": causal, "attention_mask": None}
    assert _hf_masks._needs_no_mask(plain, masking_utils)
    assert not _hf_masks._needs_no_mask({**plain, "attention_mask": mask.bool()}, masking_utils)
    assert not _hf_masks._needs_no_mask({**plain, "q_offset": 4, "kv_length": 20}, masking_utils)
    assert not _hf_masks._needs_no_mask({**plain, "local_size": 8}, masking_utils)
    assert not _hf_masks._needs_no_mask({**plain, "allow_is_causal_skip": False}, masking_utils)
    assert not _hf_masks._needs_no_mask({**plain, "mask_function": lambda *a: True}, masking_utils)


def _spy_sdpa(monkeypatch) -> list[tuple[bool, bool]]:
    """(a mask was passed, is_causal) for every SDPA call from now on."""
    seen: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((attn_mask is not None, bool(is_causal)))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_positions_the_model_counts_itself_are_not_searched_for_packing_under_tracing(
    monkeypatch, family
) -> None:
    """Called without position_ids, a causal model counts 0, 1, 2, ... itself; under tracing transformers cannot
    check those for packed sequences and ANDs a packed-sequence mask in, so SDPA got a full mask (half of its
    work wasted). Switched, such a call runs is_causal without a mask; a call with packed positions keeps its
    mask (and its values)."""
    from transformers import masking_utils

    from opadvisor.patching import hf_masks as _hf_masks

    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32)
        torch.manual_seed(0)
        original = transformers.GPT2LMHeadModel(config).eval()
    else:
        original = _llama("sdpa").eval()
    original.config.use_cache = False  # as in training: with a cache transformers does not look for packing
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_attn_switch"], quiet=True)
    ids = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        model(input_ids=ids)  # the first call: the switch's check, not traced
        monkeypatch.setattr(masking_utils, "is_tracing", lambda *a, **k: True)
        seen = _spy_sdpa(monkeypatch)
        torch.testing.assert_close(model(input_ids=ids).logits, original(input_ids=ids).logits)
        layers = 2
        assert seen[:layers] == [(False, True)] * layers  # the switched model: is_causal, no mask
        assert seen[layers:] == [(True, False)] * layers  # the original under tracing: the packed mask
        seen.clear()
        packed = torch.arange(8).repeat(2)[None].expand(2, -1)  # two sequences of 8 in each row
        torch.testing.assert_close(
            model(input_ids=ids, position_ids=packed).logits,
            original(input_ids=ids, position_ids=packed).logits,
        )
        assert seen[:layers] == [(True, False)] * layers  # packed positions of the caller's: masked
    assert _hf_masks._OWN_POSITIONS == [0]


def test_a_compiled_switched_gpt2_runs_is_causal(monkeypatch) -> None:
    """The same under a real torch.compile (dynamo traces the switch's counter and the packed-sequence search)."""
    config = transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(config).eval()
    original.config.use_cache = False
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_attn_switch"], quiet=True)
    ids = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        expected = original(input_ids=ids).logits
        model(input_ids=ids)  # the first call: the switch's check
        seen = _spy_sdpa(monkeypatch)
        torch._dynamo.reset()
        got = torch.compile(model, backend="eager")(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    assert seen == [(False, True)] * 2
