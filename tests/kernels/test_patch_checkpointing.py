"""opadvisor.patch on models trained with gradient checkpointing (transformers' `gradient_checkpointing_enable`,
torch.utils.checkpoint either way: non-reentrant, transformers 5's default, and reentrant): every fix stays
installed (no first-call check fails), the loss and gradients are the original's, the same over two steps.

Before, a patched module's first call inside a non-reentrant checkpoint ran its check's backward through the
checkpoint's saved-tensor hooks, which recomputed the whole layer from inside the check (calling the module
again, whose nested check fell back, then a second fall-back of the same module raised KeyError), and a
model-level check's autograd.grad was refused by a reentrant checkpoint: every family fell back or crashed.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from test_patch import tiny_bert, tiny_gpt2
from test_patch_deberta import tiny as tiny_deberta
from test_patch_llama import tiny as tiny_llama

import opadvisor

pytest.importorskip("transformers")


def build(family: str) -> nn.Module:
    if family == "llama":
        return tiny_llama(use_cache=False)
    if family == "gpt2":
        model = tiny_gpt2()
        model.config.use_cache = False
        return model
    return tiny_bert() if family == "bert" else tiny_deberta()


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def checkpointed_pair(family: str, reentrant: bool) -> tuple[nn.Module, nn.Module]:
    original = build(family).train()
    original.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return original, opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)


def assert_trains_as_the_original(original: nn.Module, patched: nn.Module) -> None:
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    got = [step(patched, ids) for _ in range(2)]
    want_loss, want_grads = step(original, ids)
    for loss, grads in got:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


# DeBERTa-v3 (relative embeddings through a LayerNorm) under a reentrant checkpoint fails without opadvisor:
# transformers 5.x's own model raises "backward through the graph a second time" at its first backward
CASES = [
    (f, r) for f in ("llama", "gpt2", "bert", "deberta") for r in (False, True) if (f, r) != ("deberta", True)
]


@pytest.mark.parametrize(
    ("family", "reentrant"), CASES, ids=[f"{f}-{'' if r else 'non-'}reentrant" for f, r in CASES]
)
def test_patched_models_train_under_gradient_checkpointing(
    family: str, reentrant: bool, reference_path
) -> None:
    original, patched = checkpointed_pair(family, reentrant)
    installed = set(opadvisor.patch_report(patched).patched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no first-call check may fail
        assert_trains_as_the_original(original, patched)
    assert set(opadvisor.patch_report(patched).patched) == installed and installed


def test_a_first_call_check_keeps_the_parameters_gradients_it_found(reference_path) -> None:
    """Under a reentrant checkpoint the model-level checks differentiate through `backward` (autograd.grad is
    refused there): the gradients a parameter held before are put back, not added to."""
    original = tiny_llama(use_cache=False).train()
    original.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    held = {n: torch.full_like(p, 0.5) for n, p in patched.named_parameters()}
    for n, p in patched.named_parameters():
        p.grad = held[n].clone()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        patched(input_ids=ids, labels=ids)  # the first call: its checks run, no backward of the caller's
    for n, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, held[n], msg=n)
