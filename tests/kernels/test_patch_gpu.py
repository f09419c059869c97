"""opadvisor.patch on the GPU: the replacements pass their first-call checks under bf16 autocast (the
Triton kernels, SDPA's fused backends, padded GEMMs), train with the original's losses, and are captured by
cuda_graphed after patching."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from opadvisor.kernels import cuda_graphed

import opadvisor

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


def bert(attn: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config).cuda()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50257, n_embd=256, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).cuda()


def batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, vocab, (4, 128), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def losses(model: nn.Module, vocab: int, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch(vocab)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    ("build", "vocab"), [(lambda: bert("eager"), 30522), (lambda: bert("sdpa"), 30522), (gpt2, 50257)]
)
def test_patched_models_train_with_the_originals_losses_under_bf16(build, vocab) -> None:
    original = build()
    patched = opadvisor.patch(copy.deepcopy(original), quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no module falls back at its first call
        got = losses(patched, vocab)
    assert not [e for e in opadvisor.patch_report(patched).left if e[2].startswith("fell back")]
    assert got == pytest.approx(losses(original, vocab), rel=2e-2, abs=2e-2)


class Logits(nn.Module):
    """A model called with tensors, returning a tensor: what cuda_graphed captures."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


def test_patch_then_cuda_graphed_replays_the_patched_forwards() -> None:
    # SDPA attention: with attn_implementation="eager" the capture failed on the H200 ("Cannot copy
    # between CPU and CUDA tensors during CUDA graph capture", transformers 5.17), a host-to-device copy
    # on transformers' eager path; the patched output blocks and LM head are the same either way.
    model = Logits(opadvisor.patch(bert("sdpa"), quiet=True))
    reference = Logits(bert("sdpa"))  # the same seed: the same weights, never patched
    graphed = cuda_graphed(model)
    b = batch(30522)
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = graphed(b["input_ids"], b["attention_mask"])
        out.float().square().mean().backward()
    assert graphed.forward.graphs, "nothing was captured"
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        want = reference(b["input_ids"], b["attention_mask"])
        got = model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


def test_padded_lm_head_matches_the_plain_linear() -> None:
    lin = nn.Linear(256, 30522).cuda()
    x = torch.randn(512, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = lin(x)
        opadvisor.patch(lin, quiet=True)
        got = lin(x)
    assert opadvisor.patch_report(lin).patched == [("", "torch.nn.modules.linear.Linear", "padded_linear")]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
