"""cross_entropy against F.cross_entropy and its float32/float64 reference: forward, gradient, dtypes
(autocast included), ignore_index, reductions, strided logits read in place, dispatch, torch.compile."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_testutil import record_launches, rel_err
from opadvisor.kernels import (
    _backend,
    _layout,
    cross_entropy,
    cross_entropy_backend,
    reference_cross_entropy,
)

# `opadvisor.kernels.cross_entropy` is the function (the package exports it); the module, for its
# constants and launchers, comes from the import system.
ce = importlib.import_module("opadvisor.kernels.cross_entropy")

CLASSES = [1, 7, 127, 128, 1000, 4097, 30522]
REDUCTIONS = ["mean", "sum", "none"]


@pytest.fixture(autouse=True)
def kernels_for_every_class_count(monkeypatch):
    """On the GPU, small class counts go to F.cross_entropy otherwise (the interpreter ignores the rule)."""
    monkeypatch.setattr(ce, "SMALL_CLASSES", 0)


def _logits(n, c, dtype, device, pad=0, seed=0):
    """[n, c] logits of `dtype`; with `pad`, the column slice [:, :c] of an [n, c + pad] tensor."""
    g = torch.Generator().manual_seed(seed)
    full = (3 * torch.randn(n, c + pad, generator=g)).to(device=device, dtype=dtype)
    return full[:, :c] if pad else full


def _targets(n, c, device, ignore_index=-100, ignored=(1,), seed=1):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, c, (n,), generator=g)
    for i in ignored:
        if i < n:
            t[i] = ignore_index
    return t.to(device)


def _loss_and_grad(fn, x, dloss=None):
    """(loss detached, d loss / d x) of fn(x) with upstream gradient dloss (None: ones)."""
    x = x.detach().requires_grad_()
    loss = fn(x)
    (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss) if dloss is None else dloss)
    return loss.detach(), dx


def _upstream(reduction, n, device, dtype=torch.float32):
    """A non-trivial upstream gradient: random per row for "none", 0.7 for a scalar loss."""
    if reduction == "none":
        return torch.randn(n, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    return torch.tensor(0.7, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# Values and gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("c", CLASSES)
def test_fp32_matches_reference(c, reduction, device):
    n = 4 if c > 4096 else 7
    x = _logits(n, c, torch.float32, device)
    t = _targets(n, c, device)
    assert cross_entropy_backend(x, t, reduction=reduction) in ("triton", "interpreter")
    dloss = _upstream(reduction, n, device)
    loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction=reduction), x, dloss)
    ref, dref = _loss_and_grad(
        lambda v: reference_cross_entropy(v, t, reduction=reduction), x.double(), dloss
    )
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6)
    assert torch.equal(dx[1], torch.zeros_like(dx[1]))  # the ignored row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("c", CLASSES)
def test_low_precision_within_twice_eager_error(c, reduction, dtype, device):
    """Loss and gradient in the input's dtype, no further from the float64 result than twice eager
    F.cross_entropy's (which computes in the 16-bit dtype) is."""
    n = 4 if c > 4096 else 7
    x = _logits(n, c, dtype, device, seed=3)
    t = _targets(n, c, device)
    dloss = _upstream(reduction, n, device, dtype)
    loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction=reduction), x, dloss)
    eager, d_eager = _loss_and_grad(lambda v: F.cross_entropy(v, t, reduction=reduction), x, dloss)
    ref, dref = _loss_and_grad(
        lambda v: reference_cross_entropy(v, t, reduction=reduction), x.double(), dloss.double()
    )
    assert loss.dtype == dtype and dx.dtype == dtype
    assert rel_err(loss, ref) <= 2 * rel_err(eager, ref) + 1e-7
    assert rel_err(dx, dref) <= 2 * rel_err(d_eager, dref) + 1e-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_autocast_gives_float32_loss_like_f_cross_entropy(dtype, device):
    """Under autocast F.cross_entropy returns a float32 loss; the kernel reads the 16-bit values and
    computes in float32: a float32 loss at float32 accuracy, the gradient in the input's dtype. (On CUDA,
    torch 2.11's autocast runs log_softmax on the 16-bit logits and casts its result: eager's loss is a
    16-bit rounding away from the float32 one, so both are compared with the float32 reference.)"""
    n, c = 6, 1000
    x = _logits(n, c, dtype, device, pad=6, seed=4)
    t = _targets(n, c, device)
    dloss = torch.tensor(1.3, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        assert cross_entropy_backend(x, t) in ("triton", "interpreter")
        loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t), x, dloss)
        eager, d_eager = _loss_and_grad(lambda v: F.cross_entropy(v, t), x, dloss)
        ref, dref = _loss_and_grad(lambda v: reference_cross_entropy(v, t), x, dloss)
    assert loss.dtype == eager.dtype == ref.dtype == torch.float32
    assert dx.dtype == d_eager.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, ref, rtol=1e-2, atol=1e-2)
    assert rel_err(dx, dref) <= 2 * rel_err(d_eager, dref) + 1e-6


