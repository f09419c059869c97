"""opadvisor.patch on the Llama family (Llama, Mistral, Qwen2, Qwen3: tiny models from config objects, nothing
downloaded): RMSNorm (hf_rms_norm), the SwiGLU MLP (hf_swiglu_mlp), the causal-LM loss (hf_causal_lm_loss,
safe) and the LM head fused with it (hf_linear_cross_entropy, unsafe: logits None in training). The patched
model computes the original's loss and gradients, comes back exactly after unpatch, refuses a changed class by
name, falls back where its first-call check fails, and composes with torch.compile(fullgraph=True)."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
from patch_testlib import fixes, forwards, sgd_losses, with_replacement

import opadvisor
from opadvisor.libraries import llama_family_classes
from opadvisor.patching import llama as llama_patch
from opadvisor.patching.fingerprint import _fingerprint_problem
from opadvisor.patching.shared import STATE

transformers = pytest.importorskip("transformers")

FAMILIES = ["Llama", "Mistral", "Qwen2", "Qwen3"]
SAFE = {"hf_rms_norm", "hf_swiglu_mlp", "hf_causal_lm_loss"}
UNSAFE = {"hf_rms_norm", "hf_swiglu_mlp", "hf_linear_cross_entropy"}


def tiny(family: str = "Llama", seed: int = 0, layers: int = 2, **overrides) -> nn.Module:
    config = getattr(transformers, f"{family}Config")(
        vocab_size=101, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=layers, num_key_value_heads=2, head_dim=8, max_position_embeddings=32, **overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    x = ids()
    out = model(input_ids=x, labels=kwargs.pop("labels", x), **kwargs)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), grads


def assert_same_training(original: nn.Module, patched: nn.Module, rtol: float = 1e-4) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no first-call check may fail
        got, got_grads = loss_and_grads(patched)
    want, want_grads = loss_and_grads(original)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=rtol, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("unsafe", [False, True])
def test_patched_family_trains_as_the_original_and_unpatches_exactly(family, unsafe, reference_path) -> None:
    original = tiny(family)
    model = copy.deepcopy(original)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before = forwards(model)
    opadvisor.patch(model, unsafe=unsafe, quiet=True)
    assert fixes(model) >= (UNSAFE if unsafe else SAFE)
    assert_same_training(original, model)
    out = model(input_ids=ids(), labels=ids())
    assert (out.logits is None) == unsafe  # the unsafe part: no logits in training with labels
    opadvisor.unpatch(model)
    assert forwards(model) == before and not any(STATE in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())


def test_the_kernels_run_through_the_interpreter_and_keep_the_losses() -> None:
    """The Triton kernels themselves (TRITON_INTERPRET=1, set by conftest), two SGD steps."""
    from opadvisor.kernels import dispatch_counts, reset_dispatch_counts

    original = tiny(layers=1)
    model = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    reset_dispatch_counts()
    losses = [sgd_losses(m, lambda: {"input_ids": ids(), "labels": ids()}) for m in (original, model)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    counts = dispatch_counts()
    for op in ("rms_norm", "silu_mul_linear", "rotary_embedding", "linear_cross_entropy"):
        assert counts[op].get("kernel", 0) > 0, (op, counts)


def test_eval_and_calls_without_labels_run_the_original_head(reference_path) -> None:
    original, model = tiny(), opadvisor.patch(tiny(), unsafe=True, quiet=True)
    with torch.no_grad():
        want = original(input_ids=ids()).logits
        got = model(input_ids=ids()).logits
        model.eval()
        out = model(input_ids=ids(), labels=ids())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert out.logits is not None and out.loss is not None  # eval with labels: logits as the original


def test_fused_head_keeps_num_items_in_batch_ignored_labels_and_tuples(reference_path) -> None:
    original = tiny()
    model = opadvisor.patch(copy.deepcopy(original), rules=["fused_cross_entropy"], unsafe=True, quiet=True)
    assert fixes(model) == {"hf_linear_cross_entropy"}
    labels = ids()
    labels[0, ::3] = -100
    kwargs = {"input_ids": ids(), "labels": labels, "num_items_in_batch": torch.tensor(17)}
    torch.testing.assert_close(model(**kwargs).loss, original(**kwargs).loss, rtol=1e-5, atol=1e-6)
    loss, *rest = model(**kwargs, return_dict=False)
    torch.testing.assert_close(loss, original(**kwargs).loss, rtol=1e-5, atol=1e-6)


def test_a_refused_fused_head_leaves_the_model_to_the_safe_loss_patch(reference_path) -> None:
    """unsafe=True with a hook on the decoder (the fused head would skip it): hf_linear_cross_entropy is refused
    with its reason, and the next fix in the order of preference, hf_causal_lm_loss, patches the model."""
    original = tiny()
    model = copy.deepcopy(original)
    seen = []
    model.model.register_forward_hook(lambda m, a, out: seen.append(1))
    opadvisor.patch(model, rules=["fused_cross_entropy"], unsafe=True, quiet=True)
    report = opadvisor.patch_report(model)
    assert fixes(model) == {"hf_causal_lm_loss"}
    reasons = [reason for _, _, reason in report.left]
    assert any(r.startswith("hf_linear_cross_entropy: its LlamaModel has hooks") for r in reasons), reasons
    torch.testing.assert_close(
        model(input_ids=ids(), labels=ids()).loss, original(input_ids=ids(), labels=ids()).loss
    )
    assert seen  # the hook ran


def test_under_bf16_autocast_no_first_call_check_falls_back(reference_path) -> None:
    model = opadvisor.patch(tiny(), unsafe=True, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids(), labels=ids()).loss
        loss.backward()
    assert fixes(model) == UNSAFE | {"padded_linear", "hf_llama_rope", "hf_attn_switch"}
    assert not [why for _, _, why in opadvisor.patch_report(model).left if why.startswith("fell back")]


def test_weight_gradients_in_float32_are_eagers_on_the_cpu(monkeypatch, reference_path) -> None:
    """casts.WEIGHT_GRAD_F32: the projections go through autocast_linear, which on the CPU (no float32-output
    product there) computes what each nn.Linear computes under autocast: the same loss and gradients, bit for
    bit (on CUDA the weights' gradients are the products' float32 sums: test_on_cuda_... below)."""
    from opadvisor.kernels import casts

    def run(flag: bool):
        monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", flag)
        model = opadvisor.patch(tiny(), quiet=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids(), labels=ids()).loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    (loss, grads), (loss_f32, grads_f32) = run(False), run(True)
    assert torch.equal(loss, loss_f32)
    assert grads.keys() == grads_f32.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_f32[name]), name


def test_a_changed_class_is_refused_by_name(monkeypatch, capsys, reference_path) -> None:
    cls = transformers.models.mistral.modeling_mistral.MistralRMSNorm

    def changed(self, hidden_states):  # a release that normalised differently
        return self.weight * hidden_states

    monkeypatch.setattr(cls, "forward", changed)
    model = opadvisor.patch(tiny("Mistral"), quiet=False)
    err = capsys.readouterr().err
    assert "left MistralRMSNorm x5: transformers" in err and "changed LlamaRMSNorm.forward" in err
    assert "hf_rms_norm" not in fixes(model) and "hf_swiglu_mlp" in fixes(model)


def test_an_mlp_whose_activation_is_not_silu_is_left_with_the_reason(reference_path) -> None:
    model = opadvisor.patch(tiny(hidden_act="gelu"), quiet=True)
    left = {(cls.rsplit(".", 1)[-1], why) for _, cls, why in opadvisor.patch_report(model).left}
    assert ("LlamaMLP", "its activation is GELUActivation, not SiLU (the kernel is silu(gate) * up)") in left
    assert "hf_swiglu_mlp" not in fixes(model)


def test_a_replacement_that_differs_falls_back_at_its_first_call(monkeypatch, reference_path) -> None:
    with_replacement(monkeypatch, "hf_rms_norm", lambda m, s, x: m.weight * x)
    original = tiny()
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_rms_norm"], quiet=True)
    with pytest.warns(
        RuntimeWarning, match=r"model\.layers\.0\.input_layernorm .*keeps its original forward"
    ):
        got = model(input_ids=ids(), labels=ids()).loss
    torch.testing.assert_close(got, original(input_ids=ids(), labels=ids()).loss)
    assert all("forward" not in m.__dict__ for m in model.modules())
    fell_back = [
        path
        for path, _, why in opadvisor.patch_report(model).left
        if why.startswith("fell back at its first")
    ]
    assert len(fell_back) == 5 and not opadvisor.patch_report(model).patched


def test_the_installed_transformers_is_the_code_the_llama_patches_reproduce() -> None:
    for block in ("RMSNorm", "MLP", "ForCausalLM", "Attention"):
        key = f"Llama{block}"
        for qualified in llama_family_classes(block):
            module_name, _, name = qualified.rpartition(".")
            cls = getattr(importlib.import_module(module_name), name)
            prefix = name[: -len(block)]
            assert _fingerprint_problem(cls, f"{key}.forward", cls.forward, prefix) is None, qualified


def test_compiled_with_fullgraph_after_one_eager_step(monkeypatch) -> None:
    """torch.compile(patched model, fullgraph=True) traces without a graph break (the kernels are custom ops:
    COMPILE_PATH "custom_op" for RMSNorm, the MLP and the rotary embedding, always for the fused head) and gives the loss."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(importlib.import_module("opadvisor.kernels.rms_norm"), "COMPILE_PATH", "custom_op")
    monkeypatch.setattr(
        importlib.import_module("opadvisor.kernels.activations"), "SILU_MUL_COMPILE_PATH", "custom_op"
    )
    monkeypatch.setattr(importlib.import_module("opadvisor.kernels.rope"), "COMPILE_PATH", "custom_op")
    # use_cache=False as training scripts set it: LlamaModel then passes use_cache=False to every attention,
    # whose rotary patch looks for a cache among its arguments (that bool once broke the graph in every layer)
    original = tiny(layers=1, use_cache=False)
    model = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    model(input_ids=ids(), labels=ids()).loss.backward()  # the first-call checks run eagerly
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    assert_same_training(original, compiled)
    assert counter.frame_count == 1
    ops = {str(n.target) for n in counter.graphs[0].graph.nodes if "opadvisor" in str(n.target)}
    names = ("rms_norm_fwd", "silu_mul_fwd", "rope_fwd", "linear_cross_entropy")
    assert ops == {f"opadvisor.{op}.default" for op in names}


