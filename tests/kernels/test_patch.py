"""opadvisor.patch / unpatch on models whose code lives in libraries (transformers, torch.nn).

Tiny models from config objects (nothing downloaded). Patched models must compute what the originals
compute (values and gradients; dropout off), train with the same losses on the CPU through the reference
path and through Triton's interpreter, and come back exactly after unpatch.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from patch_testlib import with_replacement

import opadvisor
from opadvisor.patching import check as first_call
from opadvisor.patching.arguments import _named_parameters
from opadvisor.patching.fingerprint import _fingerprint_problem
from opadvisor.patching.shared import STATE, _qualified

transformers = pytest.importorskip("transformers")


def tiny_bert(attn: str = "eager", dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=101,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation=attn,
    )
    return transformers.BertForMaskedLM(config)


def tiny_gpt2(attn: str = "eager", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def losses(model: nn.Module, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        loss = model(**batch()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.fixture(params=["reference", "interpreter"])
def kernel_path(request, monkeypatch):
    """The CPU reference implementation, or the Triton kernels through the interpreter (conftest sets it)."""
    # Triton picks interpreting or compiling when it is first imported: import it while TRITON_INTERPRET=1
    # holds, so that a reference test running first in a worker does not leave it compiling for the rest.
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module("triton")
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def _forwards(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def test_bert_patch_then_unpatch_is_exact(capsys) -> None:
    model = tiny_bert()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = _forwards(model)
    model.eval()
    with torch.no_grad():
        before = model(**batch()).logits
    assert opadvisor.patch(model) is model
    report = capsys.readouterr().err
    assert "patched 9 modules" in report and "BertSelfAttention x2 (hf_bert_self_attention" in report
    # the switch too: transformers then builds SDPA's masks (capturable in a CUDA graph), which the patched
    # attention takes
    assert "BertModel x1 (hf_attn_switch: bert)" in report
    assert (
        "BertOutput x2 (hf_bert_output" in report
        and "Linear x1 (padded_linear: cls.predictions.decoder)" in report
    )
    with torch.no_grad():
        during = model(**batch()).logits
    torch.testing.assert_close(during, before, rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "opadvisor_sdpa"
    assert opadvisor.unpatch(model) is model
    assert model.config._attn_implementation == "eager"
    assert _forwards(model) == forwards and all("forward" not in m.__dict__ for m in model.modules())
    assert not any(STATE in m.__dict__ for m in model.modules()) and opadvisor.patch_report(model) is None
    after_state = model.state_dict()
    assert list(after_state) == list(state) and all(torch.equal(after_state[k], v) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(model(**batch()).logits, before)


def test_patched_bert_trains_with_the_originals_losses(kernel_path) -> None:
    original = tiny_bert()
    patched = opadvisor.patch(copy.deepcopy(original), quiet=True)
    assert losses(patched) == pytest.approx(losses(original), rel=1e-4, abs=1e-5)


def test_patched_gpt2_trains_with_the_originals_losses(kernel_path) -> None:
    original = tiny_gpt2()
    patched = opadvisor.patch(copy.deepcopy(original), quiet=True)
    report = opadvisor.patch_report(patched)
    fixes = {fix for _, _, fix in report.patched}
    assert fixes == {"hf_gpt2_attention", "hf_gelu_tanh", "padded_linear", "hf_causal_lm_loss"}
    assert losses(patched) == pytest.approx(losses(original), rel=1e-4, abs=1e-5)


def test_gpt2_head_and_loss_fused_keep_loss_gradients_and_the_tied_weight(kernel_path) -> None:
    """unsafe=True: GPT-2's LM head and loss as one linear_cross_entropy (hf_linear_cross_entropy) in training
    with labels: the original's loss and gradients (the head's weight is the tied token embedding: one
    gradient, from both uses), logits None; without labels, or in eval, the logits as the original's."""
    original = tiny_gpt2(attn="sdpa")
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    fixes = {fix for _, _, fix in opadvisor.patch_report(patched).patched}
    assert "hf_linear_cross_entropy" in fixes and "hf_causal_lm_loss" not in fixes
    assert patched.lm_head.weight is patched.transformer.wte.weight
    grads = []
    for model in (original, patched):
        out = model(**batch())
        out.loss.backward()
        grads.append(({n: p.grad for n, p in model.named_parameters()}, out))
    (want, want_out), (got, got_out) = grads
    assert got_out.logits is None and type(got_out) is type(want_out)
    torch.testing.assert_close(got_out.loss, want_out.loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        ids = batch()["input_ids"]
        torch.testing.assert_close(patched(input_ids=ids).logits, original(input_ids=ids).logits)
    assert losses(patched) == pytest.approx(losses(original), rel=1e-4, abs=1e-5)


def test_bert_decoder_and_loss_fused_keep_loss_and_gradients(kernel_path) -> None:
    """unsafe=True: BertForMaskedLM's decoder (matrix product and bias) and loss as one linear_cross_entropy
    (hf_mlm_linear_cross_entropy) in training with labels: the original's loss and gradients (the decoder's
    weight tied to the word embeddings, its bias), logits None, a tuple where return_dict=False; without labels,
    or in eval, the logits as the original's."""
    original = tiny_bert(attn="sdpa")
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    fixes = {fix for _, _, fix in opadvisor.patch_report(patched).patched}
    assert "hf_mlm_linear_cross_entropy" in fixes and "hf_mlm_loss" not in fixes
    outs = []
    for model in (original, patched):
        out = model(**batch())
        out.loss.backward()
        outs.append(({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out))
    (want, want_out), (got, got_out) = outs
    assert got_out.logits is None and type(got_out) is type(want_out)
    torch.testing.assert_close(got_out.loss, want_out.loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    assert (
        patched.cls.predictions.decoder.bias.grad is not None
    )  # the decoder's bias (tied: cls.predictions.bias)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    loss, *_ = patched(**batch(), return_dict=False)
    torch.testing.assert_close(loss, want_out.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ids = batch()["input_ids"]
        torch.testing.assert_close(patched(input_ids=ids).logits, original(input_ids=ids).logits)
    assert losses(patched) == pytest.approx(losses(original), rel=1e-4, abs=1e-5)


def test_bert_decoder_fusion_refuses_a_replaced_head_and_keeps_the_loss_patch() -> None:
    """A decoder that is not a plain nn.Linear (a subclass a user wrote): the fused decoder is refused with the
    reason, and the next fix in the order of preference, the safe loss patch, takes the model (it reads the
    logits the decoder computed)."""

    class ScaledDecoder(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    model = tiny_bert(attn="sdpa")
    old = model.cls.predictions.decoder
    model.cls.predictions.decoder = ScaledDecoder(old.in_features, old.out_features)
    opadvisor.patch(model, unsafe=True, quiet=True)
    report = opadvisor.patch_report(model)
    assert "hf_mlm_loss" in {fix for _, _, fix in report.patched}
    reasons = [reason for _, _, reason in report.left]
    assert any(
        "its decoder is a ScaledDecoder, not Linear" in r and "hf_mlm_loss patched it instead" in r
        for r in reasons
    )


def _cache_name(cls: type) -> str:
    """The name the installed transformers gives the KV cache argument (5.24 renamed it)."""
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _decode(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prompt, then of two tokens fed one at a time through the KV cache the model returned."""
    name = _cache_name(type(model))
    out = model(input_ids=ids[:, :8], use_cache=True)
    logits = [out.logits]
    for i in (8, 9):
        out = model(input_ids=ids[:, i : i + 1], use_cache=True, **{name: out[name]})
        logits.append(out.logits)
    return logits


def test_patched_gpt2_decodes_through_its_kv_cache_as_the_original() -> None:
    original = tiny_gpt2().eval()
    patched = opadvisor.patch(copy.deepcopy(original), quiet=True)
    assert "hf_gpt2_attention" in {fix for _, _, fix in opadvisor.patch_report(patched).patched}
    ids = batch()["input_ids"]
    with torch.no_grad():
        for got, want in zip(_decode(patched, ids), _decode(original, ids), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_patched_gpt2_attention_takes_its_cache_by_position_and_by_name() -> None:
    """GPT2Attention called directly, its cache passed in the argument's place and by its name: the keys and
    values the cache holds afterwards and the output are the original's."""
    from transformers.cache_utils import DynamicCache

    original = tiny_gpt2().eval()
    patched = opadvisor.patch(copy.deepcopy(original), quiet=True)
    name = _cache_name(type(original.transformer.h[0].attn))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    results = []
    for model in (original, patched):
        attn = model.transformer.h[0].attn
        by_position, by_name = DynamicCache(config=model.config), DynamicCache(config=model.config)
        with torch.no_grad():
            outs = (attn(x, by_position)[0], attn(x, **{name: by_name})[0])
        results.append((*outs, by_position.layers[0].keys, by_name.layers[0].values))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_all_fixes_compile_with_fullgraph_after_one_eager_step(family) -> None:
    """All of a family's patches (unsafe too) under the user's torch.compile(fullgraph=True): one graph, no
    break (issue 31: no graph break introduced by opadvisor's code), the original's loss. Built with
    use_cache=False as training scripts set it, which passes the flag to every attention."""
    from torch._dynamo.testing import CompileCounterWithBackend

    original = tiny_bert() if family == "bert" else tiny_gpt2()
    original.config.use_cache = False
    model = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    model(**batch()).loss.backward()  # the first-call checks run eagerly
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = compiled(**batch()).loss
    torch.testing.assert_close(got, original(**batch()).loss, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


def test_encoder_layer_and_multihead_attention(kernel_path) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    original = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    fixes = {fix for _, _, fix in opadvisor.patch_report(patched).patched}
    assert fixes == {"transformer_encoder_layer", "mha_weights_off"}
    x = torch.randn(2, 8, 32)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 6:] = True
    for model in (original, patched):
        model.train()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = original(xa, src_key_padding_mask=pad), patched(xb, src_key_padding_mask=pad)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    a.square().sum().backward()
    b.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    mha = patched.layers[0].self_attn
    out, weights = mha(x, x, x)
    assert weights is None and out.shape == x.shape  # the unsafe part: weights are not returned


def test_per_instance_never_the_class(capsys) -> None:
    teacher, student = tiny_bert(), tiny_bert(seed=1)
    opadvisor.patch(student)
    assert not any(STATE in m.__dict__ for m in teacher.modules())
    cls = transformers.models.bert.modeling_bert.BertSelfOutput
    assert cls.forward.__qualname__ == "BertSelfOutput.forward"  # the class is untouched
    assert "forward" in student.bert.encoder.layer[0].attention.output.__dict__


def test_rules_select_and_unknown_rules_are_refused(capsys) -> None:
    model = opadvisor.patch(tiny_bert(), rules=["fused_dropout_add"])
    assert {fix for _, _, fix in opadvisor.patch_report(model).patched} == {"hf_bert_output"}
    with pytest.raises(ValueError, match="unknown rule"):
        opadvisor.patch(tiny_bert(), rules=["no_such_rule"])


def test_default_attention_is_left_with_the_reason(capsys) -> None:
    opadvisor.patch(tiny_bert("sdpa"))
    err = capsys.readouterr().err
    assert 'left BertSelfAttention x2: already runs attn_implementation="sdpa"' in err


def test_nothing_to_patch_and_unknown_architectures_are_said(capsys) -> None:
    opadvisor.patch(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert "nothing to patch in Sequential" in capsys.readouterr().err
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    opadvisor.patch(transformers.MistralForCausalLM(config))
    err = capsys.readouterr().err
    assert (
        "unknown architecture: opadvisor has no patch for "
        "transformers.models.mistral.modeling_mistral.MistralAttention" in err
    )


def test_a_replacement_that_differs_falls_back_with_a_warning(monkeypatch) -> None:
    with_replacement(monkeypatch, "hf_gelu_tanh", lambda m, s, x: torch.nn.functional.gelu(x) * 1.5)
    model = opadvisor.patch(tiny_gpt2(), rules=["hf_gelu_tanh"], quiet=True)
    act = model.transformer.h[0].mlp.act
    bound = act.forward  # the patched forward, as a wrapper holding it (a checkpoint's function) keeps it
    x = torch.randn(4, 32)
    with pytest.warns(
        RuntimeWarning, match=r"transformer\.h\.0\.mlp\.act .*keeps its original forward.*differs"
    ):
        y = act(x)
    assert torch.equal(y, type(act).forward(act, x)) and "forward" not in act.__dict__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        act(x)  # once: the module is back to its original forward
        assert torch.equal(bound(x), y)  # the forward bound before runs the original too, said no more


def test_the_installed_transformers_is_the_code_the_patches_reproduce() -> None:
    """Fail loudly when a transformers release changes a forward a patch replaces (see _FINGERPRINTS)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, fixed_cross_entropy

    from opadvisor.libraries import FIXES

    for fix in FIXES:
        if fix.kind != "patch":
            continue
        for qualified in fix.classes:
            if not qualified.startswith("transformers.") or qualified.endswith(".*"):
                continue  # "transformers.*" (hf_attn_switch): transformers' own switch, no forward replaced
            module_name, _, name = qualified.rpartition(".")
            cls = getattr(importlib.import_module(module_name), name)
            checks = {
                "hf_bert_self_attention": [
                    ("BertSelfAttention.forward", cls.forward, name[: -len("SelfAttention")])
                ],
                "hf_bert_output": [
                    (
                        "BertOutput.forward",
                        cls.forward,
                        name[: -len("SelfOutput" if name.endswith("SelfOutput") else "Output")],
                    )
                ],
                "hf_gpt2_attention": [("GPT2Attention.forward", cls.forward, None)],
                "hf_gelu_tanh": [("NewGELUActivation.forward", cls.forward, None)],
                "hf_mlm_loss": [
                    (f"{name}.forward", cls.forward, None)
                ],  # BertForMaskedLM, DebertaV2ForMaskedLM
                "hf_causal_lm_loss": [
                    ("GPT2LMHeadModel.forward", cls.forward, None)
                    if name == "GPT2LMHeadModel"
                    else ("LlamaForCausalLM.forward", cls.forward, name[: -len("ForCausalLM")]),
                    ("ForCausalLMLoss", LOSS_MAPPING["ForCausalLM"], None),
                    ("fixed_cross_entropy", fixed_cross_entropy, None),
                ],
                # the Llama family's: tests/kernels/test_patch_llama.py
                "hf_mlm_linear_cross_entropy": [("BertForMaskedLM.forward", cls.forward, None)],
                "hf_linear_cross_entropy": [
                    ("GPT2LMHeadModel.forward", cls.forward, None)
                    if name == "GPT2LMHeadModel"
                    else ("LlamaForCausalLM.forward", cls.forward, name[: -len("ForCausalLM")])
                ],
                "hf_rms_norm": [("LlamaRMSNorm.forward", cls.forward, name[: -len("RMSNorm")])],
                "hf_swiglu_mlp": [("LlamaMLP.forward", cls.forward, name[: -len("MLP")])],
                "hf_llama_rope": [("LlamaAttention.forward", cls.forward, name[: -len("Attention")])],
                "hf_attn_implementation": [],
                # the DeBERTa family's (several functions each): tests/kernels/test_patch_deberta.py
                "hf_deberta_attention": [],
                "hf_deberta_positions": [],
            }[fix.name]
            for key, function, prefix in checks:
                assert _fingerprint_problem(cls, key, function, prefix) is None, qualified


def test_importing_opadvisor_does_not_import_torch() -> None:
    code = "import sys, opadvisor; assert 'torch' not in sys.modules; opadvisor.patch; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2])
def test_first_call_checks_pass_under_bf16_autocast(build, kernel_path) -> None:
    """Under autocast the check's tolerance is bf16's (a LayerNorm's float32 output after a bf16 product
    carries bf16 rounding): no module falls back."""
    model = opadvisor.patch(build(), quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch()).loss
        loss.backward()
    assert not opadvisor.patch_report(model).left and len(opadvisor.patch_report(model).patched) >= 5


# ---- the LM heads' loss (hf_mlm_loss, hf_causal_lm_loss) ---------------------------------------------------
def _labels_with_ignored(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, ::3] = -100  # the masked-LM convention: only some positions carry a label
    labels[1, 10:] = -100
    return labels


def _loss_and_grads(model: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(*args, **kwargs)
    loss = out[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [tiny_bert, tiny_gpt2])
def test_lm_loss_patch_gives_the_loss_and_gradients_of_the_original(build, kernel_path) -> None:
    """Labels with -100 (ignored), passed by keyword, positionally and with return_dict=False; the loss
    and every parameter's gradient are the original's, and unpatch gives back the original forward."""
    rule = ["fused_cross_entropy"]
    original = build()
    patched = opadvisor.patch(copy.deepcopy(original), rules=rule, quiet=True)
    fix = "hf_mlm_loss" if isinstance(original, transformers.BertForMaskedLM) else "hf_causal_lm_loss"
    assert opadvisor.patch_report(patched).patched == [("", _qualified(type(original)), fix)]
    data = batch()
    data["labels"] = _labels_with_ignored(data["input_ids"])
    labels_at = _named_parameters(type(original).forward).index("labels") - 1  # without self
    positional = [None] * labels_at + [data["labels"]]
    positional[0] = data["input_ids"]
    calls = [((), data), ((), {**data, "return_dict": False}), (tuple(positional), {})]
    for args, kwargs in calls:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # the first-call check must pass
            want, want_grads = _loss_and_grads(original, *args, **kwargs)
            got, got_grads = _loss_and_grads(patched, *args, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    without_labels = {k: v for k, v in data.items() if k != "labels"}
    assert patched(**without_labels).loss is None
    assert "forward" in patched.__dict__ and opadvisor.unpatch(patched) is patched
    assert "forward" not in patched.__dict__


def test_causal_lm_loss_keeps_num_items_in_batch() -> None:
    """GPT-2 hands **kwargs such as num_items_in_batch (gradient accumulation) to its loss: a sum divided
    by it, as transformers' ForCausalLMLoss computes."""
    original = tiny_gpt2()
    patched = opadvisor.patch(copy.deepcopy(original), rules=["fused_cross_entropy"], quiet=True)
    data = {**batch(), "num_items_in_batch": torch.tensor(40)}
    torch.testing.assert_close(patched(**data).loss, original(**data).loss, rtol=1e-5, atol=1e-6)


def test_lm_loss_patch_leaves_a_replaced_loss_function_alone(capsys) -> None:
    model = tiny_gpt2()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    opadvisor.patch(model, rules=["fused_cross_entropy"], quiet=True)
    (left,) = [entry for entry in opadvisor.patch_report(model).left if entry[0] == ""]
    assert left[2].startswith("its loss_function was replaced") and not opadvisor.patch_report(model).patched
    assert "forward" not in model.__dict__


def test_a_bias_gradient_is_judged_at_its_weights_scale() -> None:
    # A key bias's gradient is zero in exact arithmetic (softmax ignores a constant per row): in bf16 what is
    # left is rounding noise at the scale of the key weight's gradient, which must not fail the check, while
    # a bias gradient off by more than that tolerance still does.
    scale_of = {"key.weight": 2.0, "key.bias": 0.1, "other": 50.0}
    assert first_call._bias_floor("key.bias", scale_of) == 2.0
    assert first_call._bias_floor("key.weight", scale_of) == 0.0
    assert first_call._bias_floor("input 0", scale_of) == 0.0
    ref = torch.full((4,), 0.1)
    noisy = ref + 0.05  # 0.5 of its own scale, 0.025 of its weight's
    assert (
        first_call._compare(
            "gradient of key.bias", ref, noisy, 0.04, floor=first_call._bias_floor("key.bias", scale_of)
        )
        is None
    )
    wrong = ref + 0.5  # 0.25 of its weight's scale
    assert first_call._compare(
        "gradient of key.bias", ref, wrong, 0.04, floor=first_call._bias_floor("key.bias", scale_of)
    )


def test_16_bit_differences_are_judged_against_a_float32_run(monkeypatch) -> None:
    """Two bf16 programs rounded from the same exact values may differ by more than the tolerance (deep
    layers of a bf16 attention on a GPU: the hand-written softmax rounds its scores, SDPA does not). With a
    tolerance too tight for bf16 rounding, the exact replacement still passes (it is no further from a
    float32 run of the original than the original is); a wrong one still falls back, saying both distances."""
    monkeypatch.setattr(first_call, "_TOLERANCE", {d: 1e-6 for d in first_call._TOLERANCE})
    x = (torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3).bfloat16().requires_grad_()
    model = opadvisor.patch(tiny_gpt2(), rules=["hf_gelu_tanh"], quiet=True)
    act = model.transformer.h[0].mlp.act
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        act(x)
    assert STATE in act.__dict__ and list(act.__dict__[STATE].checked) == [(True, True, (False,), ())]

    with_replacement(monkeypatch, "hf_gelu_tanh", lambda m, s, x: torch.nn.functional.gelu(x) * 1.01)
    model = opadvisor.patch(tiny_gpt2(), rules=["hf_gelu_tanh"], quiet=True)
    act = model.transformer.h[0].mlp.act
    with pytest.warns(RuntimeWarning, match=r"against a float32 run of the original, its output is 0\.0"):
        act(x)
    assert "forward" not in act.__dict__


def test_the_float32_judgement_weighs_each_tensor_by_the_originals_own_error() -> None:
    exact = torch.linspace(-1, 1, 101)
    original = exact + 0.05 * torch.cos(torch.arange(101.0))  # 5% off: a 16-bit program's rounding, say
    close = exact + 0.08 * torch.sin(torch.arange(101.0))  # 8%: within twice the original's distance
    far = exact * 1.2  # 20%
    grads = {"weight": exact * 10}
    ref, good, bad = (original, {"weight": original * 10}), (close, grads), (far, grads)
    assert first_call._judged_against_float32(ref, good, (exact, grads), 0.04, "differs") is None
    said = first_call._judged_against_float32(ref, bad, (exact, grads), 0.04, "differs")
    assert said is not None and said.startswith("differs; against a float32 run") and "output is 0.2" in said
    lost = first_call._judged_against_float32(ref, (close, {"weight": None}), (exact, grads), 0.04, "differs")
    assert lost is not None and "gradient of weight is 1" in lost  # a lost gradient is all of it away
    # a key bias's gradient is zero in exact arithmetic: both 16-bit runs' noise is judged at the weight's scale
    noise = {"key.weight": exact * 10, "key.bias": exact * 1e-9}
    ref_noise = {"key.weight": original * 10, "key.bias": exact * 1e-3}
    new_noise = {"key.weight": close * 10, "key.bias": -exact * 3e-3}
    assert (
        first_call._judged_against_float32(
            (original, ref_noise), (close, new_noise), (exact, noise), 0.04, ""
        )
        is None
    )


def test_the_float32_judgement_takes_scattered_rounding_and_refuses_a_wrong_row() -> None:
    """SDPA's bf16 backward (H200, BERT-base): query/key gradients 0.02-0.06 of their scale from float32 at a
    few elements, 0.014-0.025 as a whole, where the hand-written original is 0.005 away. That is rounding; one
    wrong row (a padded query handled differently, say) is not, however small its share of the norm."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 64, generator=g)
    scale = exact.abs().max()
    original = exact + 0.002 * scale * torch.randn(64, 64, generator=g)
    scattered = exact + 0.004 * scale * torch.randn(64, 64, generator=g)
    scattered[3, 5] += 0.06 * scale  # a few elements far, the whole close
    wrong_row = exact.clone()
    wrong_row[7] = -exact[7]  # 1/64 of the rows: 0.18 of the norm, but elements off by twice the scale
    out = torch.ones(4)
    ref = (out, {"query.weight": original})
    assert (
        first_call._judged_against_float32(
            ref, (out, {"query.weight": scattered}), (out, {"query.weight": exact}), 0.04, ""
        )
        is None
    )
    said = first_call._judged_against_float32(
        ref, (out, {"query.weight": wrong_row}), (out, {"query.weight": exact}), 0.04, ""
    )
    assert said is not None and "query.weight" in said
    small_row = exact.clone()
    small_row[7, :2] += 0.25 * scale  # under the norm tolerance as a whole, far at its elements
    said = first_call._judged_against_float32(
        ref, (out, {"query.weight": small_row}), (out, {"query.weight": exact}), 0.04, ""
    )
    assert said is not None and "at its largest element" in said


def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own(reference_path) -> None:
    """copy.deepcopy of a patched model (an EMA or teacher copy): the copy's patches call the copy's own
    original forwards (the source's weights may drift), and unpatch on the copy restores the copy."""
    base = tiny_bert()
    expected = copy.deepcopy(base)  # the same weights, never patched
    model = opadvisor.patch(base, quiet=True)
    data = batch()
    model(**data)  # the first-call checks ran on the source
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.testing.assert_close(twin(**data).loss, expected(**data).loss, rtol=1e-4, atol=1e-5)
    patched = [m for m in twin.modules() if STATE in m.__dict__]
    assert patched and all(m.__dict__[STATE].original.__self__ is m for m in patched)
    opadvisor.unpatch(twin)
    assert all("forward" not in m.__dict__ for m in twin.modules())
    torch.testing.assert_close(twin(**data).loss, expected(**data).loss)