def test_logits_with_minus_inf(device):
    """-inf logits (masked classes) away from the target: finite loss and zero gradient there."""
    x = _logits(3, 300, torch.float32, device, seed=5)
    x[:, 100:200] = float("-inf")
    t = torch.tensor([5, 250, 0], device=device)
    loss, dx = _loss_and_grad(
        lambda v: cross_entropy(v, t, reduction="none"), x, torch.ones(3, device=device)
    )
    ref, dref = _loss_and_grad(
        lambda v: F.cross_entropy(v, t, reduction="none"), x, torch.ones(3, device=device)
    )
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(dx, dref)
    assert torch.isfinite(loss).all() and torch.equal(dx[:, 100:200], torch.zeros_like(dx[:, 100:200]))


# ---------------------------------------------------------------------------------------------------
# ignore_index and reductions
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignore_index_rows_give_zero_loss_and_gradient(ignore_index, device):
    n, c = 8, 50
    x = _logits(n, c, torch.float32, device, seed=6)
    t = _targets(n, c, device, ignore_index=ignore_index, ignored=(0, 2, 5))
    kept = t != ignore_index  # ignore_index=3 may also be drawn as a class: those rows are ignored too
    for reduction in REDUCTIONS:
        dloss = _upstream(reduction, n, device)
        fn = lambda v, r=reduction: cross_entropy(v, t, ignore_index=ignore_index, reduction=r)  # noqa: E731
        loss, dx = _loss_and_grad(fn, x, dloss)
        ref, dref = _loss_and_grad(
            lambda v, r=reduction: F.cross_entropy(v, t, ignore_index=ignore_index, reduction=r), x, dloss
        )
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(dx, dref)
        assert torch.equal(dx[~kept], torch.zeros_like(dx[~kept]))
        if reduction == "none":
            assert torch.equal(loss[~kept], torch.zeros_like(loss[~kept]))


def test_all_rows_ignored(device):
    x = _logits(4, 30, torch.float32, device)
    t = torch.full((4,), -100, device=device)
    mean, d_mean = _loss_and_grad(lambda v: cross_entropy(v, t), x, torch.tensor(1.0, device=device))
    assert torch.isnan(mean)  # 0 / 0, as F.cross_entropy
    assert torch.equal(d_mean, torch.zeros_like(x))
    assert cross_entropy(x, t, reduction="sum").item() == 0.0
    assert torch.equal(cross_entropy(x, t, reduction="none"), torch.zeros(4, device=device))


