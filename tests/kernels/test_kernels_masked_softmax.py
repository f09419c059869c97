"""masked_softmax against its PyTorch reference: forward and backward, every dtype, odd row lengths, masks.

On the CPU these run the Triton kernels through the interpreter (conftest sets TRITON_INTERPRET=1); the
`gpu` variants run them compiled. Low-precision results must be within 2x the error of the eager chain
run in the same precision (both measured against the float64 reference on the same inputs).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kernel_testutil import grad_of, rel_err
from opadvisor.kernels import _rng, masked_softmax, masked_softmax_backend, reference_masked_softmax, softmax

LENGTHS = [1, 7, 31, 127, 128, 255, 1023, 1024, 1025, 4097, 8193, 16384, 65536]
LOW = [torch.bfloat16, torch.float16]
FIXED_SEED = (12345, 678, 9)

pytestmark = pytest.mark.usefixtures("kernels_everywhere")


def _rows_for(n: int) -> tuple[int, int]:
    return (2, 3) if n <= 128 else (1, 3) if n <= 1025 else (1, 1)


def _ref64(x, mask, dy, **kw):
    """Reference forward and gradient in float64 on the same (rounded) inputs."""
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    y, (dx,) = grad_of(lambda t: reference_masked_softmax(t, m, **kw), x.double(), dy.double())
    return y, dx


def _eager_chain(
    x, mask, *, scale=None, fill_value=float("-inf"), zero_masked=False, keep=None, dropout_p=0.0
):
    """What a user's script does, in x's precision."""
    s = x * scale if scale is not None else x
    if mask is not None:
        s = s.masked_fill(mask, fill_value) if mask.dtype == torch.bool else s + mask.to(x.dtype)
    y = torch.softmax(s, -1)
    if zero_masked:
        y = y.masked_fill(mask, 0.0)
    if keep is not None:
        y = y * keep.to(y.dtype) * (1.0 / (1.0 - dropout_p))
    return y


def _padding_mask(shape, device, frac=0.3):
    """[B, 1, 1, S] bool padding mask with at least one unmasked position per row."""
    b, s = shape[0], shape[-1]
    m = torch.rand(b, 1, 1, s, device=device) < frac
    m[..., 0] = False
    return m


def _check_low_precision(x, mask, dy, **kw):
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    y_ref, dx_ref = _ref64(x, mask, dy, **kw)
    chain_kw = {k: v for k, v in kw.items() if k in ("scale", "fill_value", "zero_masked")}
    y_e, (dx_e,) = grad_of(lambda t: _eager_chain(t, mask, **chain_kw), x, dy)
    assert rel_err(y, y_ref) <= 2 * rel_err(y_e, y_ref) + 1e-6
    assert rel_err(dx, dx_ref) <= 2 * rel_err(dx_e, dx_ref) + 1e-6


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
def test_row_lengths_with_padding_mask(n, dtype, device):
    torch.manual_seed(n)
    b, h = _rows_for(n)
    x = torch.randn(b, h, 1, n, device=device).to(dtype) * 3
    mask = _padding_mask(x.shape, device)
    dy = torch.randn_like(x)
    kw = dict(scale=0.7, zero_masked=True)
    if dtype == torch.float32:
        y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
        y_ref, dx_ref = _ref64(x, mask, dy, **kw)
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)
    else:
        _check_low_precision(x, mask, dy, **kw)


def test_float64_runs_the_reference(device):
    x = torch.randn(2, 5, dtype=torch.float64, device=device)
    assert masked_softmax_backend(x) == "reference"
    torch.testing.assert_close(masked_softmax(x), torch.softmax(x, -1))


@pytest.mark.parametrize("dtype", [torch.float32, *LOW], ids=str)
@pytest.mark.parametrize(
    "mask_shape,kind",
    [
        ((2, 1, 1, 40), "bool"),  # padding mask
        ((1, 1, 40, 40), "bool"),  # causal, shared by batch and heads
        ((2, 3, 40, 40), "bool"),  # full
        ((2, 1, 1, 40), "add"),  # HF extended attention mask
        ((1, 3, 40, 40), "add"),  # per-head bias (T5/ALiBi style)
        ((2, 3, 40, 40), "add"),
        ((40,), "bool"),  # fewer dims than x
    ],
)
def test_masks(mask_shape, kind, dtype, device):
    torch.manual_seed(0)
    x = (torch.randn(2, 3, 40, 40, device=device) * 2).to(dtype)
    if kind == "bool":
        if mask_shape == (1, 1, 40, 40):
            mask = torch.ones(40, 40, dtype=torch.bool, device=device).triu(1)[None, None]
        else:
            mask = torch.rand(mask_shape, device=device) < 0.4
            mask[..., 0] = False
        fill = torch.finfo(dtype).min
    else:
        mask = torch.where(
            torch.rand(mask_shape, device=device) < 0.3, -10000.0, torch.randn(mask_shape, device=device)
        )
        fill = float("-inf")
    dy = torch.randn_like(x)
    kw = dict(scale=1 / 8, fill_value=fill)
    if dtype == torch.float32:
        y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
        y_ref, dx_ref = _ref64(x, mask, dy, **kw)
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)
    else:
        _check_low_precision(x, mask, dy, **kw)


@pytest.mark.parametrize("kind", ["bool", "add"])
def test_padding_mask_row_shared_by_a_program(kind, device):
    """[B,1,1,S] masks whose rows a whole program shares are loaded once per program (MASK_SHARED):
    the same results as the reference, forward and backward, for both mask kinds."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, 8, 96, device=device) * 2
    keep = torch.rand(2, 1, 1, 96, device=device) < 0.7
    keep[..., 0] = True
    mask = ~keep if kind == "bool" else torch.where(keep, 0.0, -10000.0)
    (_, _, meta), _, _ = softmax._plan_for(x, mask, 3)
    assert meta["MASK_SHARED"] and meta["ROWS"] > 1
    kw = dict(scale=0.5, zero_masked=kind == "bool")
    dy = torch.randn_like(x)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    y_ref, dx_ref = _ref64(x, mask, dy, **kw)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)


