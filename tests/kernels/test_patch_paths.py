"""The first-call check runs once per call path: training or evaluation, gradients on or off, which arguments
are given.

Training scripts often evaluate before they train: Lightning's sanity check runs two validation batches
first, HF Trainer's `eval_on_start`, a hand-written `evaluate()` before the loop. The check used to run
once, at the module's first call; an LM head's fused loss runs only in training with labels, so an
evaluation first compared the original with itself and the training step then ran a replacement nobody
had checked. Each path is now checked at its own first call (`install._call_path`)."""

from __future__ import annotations

import copy
import warnings

import opadvisor.kernels
import pytest
import torch
from patch_testlib import with_replacement
from test_patch import tiny_gpt2
from test_patch_checkpointing import assert_trains_as_the_original, build

import opadvisor

pytest.importorskip("transformers")

IDS = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))


def evaluate(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=IDS, labels=IDS).loss
    model.train()
    return loss


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "deberta"])
def test_evaluating_first_keeps_every_fix_and_trains_as_the_original(family: str, reference_path) -> None:
    torch.manual_seed(0)
    original = build(family).train()
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    installed = set(opadvisor.patch_report(patched).patched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no check may fail, on either path
        torch.testing.assert_close(evaluate(patched), evaluate(original), rtol=1e-5, atol=1e-6)
        assert_trains_as_the_original(original, patched)
    assert set(opadvisor.patch_report(patched).patched) == installed and installed


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_a_wrong_fused_head_is_caught_at_the_first_training_step_after_an_evaluation(
    family: str, monkeypatch, reference_path
) -> None:
    """The fused LM head and loss (unsafe) run only in training with labels: the evaluation cannot check
    them. Made wrong here, they are refused at the first training step, which gets the original's loss."""
    right = opadvisor.kernels.linear_cross_entropy
    monkeypatch.setattr(opadvisor.kernels, "linear_cross_entropy", lambda *a, **k: right(*a, **k) * 1.5)
    torch.manual_seed(0)
    original = build(family).train()
    patched = opadvisor.patch(copy.deepcopy(original), unsafe=True, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        evaluate(patched)  # the head's evaluation path is the original's: nothing to refuse
    with pytest.warns(RuntimeWarning, match="linear_cross_entropy replacement .*differs"):
        got = patched(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(got, original(input_ids=IDS, labels=IDS).loss, rtol=1e-5, atol=1e-6)
    assert not any(
        fix.endswith("linear_cross_entropy") for _, _, fix in opadvisor.patch_report(patched).patched
    )


class _WrongGradient(torch.autograd.Function):
    """tanh-GELU with the right values and a gradient twice too large."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.nn.functional.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(torch.nn.functional.gelu(x, approximate="tanh"), x, grad)
        return 2 * g


def test_a_call_without_gradients_checks_outputs_and_the_first_call_with_them_checks_gradients(
    monkeypatch,
) -> None:
    with_replacement(monkeypatch, "hf_gelu_tanh", lambda m, s, x: _WrongGradient.apply(x))
    model = opadvisor.patch(tiny_gpt2(), rules=["hf_gelu_tanh"], quiet=True)
    act = model.transformer.h[0].mlp.act
    x = torch.randn(4, 32, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.no_grad():
            act(x)  # the values are right: the path without gradients keeps the replacement
    assert "forward" in act.__dict__
    with pytest.warns(RuntimeWarning, match="hf_gelu_tanh replacement .*gradient"):
        y = act(x)
    assert "forward" not in act.__dict__
    y.sum().backward()
    want = torch.autograd.grad(type(act).forward(act, x).sum(), x)[0]
    torch.testing.assert_close(x.grad, want)


def test_each_path_is_checked_once(monkeypatch) -> None:
    """A second call on a path already checked runs the replacement straight away."""
    from opadvisor.patching import install

    calls = []
    real = install._first_call_check
    monkeypatch.setattr(install, "_first_call_check", lambda *a: calls.append(1) or real(*a))
    model = opadvisor.patch(tiny_gpt2(), rules=["hf_gelu_tanh"], quiet=True)
    act = model.transformer.h[0].mlp.act
    x = torch.randn(4, 32, requires_grad=True)
    for _ in range(3):
        act(x)
    assert len(calls) == 1
    act.eval()
    act(x)
    with torch.no_grad():
        act(x)
        act(x)
    assert len(calls) == 3