def test_none_reduction_with_strided_upstream_gradient(device):
    """loss.sum().backward() hands the kernel an expanded (stride 0) gradient; a slice, a strided one."""
    n, c = 6, 200
    x = _logits(n, c, torch.float32, device, seed=7).requires_grad_()
    t = _targets(n, c, device)
    cross_entropy(x, t, reduction="none").sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    F.cross_entropy(x_ref, t, reduction="none").sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    dloss = torch.randn(2 * n, device=device)[::2]
    _, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
    _, dref = _loss_and_grad(lambda v: F.cross_entropy(v, t, reduction="none"), x, dloss)
    torch.testing.assert_close(dx, dref)


def test_int32_and_strided_targets_match_int64(device):
    x = _logits(5, 70, torch.float32, device)
    t = _targets(5, 70, device)
    expected = cross_entropy(x, t, reduction="none")
    assert torch.equal(cross_entropy(x, t.int(), reduction="none"), expected)
    strided = torch.stack([t, t], 1)[:, 0]  # stride 2
    assert torch.equal(cross_entropy(x, strided, reduction="none"), expected)


# ---------------------------------------------------------------------------------------------------
# Layouts: row-strided logits read in place, never modified
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_column_slice_of_padded_logits_is_read_in_place(dtype, device, monkeypatch):
    """The LM-head case: logits[:, :C] of a [N, C + 6] GEMM output. Both kernels get the slice itself
    (same storage, row stride C + 6), the result matches the contiguous input's, the input is unchanged,
    and the gradient has the logits' row stride."""
    n, c = 5, 1000
    x = _logits(n, c, dtype, device, pad=6, seed=8)
    assert x.stride() == (c + 6, 1)
    before = x.clone()
    t = _targets(n, c, device)
    dloss = torch.randn(n, device=device).to(dtype)
    ref, dref = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x.contiguous(), dloss)
    seen = record_launches(monkeypatch, keep=lambda launch, args: args[0])
    loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
    assert len(seen) == 2
    for logits in seen:
        assert logits.data_ptr() == x.data_ptr() and logits.stride() == (c + 6, 1)
    assert torch.equal(x, before)
    assert torch.equal(loss, ref) and torch.equal(dx, dref)
    assert dx.stride() == (c + 6, 1)  # laid out like the logits (aligned rows), its own storage


def test_column_strided_logits_are_copied_first(device):
    n, c = 4, 90
    x = _logits(c, n, torch.float32, device).t()  # [n, c], column stride n
    t = _targets(n, c, device)
    loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t), x, torch.tensor(1.0, device=device))
    ref, dref = _loss_and_grad(lambda v: F.cross_entropy(v, t), x, torch.tensor(1.0, device=device))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(dx, dref)


def _clear_plans():
    ce._plan.cache_clear()
    ce._launch_plan.cache_clear()


def test_int32_and_int64_indexing_agree(device, monkeypatch):
    x = _logits(5, 300, torch.bfloat16, device, pad=3)
    t = _targets(5, 300, device)
    dloss = torch.randn(5, device=device).bfloat16()
    _clear_plans()
    narrow = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
    monkeypatch.setattr(_layout, "INT32_SAFE", 1)  # every launch takes the int64 path
    _clear_plans()
    try:
        assert ce._plan((5, 300), (303, 1), 1, ce.MAX_BLOCK, False)[2]["I64"]
        metas = record_launches(monkeypatch)
        wide = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
        assert len(metas) == 2 and all(meta["I64"] for meta in metas)
    finally:
        _clear_plans()
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# Tilings: the per-class and the grouped forward, backward blocks
# ---------------------------------------------------------------------------------------------------

PER_CLASS = ce.Tiles(64, 1, 0, 64, 1)
TILINGS = [
    ce.Tiles(64, 1, 8, 64, 1),
    ce.Tiles(128, 2, 16, 32, 1),
    ce.Tiles(16, 1, 4, 128, 2),
]


def _with_tiles(monkeypatch, tiles):
    monkeypatch.setattr(ce, "_tiles", lambda n_cols, max_block, aligned: tiles)
    _clear_plans()