FORWARD_CONFIGS = [
    softmax.ForwardConfig(rows=4, warps=2),
    softmax.ForwardConfig(rows=2, warps=2, share_mask=False),
    softmax.ForwardConfig(rows=4, warps=4, programs_per_sm=2, stages=2),
    softmax.ForwardConfig(rows=8, warps=4, programs_per_sm=1, stages=3),
]


def test_one_warp_forwards_are_refused():
    # rows=2, warps=1 gave other bits than the default launch on the H200 (cause not found)
    with pytest.raises(ValueError, match="one-warp"):
        softmax.ForwardConfig(rows=2, warps=1)


# Each config on rows in one piece (40 columns) with and without dropout, and on rows held in two pieces
# (512) with dropout; the split rows without dropout (the same code less the mask) on the first config only:
# the three others cost 3 interpreter seconds and run nothing else.
FORWARD_CASES = [
    (config, n_cols, dropout_p)
    for config in FORWARD_CONFIGS
    for n_cols, dropout_p in ((40, 0.0), (40, 0.3), (512, 0.0), (512, 0.3))
    if (n_cols, dropout_p) != (512, 0.0) or config is FORWARD_CONFIGS[0]
]


@functools.cache
def _default_forward(n_cols: int, dropout_p: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(x, mask, dy, y, dx) of the default launch: every config is compared with the same bits, so they are
    computed once a worker (each a forward and a backward under the interpreter). Not to be changed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
        torch.manual_seed(2)
        x = torch.randn(2, 3, 15, n_cols, device=device).to(torch.bfloat16) * 3
        mask = _padding_mask(x.shape, device)
        dy = torch.randn_like(x)
        kw = dict(scale=0.5, zero_masked=True, dropout_p=dropout_p)
        y0, (dx0,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    return x, mask, dy, y0, dx0


@pytest.mark.parametrize("config, n_cols, dropout_p", FORWARD_CASES, ids=str)
def test_forward_configs_compute_the_same_bits(config, dropout_p, n_cols, device, monkeypatch):
    """Every forward configuration the sweep may choose (benchmarks/softmax_sweep.py: rows, warps, the shared
    mask row, a persistent grid) gives the default's bits, dropout mask included, and the backward (which
    keeps `_config`'s launch) its gradient; 23 tiles, so a persistent grid loops. 512 columns: rows held in
    two pieces (ROW_SPLIT)."""
    x, mask, dy, y0, dx0 = _default_forward(n_cols, dropout_p, device)
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    kw = dict(scale=0.5, zero_masked=True, dropout_p=dropout_p)
    monkeypatch.setattr(softmax, "FORWARD_CONFIGS", {softmax.triton_next_power_of_2(n_cols): config})
    launch, _, _, _ = softmax._launch_for(False, x, mask, 3, True, dropout_p, FIXED_SEED, x.dtype)
    assert (launch.meta["ROWS"], launch.meta["num_warps"]) == (config.rows, config.warps)
    assert launch.meta["PERSISTENT"] == (config.programs_per_sm > 0)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    assert torch.equal(y, y0)
    assert torch.equal(dx, dx0)


@pytest.mark.parametrize(
    "n_cols,dtype,split",
    [(512, torch.bfloat16, 2), (1024, torch.float16, 4), (512, torch.float32, 4), (256, torch.bfloat16, 1),
     (500, torch.bfloat16, 1), (2048, torch.bfloat16, 1), (32768, torch.bfloat16, 1)],
)  # fmt: skip
def test_row_split_follows_the_row_length(n_cols, dtype, split):
    """Rows of a power of two columns wider than one warp's 16-byte vectors are held in pieces where
    `_config` has a warp per row or more (512 bf16 columns: 8 rows on 4 warps); 500 columns, 2048 (2 rows on 8
    warps) and looped rows are not."""
    assert softmax._row_split(n_cols, dtype, softmax.MAX_BLOCK, softmax.LOOP_BLOCK) == split


def test_row_split_off_launches_one_piece(monkeypatch):
    x = torch.randn(2, 2, 4, 512, dtype=torch.bfloat16)
    got = softmax._launch_for(False, x, None, 3, False, 0.0, FIXED_SEED, x.dtype)[0].meta["SPLIT"]
    monkeypatch.setattr(softmax, "ROW_SPLIT", False)
    off = softmax._launch_for(False, x, None, 3, False, 0.0, FIXED_SEED, x.dtype)[0].meta["SPLIT"]
    assert (got, off) == (2, 1)


@pytest.mark.parametrize("kind", ["bool", "add"])
@pytest.mark.parametrize("dtype,n_cols", [(torch.float32, 256), (torch.bfloat16, 512)], ids=str)
@pytest.mark.parametrize("rows", [7, 8], ids=["partial-tile", "whole-tiles"])
def test_row_split_matches_reference(kind, dtype, n_cols, rows, device, monkeypatch):
    """The split forward (2 pieces a row; a shared padding mask row or an additive one; scale and dropout;
    the last tile partial, or every tile whole: EVEN): the reference's values and gradients, the dropout mask
    the reference draws bit for bit."""
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(6)
    x = (torch.randn(2, 2, rows, n_cols, device=device) * 3).to(dtype)
    pad = _padding_mask(x.shape, device)
    mask = pad if kind == "bool" else torch.where(pad, -10000.0, 0.0).to(device)
    meta = softmax._launch_for(False, x, mask, 3, False, 0.25, FIXED_SEED, dtype)[0].meta
    assert meta["SPLIT"] == 2 and meta["EVEN"] == (rows == 8)
    dy = torch.randn_like(x)
    keep = softmax.philox_keep_like(x, -1, FIXED_SEED, 0.25)
    kw = dict(scale=0.5, zero_masked=kind == "bool", dropout_p=0.25)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    assert torch.equal(y != 0, keep & ~pad.expand_as(keep))
    y_ref, dx_ref = _ref64(x, mask, dy, keep=keep, **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)
    else:  # bf16 storage: within a few roundings
        assert rel_err(y, y_ref) < 8e-3 and rel_err(dx, dx_ref) < 8e-3


def test_additive_mask_gets_its_gradient(device):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 6, 9, device=device)
    bias = torch.randn(1, 3, 6, 9, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    y, (dx, dbias) = grad_of(lambda t, b: masked_softmax(t, b, scale=0.5), x, dy, bias)
    y_r, (dx_r, dbias_r) = grad_of(lambda t, b: reference_masked_softmax(t, b, scale=0.5), x, dy, bias)
    torch.testing.assert_close(y, y_r)
    torch.testing.assert_close(dx, dx_r)
    torch.testing.assert_close(dbias, dbias_r)


@pytest.mark.parametrize("fill", [float("-inf"), -1e9, "finfo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fully_masked_rows(fill, dtype, device):
    """Finite fill: what the original chain gives (uniform); -inf fill: zeros where the chain gives NaN."""
    x = torch.randn(3, 2, 10, device=device).to(dtype)
    mask = torch.zeros(3, 1, 10, dtype=torch.bool, device=device)
    mask[1] = True  # every row of batch 1 fully masked
    mask[2, :, 3:] = True
    fill_value = torch.finfo(dtype).min if fill == "finfo" else fill
    dy = torch.randn_like(x)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, fill_value=fill_value), x, dy)
    if fill_value == float("-inf"):
        assert torch.equal(y[1], torch.zeros_like(y[1]))
    else:
        atol = 1e-6 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(
            y[1].float(), torch.full_like(y[1], 0.1, dtype=torch.float32), rtol=0, atol=atol
        )
        # the original chain, in float32 (where -1e9 is representable)
        orig = torch.softmax(x.float().masked_fill(mask, float(fill_value)), -1)
        torch.testing.assert_close(y.float(), orig, rtol=2e-3, atol=2e-3)
    assert torch.equal(dx[1], torch.zeros_like(dx[1]))  # masked_fill passes no gradient
    assert not torch.isnan(dx).any()
    y_ref, dx_ref = _ref64(x, mask, dy, fill_value=fill_value)
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=2e-3, atol=2e-3)


def test_fully_masked_by_additive_inf(device):
    x = torch.randn(2, 8, device=device)
    mask = torch.zeros(2, 8, device=device)
    mask[0] = float("-inf")
    y = masked_softmax(x, mask)
    assert torch.equal(y[0], torch.zeros(8, device=device))
    torch.testing.assert_close(y[1], torch.softmax(x[1], -1))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf"), 1e30])
def test_masked_positions_do_not_leak(poison, device):
    torch.manual_seed(2)
    x = torch.randn(4, 33, device=device)
    mask = torch.rand(4, 33, device=device) < 0.5
    mask[:, 0] = False
    dy = torch.randn_like(x)
    y0, (dx0,) = grad_of(lambda t: masked_softmax(t, mask, zero_masked=True), x, dy)
    y1, (dx1,) = grad_of(lambda t: masked_softmax(t, mask, zero_masked=True), x.masked_fill(mask, poison), dy)
    assert torch.equal(y0, y1)
    assert torch.equal(dx0, dx1)


@pytest.mark.parametrize("case", ["transposed", "sliced", "dim1", "expanded_dy", "5d"])
def test_non_contiguous(case, device):
    torch.manual_seed(3)
    if case == "transposed":
        x = torch.randn(2, 3, 24, 20, device=device).transpose(-1, -2)  # rows strided
        dim, mask = -1, torch.rand(2, 1, 1, 24, device=device) < 0.3
    elif case == "sliced":
        x = torch.randn(2, 3, 20, 50, device=device)[:, :, ::2, 5:45]
        dim, mask = -1, torch.rand(2, 1, 1, 40, device=device) < 0.3
    elif case == "dim1":
        x = torch.randn(2, 37, 5, device=device)
        dim, mask = 1, torch.rand(2, 37, 1, device=device) < 0.3
    elif case == "expanded_dy":
        x = torch.randn(3, 19, device=device)
        dim, mask = -1, None
    else:
        x = torch.randn(2, 2, 3, 2, 11, device=device).transpose(1, 3)
        dim, mask = -1, torch.rand(2, 1, 3, 1, 11, device=device) < 0.3
    if mask is not None:
        mask.select(dim, 0).fill_(False)
    dy = (
        torch.randn(()).expand(x.shape).to(device)
        if case == "expanded_dy"
        else torch.randn_like(x).transpose(0, 1).contiguous().transpose(0, 1)
    )
    kw = dict(dim=dim, scale=0.9)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    y_ref, dx_ref = _ref64(x, mask, dy, **kw)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4)])
