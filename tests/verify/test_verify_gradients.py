"""Every gradient at step 1 (grads.py), the tolerances (tolerance.py) and the fused-call record
(implementations.py), on hand-made data: no child processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from opadvisor.verify.compare import Parity, add_gradients
from opadvisor.verify.grads import compare_gradients, save_gradients
from opadvisor.verify.implementations import fused_calls
from opadvisor.verify.tolerance import GRAD_RTOL_MAX, GRAD_RTOL_MIN, LOSS_TOLERANCE, derive


def model_with_grads(seed: int = 0, *, scale: float = 1.0, temperature_grad: bool = True):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    temperature = torch.nn.Parameter(torch.tensor(1.5))
    opt = torch.optim.SGD([*net.parameters(), temperature], lr=0.1)
    x = torch.randn(32, 8)
    out = net(x) * scale
    loss = (out * (temperature if temperature_grad else temperature.detach())).pow(2).mean()
    loss.backward()
    names = {id(p): n for n, p in net.named_parameters()} | {id(temperature): "temperature"}
    return opt, names


def saved(tmp_path: Path, name: str, **kw) -> Path:
    opt, names = model_with_grads(**kw)
    save_gradients(opt, names, tmp_path / name)
    return tmp_path / name


def test_identical_gradients_pass_and_the_worst_is_named(tmp_path: Path) -> None:
    check = compare_gradients(saved(tmp_path, "a"), saved(tmp_path, "b"), tolerance=1e-6)
    assert check.ok and check.compared == 5 and check.worst.rel_error == 0.0
    assert "5 tensors compared" in check.words()


def test_a_changed_gradient_is_named_with_its_error(tmp_path: Path) -> None:
    check = compare_gradients(saved(tmp_path, "a"), saved(tmp_path, "b", scale=1.01), tolerance=1e-3)
    assert not check.ok and check.worst is not None
    # the loss scales by 1.01**2, so does every gradient: each tensor's error is 2.01% of its own norm (at
    # most that where the typical size is larger), the temperature's included; which tensor's rounding is
    # largest is noise, so the worst named is the first of those at 2.01% in the optimizer's order
    assert check.worst.rel_error == pytest.approx(0.0201, rel=1e-3)
    assert all(d.rel_error <= 0.0201 * (1 + 1e-3) for d in check.failing)
    (temperature,) = [d for d in check.failing if d.name == "temperature"]
    assert temperature.rel_error == pytest.approx(0.0201, rel=1e-3)
    names = ["0.weight", "0.bias", "2.weight", "2.bias", "temperature"]  # the optimizer's order
    at_most = [d.name for d in check.failing if d.rel_error >= check.worst.rel_error * (1 - 1e-4)]
    assert check.worst.name == min(at_most, key=names.index) and check.failing[0] is check.worst
    assert len(check.failing) == 5
    parity = Parity(ok=True, precision="fp32", rtol=1e-4, atol=1e-5, message="losses match")
    add_gradients(parity, check)
    assert not parity.ok and parity.first_bad_step == 1
    assert parity.message.startswith(f"gradients differ at step 1: {check.worst.name} [")


def test_the_worst_of_equal_errors_is_the_first_in_the_optimizers_order(tmp_path: Path) -> None:
    # every gradient doubled exactly and of one size: every error is exactly 1 (one a hair above, as
    # rounding would make it), so the worst named is the first parameter, however the errors round
    opt_a, names_a = model_with_grads()
    opt_b, names_b = model_with_grads()
    params_a, params_b = opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]
    for pa, pb in zip(params_a, params_b, strict=True):
        pa.grad = torch.ones_like(pa.grad)
        pb.grad = torch.full_like(pb.grad, 2.0)
    params_b[-1].grad = torch.full_like(params_b[-1].grad, 2.0000002)
    save_gradients(opt_a, names_a, tmp_path / "a")
    save_gradients(opt_b, names_b, tmp_path / "b")
    check = compare_gradients(tmp_path / "a", tmp_path / "b", tolerance=1e-3)
    assert [d.rel_error for d in check.failing[2:]] == [1.0, 1.0, 1.0] and check.failing[1].rel_error > 1.0
    assert check.worst.name == "0.weight" and check.failing[0] is check.worst
    assert check.failing[1].name == "temperature"  # then the rest, largest first


def test_a_gradient_that_stops_flowing_is_a_mismatch(tmp_path: Path) -> None:
    # a learnable temperature turned into a constant: the rewrite has no gradient for it
    check = compare_gradients(saved(tmp_path, "a"), saved(tmp_path, "b", temperature_grad=False), 0.25)
    (missing,) = [d for d in check.failing if d.name == "temperature"]
    assert math.isinf(missing.rel_error) and missing.note == "no gradient in the rewrite"
    assert check.to_json()["failing"][0]["rel_error"] is None  # strict JSON: no infinity


def test_a_tiny_gradient_is_judged_against_the_typical_size(tmp_path: Path) -> None:
    opt_a, names = model_with_grads()
    opt_b, _ = model_with_grads()
    bias_a, bias_b = opt_a.param_groups[0]["params"][3], opt_b.param_groups[0]["params"][3]
    bias_a.grad = torch.full_like(bias_a.grad, 1e-9)
    bias_b.grad = torch.full_like(bias_b.grad, 2e-9)  # 100% off, but a billionth of the rest
    save_gradients(opt_a, names, tmp_path / "a")
    save_gradients(opt_b, names, tmp_path / "b")
    assert compare_gradients(tmp_path / "a", tmp_path / "b", tolerance=1e-6).ok


def test_tolerances_grow_with_precision_and_work() -> None:
    small = derive("fp32", reduction=64, depth=3)
    assert (small.loss_rtol, small.loss_atol) == LOSS_TOLERANCE["fp32"]  # never tighter than the defaults
    big = derive("fp32", reduction=1 << 20, depth=400)
    assert big.grad_rtol > small.grad_rtol and big.epsilon == pytest.approx(2**-24 * 1024 * 20)
    bf16 = derive("bf16", reduction=8192, depth=100)
    assert bf16.epsilon == pytest.approx(2**-8 * 10) and bf16.grad_rtol == pytest.approx(4 * 2**-8 * 10)
    assert GRAD_RTOL_MIN <= small.grad_rtol and derive("bf16", 1, 10_000).grad_rtol == GRAD_RTOL_MAX
    given = derive("bf16", 8192, 100, rtol=bf16.loss_rtol / 2)
    assert given.given and given.grad_rtol == pytest.approx(bf16.grad_rtol / 2)
    assert "longest reduction 8192, 100 modules with parameters" in bf16.words()


def dispatch(counts, imported=True, record=True):
    return {"imported": imported, "record": record, "counts": counts}


def test_a_rewrite_whose_kernel_ran_is_quiet() -> None:
    calls, warnings = fused_calls(["fused_softmax"], dispatch({"masked_softmax": {"kernel": 24}}), "timing")
    assert warnings == [] and calls[0].rules == ["fused_softmax"] and calls[0].kernel_calls == 24


def test_a_rewrite_that_ran_the_chain_or_nothing_is_warned() -> None:
    rules = ["fused_softmax", "fused_dropout_add", "sdpa_attention"]
    record = dispatch({"masked_softmax": {"chain": 12}, "padded_linear": {"kernel": 2}})
    calls, warnings = fused_calls(rules, record, "timing")
    assert [c.op for c in calls] == ["masked_softmax", "padded_linear"]
    assert calls[1].rules == []  # called, but by no applied rule's rewrite
    assert len(warnings) == 2  # sdpa_attention calls no kernel of ours
    assert "bias_dropout_add (fused_dropout_add's fix) in its timing run" in warnings[0]
    assert "masked_softmax (fused_softmax's fix) never ran its kernel" in warnings[1]
    assert "12 call(s) ran the plain PyTorch chain" in warnings[1]


def test_no_record_or_no_import_is_said() -> None:
    assert "never imported" in fused_calls(["fused_softmax"], dispatch({}, imported=False), "timing")[1][0]
    assert "no dispatch record" in fused_calls(["gemm_align"], dispatch({}, record=False), "parity")[1][0]
    assert fused_calls(["sdpa_attention"], dispatch({}, imported=False), "timing") == ([], [])