@functools.cache
def _per_class(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(x, targets, dloss, loss, dx) of the per-class tiling, which every tiling is compared with: computed
    once a worker (a forward and a backward under the interpreter). Not to be changed."""
    n, c = 6, 1000
    x = _logits(n, c, dtype, device, pad=8, seed=11)
    x[2, 200:336] = float("-inf")  # groups of 8 and 16 whole, the target (124) outside
    t = _targets(n, c, device)
    t[3] = c  # out of range: NaN row
    dloss = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(device)
    with pytest.MonkeyPatch.context() as mp:
        _with_tiles(mp, PER_CLASS)
        try:
            base, dbase = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
        finally:
            _clear_plans()
    return x, t, dloss, base, dbase


@pytest.mark.parametrize("tiles", TILINGS, ids=lambda t: f"g{t.group}-{t.fwd_block}-{t.bwd_block}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tilings_match_reference_and_each_other(tiles, dtype, device, monkeypatch):
    """Several loop iterations, a masked last block (1000 = 15 * 64 + 40), whole groups of -inf, an ignored
    row, an out-of-range target: each tiling matches the float64 reference and the per-class tiling."""
    x, t, dloss, base, dbase = _per_class(dtype, device)
    _with_tiles(monkeypatch, tiles)
    try:
        loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
        ok = [0, 1, 2, 4, 5]
        mean = cross_entropy(x[ok], t[ok])
    finally:
        _clear_plans()
    ref, dref = _loss_and_grad(
        lambda v: reference_cross_entropy(v, t[ok], reduction="none"), x[ok].double(), dloss[ok].double()
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # a bf16 loss is rounded to bf16
    torch.testing.assert_close(loss[ok].double(), ref.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(loss, base, equal_nan=True)
    assert torch.isnan(loss[3]) and torch.isnan(dx[3]).all() and torch.equal(dx[1], torch.zeros_like(dx[1]))
    torch.testing.assert_close(
        dx[ok].double(), dref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6
    )
    torch.testing.assert_close(dx, dbase, equal_nan=True)
    assert torch.equal(dx[2, 200:336], torch.zeros_like(dx[2, 200:336]))
    assert torch.isfinite(mean)


def test_tiling_follows_row_alignment(device, monkeypatch):
    """Rows whose stride is a multiple of 16 bytes (a padded head's column slice) take the grouped forward;
    rows that are not (contiguous 1001 classes) keep the per-class forward."""
    t = _targets(3, 1001, device)
    metas = record_launches(monkeypatch)
    _clear_plans()
    for pad in (7, 0):
        x = _logits(3, 1001, torch.bfloat16, device, pad=pad)
        _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, torch.ones(3, device=device))
    assert [m.get("GROUP") for m in metas] == [8, None, 0, None]  # forward, backward per call


# ---------------------------------------------------------------------------------------------------
# Targets out of range, empty inputs, dispatch
# ---------------------------------------------------------------------------------------------------


def test_out_of_range_target_gives_nan_on_the_kernel_path(device):
    x = _logits(4, 20, torch.float32, device)
    t = torch.tensor([3, 20, -1, 7], device=device)
    loss, dx = _loss_and_grad(
        lambda v: cross_entropy(v, t, reduction="none"), x, torch.ones(4, device=device)
    )
    assert torch.isnan(loss[1:3]).all() and torch.isfinite(loss[[0, 3]]).all()
    assert torch.isnan(dx[1:3]).all() and torch.isfinite(dx[[0, 3]]).all()
    assert torch.isnan(cross_entropy(x, t))
    if device.type == "cpu":
        with pytest.raises(IndexError):
            reference_cross_entropy(x, t)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch_runs_f_cross_entropy(reduction, device):
    x = torch.randn(0, 10, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    assert cross_entropy_backend(x, t, reduction=reduction) == "reference"
    torch.testing.assert_close(
        cross_entropy(x, t, reduction=reduction), F.cross_entropy(x, t, reduction=reduction), equal_nan=True
    )


def _fallback_cases(device):
    """(name, input, target, kwargs) for calls the kernels do not take."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 11, generator=g).to(device)
    t = torch.randint(0, 11, (6,), generator=g).to(device)
    probs = torch.softmax(torch.randn(6, 11, generator=g), -1).to(device)
    x3 = torch.randn(2, 11, 3, generator=g).to(device)
    t3 = torch.randint(0, 11, (2, 3), generator=g).to(device)
    return [
        ("weight", x, t, {"weight": torch.rand(11, generator=g).to(device)}),
        ("label_smoothing", x, t, {"label_smoothing": 0.1}),
        ("size_average", x, t, {"size_average": False}),
        ("reduce", x, t, {"reduce": False}),
        ("class probabilities", x, probs, {}),
        ("3-D input", x3, t3, {}),
        ("1-D input", x[0], t[0], {}),
        ("float64", x.double(), t, {}),
    ]


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_fallbacks_are_f_cross_entropy_exactly(device):
    for name, x, t, kwargs in _fallback_cases(device):
        assert cross_entropy_backend(x, t, **kwargs) == "reference", name
        loss, dx = _loss_and_grad(lambda v, t=t, k=kwargs: cross_entropy(v, t, **k), x)
        ref, dref = _loss_and_grad(lambda v, t=t, k=kwargs: F.cross_entropy(v, t, **k), x)
        assert torch.equal(loss, ref) and torch.equal(dx, dref), name


def test_reference_path_raises_as_torch():
    x = torch.randn(3, 5)
    t = torch.tensor([0, 9, 1])
    with pytest.raises(IndexError):
        cross_entropy(x, t, weight=torch.ones(5))  # the reference path: F.cross_entropy's own error
    with pytest.raises(ValueError):
        cross_entropy(x, t, reduction="avg")


def test_dispatch_rules(monkeypatch):
    x, t = torch.randn(4, 2000), torch.randint(0, 2000, (4,))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert cross_entropy_backend(x, t) == "reference"  # CPU without the interpreter
    torch.testing.assert_close(cross_entropy(x, t), F.cross_entropy(x, t), rtol=0, atol=0)
    monkeypatch.setattr(_backend, "backend", lambda device: "triton")  # as on a GPU
    monkeypatch.setattr(ce, "SMALL_CLASSES", 1024)
    meta_t = torch.zeros(8, dtype=torch.long, device="meta")
    assert cross_entropy_backend(torch.empty(8, 1023, device="meta"), meta_t) == "eager"
    assert cross_entropy_backend(torch.empty(8, 1024, device="meta"), meta_t) == "triton"
    assert cross_entropy_backend(torch.empty(8, 30522, device="meta").bfloat16(), meta_t) == "triton"
    assert cross_entropy_backend(torch.empty(8, 30522, device="meta"), meta_t.to(torch.uint8)) == "reference"
    assert cross_entropy_backend(torch.empty(8, 30522, device="meta"), meta_t[:4]) == "reference"
    assert cross_entropy_backend(torch.empty(8, 30522, device="meta"), meta_t, reduction="avg") == "reference"


# ---------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------


def _loss_fn(logits, target):
    """An LM-head loss as a training script writes it (a padded GEMM output sliced to the vocabulary)."""
    return (
        cross_entropy(logits[:, :-3] * 0.5, target)
        + cross_entropy(logits[:, :-3], target, reduction="none").sum()
    )


def _compile_check(device, backend, monkeypatch, compile_path):
    monkeypatch.setattr(ce, "COMPILE_PATH", compile_path)
    logits = _logits(6, 133, torch.float32, device, seed=10).requires_grad_()
    target = _targets(6, 130, device)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_loss_fn)(logits, target)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    ops = {str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("cross_entropy_fwd" in o for o in ops) == (compile_path == "custom_op")
    compiled = torch.compile(_loss_fn, fullgraph=True, backend=backend)
    out_c, d_c = _loss_and_grad(lambda v: compiled(v, target), logits)
    out_e, d_e = _loss_and_grad(lambda v: _loss_fn(v, target), logits)
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(d_c, d_e)


@pytest.mark.parametrize("compile_path", ["native", "custom_op"])
def test_compile_cpu_fullgraph(monkeypatch, compile_path):
    _compile_check(torch.device("cpu"), "aot_eager", monkeypatch, compile_path)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_path", ["native", "custom_op"])
def test_compile_gpu_inductor(monkeypatch, compile_path):
    _compile_check(torch.device("cuda"), "inductor", monkeypatch, compile_path)


def test_compile_custom_op_under_autocast(monkeypatch):
    """The loss dtype is decided where the call is traced (autocast is not active where the graph runs)."""
    monkeypatch.setattr(ce, "COMPILE_PATH", "custom_op")
    x = _logits(4, 64, torch.bfloat16, "cpu", pad=2)
    t = _targets(4, 64, "cpu")

    def fn(v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cross_entropy(v, t)

    torch._dynamo.reset()
    out_c, d_c = _loss_and_grad(torch.compile(fn, fullgraph=True, backend="aot_eager"), x)
    out_e, d_e = _loss_and_grad(fn, x)
    assert out_c.dtype == torch.float32 and d_c.dtype == torch.bfloat16
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(d_c, d_e)


# ---------------------------------------------------------------------------------------------------
# GPU: the LM-head shape
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_lm_head_bf16_strided_forward_backward():
    n, c = 8192, 30522
    x = _logits(n, c, torch.bfloat16, "cuda", pad=6, seed=11)
    t = _targets(n, c, "cuda", ignored=range(0, n, 7))
    assert cross_entropy_backend(x, t) == "triton"
    dloss = torch.tensor(1.0, device="cuda", dtype=torch.bfloat16)
    loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t), x, dloss)
    ref, dref = _loss_and_grad(lambda v: reference_cross_entropy(v, t), x, dloss)  # float32 math
    assert loss.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and dx.stride() == (c + 6, 1)
    torch.testing.assert_close(loss, ref)  # bf16 both: equal or a rounding apart
    assert rel_err(dx, dref) < 1e-2


@pytest.mark.gpu
def test_gpu_lm_head_under_autocast():
    n, c = 8192, 30522
    x = _logits(n, c, torch.bfloat16, "cuda", pad=6, seed=12)
    t = _targets(n, c, "cuda", ignored=range(0, n, 5))
    dloss = torch.randn(n, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, dx = _loss_and_grad(lambda v: cross_entropy(v, t, reduction="none"), x, dloss)
        eager, d_eager = _loss_and_grad(lambda v: F.cross_entropy(v, t, reduction="none"), x, dloss)
        ref, dref = _loss_and_grad(lambda v: reference_cross_entropy(v, t, reduction="none"), x, dloss)
    assert loss.dtype == torch.float32 and dx.dtype == torch.bfloat16
    # float32 accuracy (eager's autocast runs log_softmax in bf16: up to half a bf16 ulp of the loss off)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert rel_err(loss, ref) <= rel_err(eager, ref)
    assert rel_err(dx, dref) <= 2 * rel_err(d_eager, dref) + 1e-6


@pytest.mark.gpu
def test_gpu_small_class_counts_take_the_eager_path(monkeypatch):
    monkeypatch.setattr(ce, "SMALL_CLASSES", 1024)
    t = torch.zeros(16, dtype=torch.long, device="cuda")
    assert cross_entropy_backend(torch.randn(16, 10, device="cuda"), t) == "eager"
    assert cross_entropy_backend(torch.randn(16, 30522, device="cuda"), t) == "triton"