def test_empty(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = masked_softmax(x, dim=-1)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("n,block", [(17, 16), (100, 32), (1025, 256)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_looped_kernel(n, block, dropout_p, device, monkeypatch):
    """Rows longer than MAX_BLOCK take the two-pass kernels; lowered here so short rows take them too."""
    monkeypatch.setattr(softmax, "MAX_BLOCK", block)
    monkeypatch.setattr(softmax, "LOOP_BLOCK", block)
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    assert softmax._config(n, block, block)[2], "looped variant not selected"
    torch.manual_seed(n)
    x = torch.randn(2, 1, n, device=device) * 4
    mask = torch.rand(2, 1, n, device=device) < 0.3
    mask[..., 0] = False
    mask[1, 0, :] = True  # a fully masked row goes through the online max too
    dy = torch.randn_like(x)
    keep = softmax.philox_keep_like(x, -1, FIXED_SEED, dropout_p)
    kw = dict(scale=0.5, zero_masked=True, dropout_p=dropout_p)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    y_ref, dx_ref = _ref64(x, mask, dy, keep=keep, **kw)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_dropout_matches_reference_bit_for_bit_mask(interleave, device, monkeypatch):
    monkeypatch.setattr(softmax, "RNG_INTERLEAVE", interleave)
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(4)
    x = torch.randn(3, 4, 129, device=device)
    mask = torch.rand(3, 1, 129, device=device) < 0.2
    mask[..., 0] = False
    dy = torch.randn_like(x)
    keep = softmax.philox_keep_like(x, -1, FIXED_SEED, 0.25)
    kw = dict(scale=0.3, dropout_p=0.25)
    y, (dx,) = grad_of(lambda t: masked_softmax(t, mask, **kw), x, dy)
    y_ref, dx_ref = _ref64(x, mask, dy, keep=keep, **kw)
    assert torch.equal(y != 0, keep & ~mask.expand_as(keep))
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_and_exact_scaling(p, device):
    torch.manual_seed(5)
    x = torch.randn(16, 1024, device=device)
    y = masked_softmax(x, dropout_p=p)
    y_nodrop = masked_softmax(x, dropout_p=0.0)
    kept = (y != 0).double().mean().item()
    n = y.numel()
    assert abs(kept - (1 - p)) <= 4 * math.sqrt(p * (1 - p) / n)
    # every kept value is exactly the undropped probability times 1 / (1 - p), computed in float32
    k = y != 0
    assert torch.equal(y[k], (y_nodrop.float() * (1.0 / (1.0 - p)))[k])


def test_dropout_follows_manual_seed(device):
    x = torch.randn(4, 300, device=device)
    torch.manual_seed(7)
    a = masked_softmax(x, dropout_p=0.5)
    b = masked_softmax(x, dropout_p=0.5)
    torch.manual_seed(7)
    c = masked_softmax(x, dropout_p=0.5)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)
    assert torch.equal(masked_softmax(x, dropout_p=0.5, training=False), masked_softmax(x))


def test_dropout_one_drops_everything(device):
    x = torch.randn(2, 40, device=device, requires_grad=True)
    y = masked_softmax(x, dropout_p=1.0)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_argument_errors(device):
    x = torch.randn(2, 4, device=device)
    with pytest.raises(ValueError, match="zero_masked"):
        masked_softmax(x, torch.zeros(2, 4, device=device), zero_masked=True)
    with pytest.raises(ValueError, match="broadcast"):
        masked_softmax(x, torch.zeros(3, 4, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="bool or floating"):
        masked_softmax(x, torch.zeros(2, 4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="dropout_p"):
        masked_softmax(x, dropout_p=1.5)
