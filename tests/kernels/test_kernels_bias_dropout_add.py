"""bias_dropout_add against its reference: forward, dx / dbias / dresidual, dtypes, dropout statistics."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kernel_testutil import rel_err
from opadvisor.kernels import (
    _rng,
    bias_dropout_add,
    bias_dropout_add_backend,
    dropout_add,
    reference_bias_dropout_add,
)

FIXED_SEED = (2024, 11, 5)

pytestmark = pytest.mark.usefixtures("kernels_everywhere")


def _run(fn, x, bias, residual, dy):
    """(y, [dx, dbias?, dresidual]) of fn(x, bias, residual)."""
    x = x.detach().clone().requires_grad_()
    r = residual.detach().clone().requires_grad_()
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    y = fn(x, b, r)
    grads = torch.autograd.grad(y, [t for t in (x, b, r) if t is not None], dy)
    return y.detach(), grads


def _eager_chain(x, bias, residual, keep, p):
    v = x + bias if bias is not None else x
    if keep is not None:
        v = v * keep.to(v.dtype) * (1.0 / (1.0 - p))
    return residual + v


SHAPES = [(3, 7), (4, 1025), (2, 3, 64), (1, 4097), (5, 1)]
# Every shape with and without a bias at p=0.1; p=0 (no mask) and p=0.5 (another threshold and scale, the
# same code) on the narrow shapes only: the wide ones' bias gradient costs seconds a case under the
# interpreter (hundreds of `bias_grad_kernel` programs) and runs no other code at another p.
WIDE = {(4, 1025), (1, 4097)}
FP32_CASES = [
    (shape, with_bias, p)
    for shape in SHAPES
    for with_bias in (True, False)
    for p in (0.0, 0.1, 0.5)
    if p == 0.1 or shape not in WIDE
]
FP32_IDS = ["x".join(map(str, s)) + ("-bias" if b else "") + f"-{p}" for s, b, p in FP32_CASES]


@pytest.mark.parametrize("shape, with_bias, p", FP32_CASES, ids=FP32_IDS)
def test_matches_reference_fp32(shape, with_bias, p, device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    residual = torch.randn(shape, device=device)
    bias = torch.randn(shape[-1], device=device) if with_bias else None
    dy = torch.randn(shape, device=device)
    keep = dropout_add.philox_keep_like(x, FIXED_SEED, p)
    y, grads = _run(lambda a, b, r: bias_dropout_add(a, b, r, p), x, bias, residual, dy)
    y_ref, grads_ref = _run(
        lambda a, b, r: reference_bias_dropout_add(
            a.double(), None if b is None else b.double(), r.double(), p, keep=keep
        ),
        x,
        bias,
        residual,
        dy.double(),
    )
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g.double(), g_ref.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["philox", "byte", "bits"])
def test_low_precision_within_twice_eager_error(dtype, mode, device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    monkeypatch.setattr(dropout_add, "MASK_MODE", mode)
    torch.manual_seed(1)
    p = 0.1
    x = torch.randn(8, 300, device=device).to(dtype)
    residual = torch.randn(8, 300, device=device).to(dtype)
    bias = torch.randn(300, device=device).to(dtype)
    dy = torch.randn(8, 300, device=device).to(dtype)
    keep = dropout_add.philox_keep_like(x, FIXED_SEED, p)
    y, grads = _run(lambda a, b, r: bias_dropout_add(a, b, r, p), x, bias, residual, dy)
    y_e, grads_e = _run(lambda a, b, r: _eager_chain(a, b, r, keep, p), x, bias, residual, dy)
    y_ref, grads_ref = _run(
        lambda a, b, r: reference_bias_dropout_add(a.double(), b.double(), r.double(), p, keep=keep),
        x,
        bias,
        residual,
        dy.double(),
    )
    assert rel_err(y, y_ref) <= 2 * rel_err(y_e, y_ref) + 1e-7
    for g, g_e, g_ref in zip(grads, grads_e, grads_ref, strict=True):
        assert rel_err(g, g_ref) <= 2 * rel_err(g_e, g_ref) + 1e-7


@pytest.mark.parametrize("mode", ["byte", "bits"])
@pytest.mark.parametrize("shape", [(5, 1), (3, 100), (2, 3, 67), (2, 513)])
def test_stored_masks_give_the_recomputed_masks_bits(mode, shape, device, monkeypatch):
    """A mask stored by the forward (one byte or one bit an element, rows whose width is no multiple of 8
    included) gives the backward the same bits as recomputing it from the seed: y, dx, dbias, dresidual
    equal to MASK_MODE "philox"'s. [2, 513]: three column blocks, the last one column wide (as [4, 1025]
    did, with half its programs under the interpreter)."""
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(3)
    x, residual, dy = (torch.randn(shape, device=device).bfloat16() for _ in range(3))
    bias = torch.randn(shape[-1], device=device).bfloat16()
    run = lambda: _run(lambda a, b, r: bias_dropout_add(a, b, r, 0.3), x, bias, residual, dy)  # noqa: E731
    y_ref, grads_ref = run()
    monkeypatch.setattr(dropout_add, "MASK_MODE", mode)
    y, grads = run()
    assert torch.equal(y, y_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert torch.equal(g, g_ref)


BACKWARD_CONFIGS = {
    "rows4": dropout_add.BackwardConfig(rows=4, block=64, programs_per_sm=3),
    "prefetch": dropout_add.BackwardConfig(
        rows=2, block=32, programs_per_sm=5, prefetch=True, sum_rows=8, sum_cols=16
    ),
    "stages-interleave": dropout_add.BackwardConfig(
        rows=1, block=128, programs_per_sm=2, stages=2, interleave=True
    ),
    "narrow-min-rows": dropout_add.BackwardConfig(
        rows=8, block=16, programs_per_sm=7, prefetch=True, min_rows=16
    ),
    "split-rng": dropout_add.BackwardConfig(
        rows=2, block=64, programs_per_sm=3, prefetch=True, split_rng=True
    ),
    "split-rng-no-prefetch": dropout_add.BackwardConfig(
        rows=4, block=32, programs_per_sm=9, split_rng=True, min_rows=8
    ),
}
# A stored bit mask is loaded, never drawn, by the backward: `split_rng` (how the Philox bits are drawn) is
# not read there, so "bits" runs the configs that differ in tiles, grid, prefetch and stages only.
BACKWARD_CASES = [(name, "philox") for name in BACKWARD_CONFIGS] + [
    (name, "bits") for name in BACKWARD_CONFIGS if not BACKWARD_CONFIGS[name].split_rng
]


@functools.cache
def _default_backward(mode: str, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(x, bias, residual, dy, dx) of the default backward launch: every config is compared with the same
    bits, so they are computed once a worker (a forward and a backward under the interpreter). Not to be
    changed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
        mp.setattr(dropout_add, "MASK_MODE", mode)
        torch.manual_seed(4)
        x, residual, dy = (torch.randn(shape, device=device) for _ in range(3))
        bias = torch.randn(shape[-1], device=device).bfloat16()
        _, (dx, _, _) = _run(lambda a, b, r: bias_dropout_add(a, b, r, 0.2), x, bias, residual, dy)
    return x, bias, residual, dy, dx


@pytest.mark.parametrize(
    "name, mode", BACKWARD_CASES, ids=[f"{mode}-{name}" for name, mode in BACKWARD_CASES]
)
@pytest.mark.parametrize("shape", [(37, 100), (3, 5, 40)], ids=["2d", "3d"])
def test_backward_configs_same_dx_and_dbias(name, mode, shape, device, monkeypatch):
    """Every backward launch configuration (tiles, grid, pipelining, prefetch, Philox layout and draw, sum
    tile) gives dx bit for bit as the default's and dbias as the float64 sum rounded once, the same bits
    twice; on a 2-D layout (rows * stride, FLAT) and a 3-D one (`row_offsets`)."""
    x, bias, residual, dy, dx_ref = _default_backward(mode, shape, device)
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    monkeypatch.setattr(dropout_add, "MASK_MODE", mode)
    run = lambda: _run(lambda a, b, r: bias_dropout_add(a, b, r, 0.2), x, bias, residual, dy)  # noqa: E731
    monkeypatch.setattr(dropout_add, "BACKWARD_CONFIGS", ((0, BACKWARD_CONFIGS[name]),))
    _, (dx, dbias, _) = run()
    _, (_, again, _) = run()
    keep = dropout_add.philox_keep_like(x, FIXED_SEED, 0.2)
    expected = torch.where(keep, dy.double() / 0.8, 0.0).reshape(-1, shape[-1]).sum(0)
    assert torch.equal(dx, dx_ref)
    torch.testing.assert_close(dbias, expected.bfloat16(), rtol=8e-3, atol=8e-3)
    assert torch.equal(again, dbias)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_exact_scaling(p, device):
    torch.manual_seed(2)
    x = torch.randn(32, 512, device=device) + 5.0  # never exactly 0 after the bias
    residual = torch.zeros_like(x)
    bias = torch.randn(512, device=device)
    y = bias_dropout_add(x, bias, residual, p)
    kept = (y != 0).double().mean().item()
    assert abs(kept - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / y.numel())
    k = y != 0
    assert torch.equal(y[k], ((x + bias) * (1.0 / (1.0 - p)))[k])


def test_follows_manual_seed_and_training_flag(device):
    x, r = torch.randn(4, 256, device=device), torch.randn(4, 256, device=device)
    torch.manual_seed(3)
    a = bias_dropout_add(x, None, r, 0.5)
    b = bias_dropout_add(x, None, r, 0.5)
    torch.manual_seed(3)
    c = bias_dropout_add(x, None, r, 0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)
    torch.testing.assert_close(bias_dropout_add(x, None, r, 0.5, training=False), x + r)


def test_p_one_keeps_only_the_residual(device):
    x, r = torch.randn(2, 64, device=device, requires_grad=True), torch.randn(2, 64, device=device)
    y = bias_dropout_add(x, None, r, 1.0)
    assert torch.equal(y, r)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_non_contiguous_and_mixed_dtypes(device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(4)
    x = torch.randn(40, 6, device=device).t()  # [6, 40], column-major
    residual = torch.randn(6, 80, device=device)[:, ::2]  # strided columns
    bias = torch.randn(40, device=device)
    dy = torch.randn(6, 40, device=device)
    keep = dropout_add.philox_keep_like(x, FIXED_SEED, 0.2)
    y, grads = _run(lambda a, b, r: bias_dropout_add(a.bfloat16(), b, r, 0.2), x, bias, residual, dy)
    assert y.dtype == torch.float32  # promoted like the original `residual + dropout(x + bias)`
    y_ref, grads_ref = _run(
        lambda a, b, r: reference_bias_dropout_add(a.bfloat16(), b, r, 0.2, keep=keep), x, bias, residual, dy
    )
    torch.testing.assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref)


def test_empty_and_errors(device):
    x = torch.randn(0, 8, device=device, requires_grad=True)
    assert bias_dropout_add_backend(x) == "reference"
    y = bias_dropout_add(x, torch.zeros(8, device=device), torch.zeros(0, 8, device=device), 0.1)
    assert y.shape == (0, 8)
    with pytest.raises(ValueError, match="residual"):
        bias_dropout_add(torch.randn(2, 8), None, torch.randn(2, 4), 0.1)
    with pytest.raises(ValueError, match="bias"):
        bias_dropout_add(torch.randn(2, 8), torch.randn(4), torch.randn(2, 8), 0.1)


def test_bias_gradient_over_many_partial_sums(device, monkeypatch):
    """dbias is summed in two launches: per backward program over its rows, then `bias_grad_kernel` over
    those partial sums (tiles of 32 of them, 64 columns a program) in the bias's dtype. Many programs and
    columns that fill neither tile: the same dbias as the reference's float64 sum, rounded once; twice the
    same bits (the sums run in a fixed order)."""
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    # the plan cache keys on the config: fresh plans. 80 programs a multiprocessor (the interpreter counts
    # one), 2 column blocks of 64: 40 programs a column block, 2 rows each
    config = dropout_add.BackwardConfig(rows=1, block=64, programs_per_sm=80, sum_rows=32, sum_cols=64)
    monkeypatch.setattr(dropout_add, "BACKWARD_CONFIGS", ((0, config),))
    if device.type == "cuda":
        monkeypatch.setattr(dropout_add._backend, "multiprocessors", lambda device: 1)
    torch.manual_seed(5)
    x = torch.randn(80, 100, device=device)
    residual = torch.randn(80, 100, device=device)
    bias = torch.randn(100, device=device).bfloat16()
    dy = torch.randn(80, 100, device=device)
    _, (_, dbias, _) = _run(lambda a, b, r: bias_dropout_add(a, b, r, 0.3), x, bias, residual, dy)
    keep = dropout_add.philox_keep_like(x, FIXED_SEED, 0.3)
    expected = torch.where(keep, dy.double() / 0.7, 0.0).sum(0)
    assert dbias.dtype == torch.bfloat16
    torch.testing.assert_close(dbias, expected.bfloat16(), rtol=8e-3, atol=8e-3)
    _, (_, again, _) = _run(lambda a, b, r: bias_dropout_add(a, b, r, 0.3), x, bias, residual, dy)
    assert torch.equal(again, dbias)


def test_backward_config_follows_the_rows_width(monkeypatch):
    """BACKWARD_CONFIGS: the first pair whose fewest columns the rows reach."""
    wide, narrow = (
        dropout_add.BackwardConfig(rows=2, block=1024),
        dropout_add.BackwardConfig(rows=8, block=256),
    )
    monkeypatch.setattr(dropout_add, "BACKWARD_CONFIGS", ((4096, wide), (0, narrow)))
    assert dropout_add.backward_config(4096) is wide
    assert dropout_add.backward_config(8192) is wide
    assert dropout_add.backward_config(4095) is narrow
    assert dropout_add.backward_config(1) is narrow


@pytest.mark.parametrize("first_row", [0, 2**31 - 6])
def test_split_keep_mask_is_keep_mask(first_row, device):
    """`keep_rows_cols` (Philox's first rounds per row and per column) draws `philox_keep_mask`'s bits, also
    for rows near 2**31 (the largest an int32 row index reaches) and columns past a multiple of four."""
    from split_keep_kernel import draw_keep

    seed, p = (2**31 - 1, 12345, 7), 0.3
    out = torch.empty(4, 16, dtype=torch.int8, device=device)
    draw_keep[(1,)](out, first_row, _rng.threshold(p), *seed, ROWS=4, BLOCK=16)
    expected = _rng.philox_keep_mask(seed, 4, 16, p, device, first_row=first_row)
    assert torch.equal(out != 0, expected)