def test_an_eager_llama_gets_the_attention_switch_inside_the_loss_patch(reference_path) -> None:
    """The root's forward carries the loss patch, so transformers' SDPA switch (hf_attn_switch) goes to the
    LlamaModel inside, which shares the config: the attention runs SDPA, the losses are kept, unpatch puts
    "eager" back."""
    original = tiny(attn_implementation="eager")
    model = opadvisor.patch(copy.deepcopy(original), quiet=True)
    patched = {(path, fix) for path, _, fix in opadvisor.patch_report(model).patched}
    assert {("", "hf_causal_lm_loss"), ("model", "hf_attn_switch")} <= patched
    assert_same_training(original, model)
    assert (
        model.config._attn_implementation == "opadvisor_sdpa"
        and original.config._attn_implementation == "eager"
    )
    opadvisor.unpatch(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.gpu
@pytest.mark.parametrize("weight_grad_f32", [False, True], ids=["eager-casts", "weight-grad-f32"])
def test_on_cuda_under_bf16_autocast_the_kernels_run_and_keep_the_losses(
    weight_grad_f32, monkeypatch
) -> None:
    """A small Llama (Llama-3's vocabulary) on the GPU: every first-call check passes under bf16 autocast, the
    Triton kernels run, and three AdamW steps give the original's losses (bf16 rounding apart), also where the
    projections' weight gradients are written in float32 (casts.WEIGHT_GRAD_F32)."""
    from opadvisor.kernels import casts, dispatch_counts, reset_dispatch_counts

    monkeypatch.setattr(casts, "WEIGHT_GRAD_F32", weight_grad_f32)

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).cuda()
    model = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    x = torch.randint(
        0, 128256, (4, 1024), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)
    )
    reset_dispatch_counts()
    losses = []
    for m in (original, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        run = []
        for _ in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = m(input_ids=x, labels=x).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    assert fixes(model) == UNSAFE | {"hf_llama_rope", "hf_attn_switch"}
    for op in ("rms_norm", "silu_mul_linear", "rotary_embedding", "linear_cross_entropy"):
        assert dispatch_counts()[op].get("kernel", 0) > 0, op


def _cache_name(cls: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _decode(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prompt, then of one token fed through the KV cache the model returned."""
    name = _cache_name(type(model))
    with torch.no_grad():
        out = model(input_ids=x[:, :8], use_cache=True)
        step = model(input_ids=x[:, 8:9], use_cache=True, **{name: out[name]})
    return [out.logits, step.logits]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_attention_with_the_rope_kernel_is_the_original(attn, reference_path) -> None:
    """hf_llama_rope: the loss and every gradient as the original's, under either attention implementation;
    decoding through the KV cache gives the original's logits."""
    original = tiny(attn_implementation=attn)
    model = opadvisor.patch(copy.deepcopy(original), rules=["hf_llama_rope"], quiet=True)
    patched = {path for path, _, fix in opadvisor.patch_report(model).patched if fix == "hf_llama_rope"}
    assert patched == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert_same_training(original, model)
    for got, want in zip(_decode(model.eval(), ids()), _decode(original.eval(), ids()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _saved_bytes_and_grads(model: nn.Module) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward (each storage once) in one bf16-autocast step, the loss, the grads."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids(), labels=ids()).loss
    loss.backward()
    return sum(saved.values()), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_under_autocast_each_block_keeps_one_16_bit_copy_of_its_projections_input(
    monkeypatch, reference_path
) -> None:
    """q/k/v (and gate/up) read one bf16 copy of the float32 normed hidden states, not one each: two copies
    fewer per attention and one per MLP, with the same loss and gradients as when each projection casts."""
    model = opadvisor.patch(tiny(), quiet=True)
    _saved_bytes_and_grads(model)  # the first call runs the checks
    shared, loss, grads = _saved_bytes_and_grads(model)
    monkeypatch.setattr(
        llama_patch, "autocast_shared", lambda x, n: (x,) * n
    )  # each projection casts for itself
    own, want_loss, want_grads = _saved_bytes_and_grads(model)
    copy = 2 * 16 * 32 * 2  # one bf16 copy of the [2, 16, 32] hidden states
    assert own - shared == 2 * (2 + 1) * copy  # two layers: two in the attention, one in the MLP
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[n], g) for n, g in want_grads.items())
