"""The kernels fuse_region's fixes call: dropout, quick_gelu, disentangled_bias, and compile_region.

Each kernel against its PyTorch reference, forward and backward (through Triton's interpreter on the CPU,
compiled on a GPU); dropout against the Philox oracle bit for bit and in distribution.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_testutil import rel_err
from opadvisor.kernels import (
    _rng,
    activations,
    compile_region,
    disentangled_bias,
    disentangled_bias_backend,
    dropout,
    dropout_backend,
    quick_gelu,
    quick_gelu_backend,
    reference_disentangled_bias,
    reference_dropout,
    reference_quick_gelu,
    region_state,
    relpos,
)
from opadvisor.kernels import seeded_dropout as dropout_module

FIXED_SEED = (77, 5, 3)


@pytest.fixture
def every_size(monkeypatch):
    """Run the kernels at every size (small CUDA tensors otherwise take the PyTorch chain)."""
    for module in (dropout_module, activations, relpos):
        monkeypatch.setattr(module, "SMALL_NUMEL", 0)


def _grad(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    (dx,) = torch.autograd.grad(y, [x], dy)
    return y.detach(), dx


# ---- dropout --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize("shape", [(3, 7), (4, 1025), (2, 3, 64), (5, 1)])
@pytest.mark.parametrize("p", [0.1, 0.5, 1.0])
def test_dropout_is_the_philox_mask_forward_and_backward(shape, p, device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device)
    dy = torch.randn(shape, device=device)
    assert dropout_backend(x) in ("interpreter", "triton")
    keep = dropout_module.philox_keep_like(x, FIXED_SEED, p)
    y, dx = _grad(lambda t: dropout(t, p), x, dy)
    torch.testing.assert_close(y, reference_dropout(x, p, keep=keep), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, reference_dropout(dy, p, keep=keep), rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dropout_low_precision_rounds_once(dtype, device, monkeypatch):
    monkeypatch.setattr(_rng, "draw_seed", lambda device: FIXED_SEED)
    x = torch.randn(6, 300, device=device).to(dtype)
    keep = dropout_module.philox_keep_like(x, FIXED_SEED, 0.1)
    assert torch.equal(dropout(x, 0.1), reference_dropout(x, 0.1, keep=keep))


@pytest.mark.usefixtures("every_size")
def test_dropout_keeps_one_minus_p_and_scales(device):
    torch.manual_seed(3)
    x = torch.ones(64, 1000, device=device)
    y = dropout(x, 0.3)
    kept = (y != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.01, kept  # 64000 draws: 4 standard deviations is 0.007
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    assert not torch.equal(y, dropout(x, 0.3)), "two calls drew the same mask"


def test_dropout_identity_and_errors():
    x = torch.randn(4, 5)
    assert dropout(x, 0.0) is x and dropout(x, 0.5, training=False) is x
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout(x, 1.5)
    assert reference_dropout(x, 0.2, training=False) is x


def test_dropout_falls_back_to_f_dropout_where_no_kernel_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(4, 8)
    assert dropout_backend(x) == "reference"
    torch.manual_seed(5)
    y = dropout(x, 0.25)
    torch.manual_seed(5)
    assert torch.equal(y, torch.nn.functional.dropout(x, 0.25, True))


# ---- quick_gelu -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize("shape", [(7,), (3, 2049), (2, 3, 33)])
def test_quick_gelu_forward_and_backward_fp32(shape, device):
    torch.manual_seed(1)
    x = torch.randn(shape, device=device) * 4
    dy = torch.randn(shape, device=device)
    assert quick_gelu_backend(x) in ("interpreter", "triton")
    y, dx = _grad(quick_gelu, x, dy)
    y_ref, dx_ref = _grad(reference_quick_gelu, x.double(), dy.double())
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("every_size")
def test_quick_gelu_bf16_no_worse_than_the_chain(device):
    torch.manual_seed(2)
    x = (torch.randn(4, 512, device=device) * 3).bfloat16()
    dy = torch.randn(4, 512, device=device).bfloat16()
    y, dx = _grad(quick_gelu, x, dy)
    y_chain, dx_chain = _grad(reference_quick_gelu, x, dy)
    y_ref, dx_ref = _grad(reference_quick_gelu, x.double(), dy.double())
    assert y.dtype == dx.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= max(rel_err(y_chain, y_ref), 2e-3)
    assert rel_err(dx, dx_ref) <= max(rel_err(dx_chain, dx_ref), 4e-3)


# ---- disentangled_bias ----------------------------------------------------------------------------------


def _relpos_inputs(n, s, span, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    c2p = torch.randn(n, s, 2 * span, generator=g).to(device, dtype)
    p2c = torch.randn(n, s, 2 * span, generator=g).to(device, dtype)
    rel = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    ci = torch.clamp(rel + span, 0, 2 * span - 1).unsqueeze(0).to(device)
    pi = torch.clamp(-rel + span, 0, 2 * span - 1).unsqueeze(0).to(device)
    return c2p, p2c, ci, pi


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize(("n", "s", "span"), [(3, 9, 2), (2, 37, 8), (1, 5, 16)])
@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
@pytest.mark.parametrize(
    ("backward", "index"), [("atomic", "deberta"), ("runs", "deberta"), ("runs", "shuffled")]
)
def test_disentangled_bias_forward_and_backward(n, s, span, terms, backward, index, device, monkeypatch):
    """Values and gradients of the reference, with either backward; "shuffled" indices (no row monotone)
    take the runs kernels' atomic path."""
    if device.type == "cpu":
        monkeypatch.setattr(
            relpos, "BLOCK", 16
        )  # several key tiles per row at a size the interpreter runs fast
    monkeypatch.setattr(relpos, "BACKWARD", backward)
    c2p, p2c, ci, pi = _relpos_inputs(n, s, span, device)
    if index == "shuffled":
        g = torch.Generator().manual_seed(1)
        ci = torch.randint(0, 2 * span, tuple(ci.shape), generator=g).to(device)
        pi = torch.randint(0, 2 * span, tuple(pi.shape), generator=g).to(device)
    if terms == "c2p":
        p2c = pi = None
    if terms == "p2c":
        c2p = ci = None
    assert disentangled_bias_backend(c2p if c2p is not None else p2c) in ("interpreter", "triton")
    scale = math.sqrt(64 * 3)
    tables = [t for t in (c2p, p2c) if t is not None]
    dy = torch.randn(n, s, s, device=device)

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in tables]
        it = iter(leaves)
        a = next(it) if c2p is not None else None
        b = next(it) if p2c is not None else None
        out = fn(a, b, ci, pi, scale)
        return out.detach(), torch.autograd.grad(out, leaves, dy.to(cast))

    out, grads = run(disentangled_bias, torch.float32)
    out_ref, grads_ref = run(reference_disentangled_bias, torch.float64)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("every_size")
@pytest.mark.parametrize("backward", relpos.BACKWARDS)
def test_disentangled_bias_bf16_gradients_accumulate_in_float32(backward, device, monkeypatch):
    monkeypatch.setattr(relpos, "BACKWARD", backward)
    c2p, p2c, ci, pi = _relpos_inputs(2, 64, 4, device, torch.bfloat16)  # many keys share a bucket
    dy = torch.randn(2, 64, 64, device=device).bfloat16()
    a, b = c2p.clone().requires_grad_(), p2c.clone().requires_grad_()
    out = disentangled_bias(a, b, ci, pi, 2.0)
    da, db = torch.autograd.grad(out, [a, b], dy)
    a64, b64 = c2p.double().requires_grad_(), p2c.double().requires_grad_()
    ref = reference_disentangled_bias(a64, b64, ci, pi, 2.0)
    da_ref, db_ref = torch.autograd.grad(ref, [a64, b64], dy.double())
    assert out.dtype == da.dtype == torch.bfloat16
    assert rel_err(out, ref) < 4e-3
    assert rel_err(da, da_ref) < 4e-3 and rel_err(db, db_ref) < 4e-3


def test_disentangled_bias_rejects_mismatched_inputs():
    c2p, p2c, ci, pi = _relpos_inputs(2, 6, 2, "cpu")
    with pytest.raises(ValueError, match="needs c2p, p2c or both"):
        disentangled_bias(None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="c2p_index must have shape"):
        disentangled_bias(c2p, p2c, ci[:, :5], pi, 1.0)
    with pytest.raises(ValueError, match="each score table needs its index"):
        disentangled_bias(c2p, p2c, None, pi, 1.0)


@pytest.mark.parametrize("terms", ["both", "c2p", "p2c"])
def test_disentangled_bias_custom_ops_pass_opcheck(terms):
    """Schema, fake implementation and autograd registration of the ops torch.compile traces."""
    c2p, p2c, ci, pi = _relpos_inputs(2, 7, 3, "cpu")
    ci, pi = ci[0], pi[0]
    if terms == "c2p":
        p2c = pi = None
    if terms == "p2c":
        c2p = ci = None
    tables = [t.requires_grad_() if t is not None else None for t in (c2p, p2c)]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(relpos.disentangled_bias_fwd_op, (*tables, ci, pi, 2.0), test_utils=checks)


@pytest.mark.parametrize("path", relpos.COMPILE_PATHS)
@pytest.mark.parametrize("terms", ["both", "p2c"])
def test_disentangled_bias_compiled_paths_match_eager(path, terms, monkeypatch):
    """Each COMPILE_PATH, compiled whole (aot_eager), gives the eager kernels' values and gradients, and
    traces its kernels where it says so."""
    monkeypatch.setattr(relpos, "COMPILE_PATH", path)
    monkeypatch.setattr(relpos, "BLOCK", 16)
    c2p, p2c, ci, pi = _relpos_inputs(2, 9, 3, "cpu")
    if terms == "p2c":
        c2p = ci = None
    tables = [t for t in (c2p, p2c) if t is not None]
    dy = torch.randn(2, 9, 9)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in tables]
        a, b = (leaves[0], leaves[1]) if c2p is not None else (None, leaves[0])
        out = fn(a, b, ci, pi, 3.0)
        return out.detach(), torch.autograd.grad(out, leaves, dy)

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got, got_grads = run(torch.compile(disentangled_bias, backend=backend, fullgraph=True))
    want, want_grads = run(disentangled_bias)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    code = "".join(m.code for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    assert ("disentangled_bias_fwd" in code) == (path == "custom_op"), code
    assert ("gather" in code) == (path != "custom_op"), code
    assert ("disentangled_bias_bwd" in code) == (path == "backward_op"), code  # custom_op's: at its node


# ---- the dispatch record ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("every_size")
def test_dispatch_record_and_fallback_warnings(monkeypatch):
    from opadvisor.kernels import _dispatch, dispatch_counts, reset_dispatch_counts

    monkeypatch.setattr(_dispatch, "_WARNED", set())  # warnings are once per process: start afresh
    reset_dispatch_counts()
    x = torch.randn(4, 8)
    c2p, p2c, ci, pi = _relpos_inputs(2, 5, 2, "cpu")
    dropout(x, 0.1), quick_gelu(x), disentangled_bias(c2p, p2c, ci, pi, 2.0)
    with pytest.warns(RuntimeWarning, match=r"opadvisor.kernels.quick_gelu: .*float64"):
        quick_gelu(x.double())
    with pytest.warns(RuntimeWarning, match=r"opadvisor.kernels.dropout: a non-contiguous input is copied"):
        dropout(x.t(), 0.1)
    assert dispatch_counts() == {
        "dropout": {"kernel": 2},
        "quick_gelu": {"kernel": 1, "reference": 1},
        "disentangled_bias": {"kernel": 1},
    }


# ---- compile_region -------------------------------------------------------------------------------------


def test_compile_region_falls_back_with_one_line_when_compilation_fails(monkeypatch, capsys):
    import torch._dynamo

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise torch._dynamo.exc.InternalTorchDynamoError("dynamo could not trace this")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)

    @compile_region
    def gelu_by_hand(x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))

    x = torch.randn(8)
    assert region_state(gelu_by_hand) == ("pending", None)
    torch.testing.assert_close(gelu_by_hand(x), torch.nn.functional.gelu(x))
    torch.testing.assert_close(gelu_by_hand(x), torch.nn.functional.gelu(x))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gelu_by_hand runs uncompiled" in err[0] and "InternalTorchDynamoError" in err[0]
    status, error = region_state(gelu_by_hand)
    assert status == "failed" and "could not trace" in error


def test_compile_region_lets_the_callers_own_errors_through(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # "compiled" = the function itself

    @compile_region
    def needs_2d(x):
        if x.dim() != 2:
            raise ValueError("want a matrix")
        return x * 2

    with pytest.raises(ValueError, match="want a matrix"):
        needs_2d(torch.ones(3))
    assert region_state(needs_2d)[0] == "pending"
    assert torch.equal(needs_2d(torch.ones(2, 2)), torch.full((2, 2), 2.0))
    assert region_state(needs_2d)[0] == "compiled"


def test_compile_region_on_a_method_keeps_the_original_and_passes_options(monkeypatch):
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs, fn=fn)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)

    class Scale(torch.nn.Module):
        @compile_region(dynamic=False)
        def forward(self, x):
            return x * 3

    m = Scale()
    assert torch.equal(m(torch.ones(2)), torch.full((2,), 3.0))
    assert seen["dynamic"] is False and seen["fn"] is Scale.forward.__wrapped__
    with pytest.raises(TypeError, match="not decorated"):
        region_state(lambda x: x)


@pytest.mark.slow
def test_compile_region_compiles_for_real_on_cpu():
    @compile_region
    def silu_by_hand(x):
        return x * torch.sigmoid(x)

    x = torch.randn(16, requires_grad=True)
    y = silu_by_hand(x)
    y.sum().backward()
    assert region_state(silu_by_hand) == ("compiled", None)
    ref = x.detach().requires_grad_()
    torch.nn.functional.silu(ref).sum().backward()
    torch.testing.assert_close(y, torch.nn.functional.silu(ref))
    torch.testing.assert_close(x.grad, ref.grad)


# ---- compile_region under a CUDA graph capture ------------------------------------------------------------


def _counting_backend(compiled: list):
    def backend(gm, example_inputs):
        compiled.append(len(example_inputs))
        return gm.forward

    return backend


def test_under_capture_a_region_runs_what_is_compiled_and_records_the_rest(monkeypatch):
    """No compile may happen inside a capture: a call that compiled code fits runs it; one that needs new
    code (another argument layout, as library code passes under capture) runs the original and is recorded;
    compile_missed compiles it afterwards, forward and backward, so the next capture meets compiled code."""
    from opadvisor.kernels import region

    compiled: list[int] = []

    @compile_region(backend=_counting_backend(compiled))
    def masked_scale(x, mask=None):
        return x * 2.0 if mask is None else x * 2.0 + mask

    x = torch.randn(4, 8, requires_grad=True)
    masked_scale(x)  # compiled outside the capture: mask None
    assert compiled == [1]
    region.take_capture_misses()

    monkeypatch.setattr(region, "cuda_graph_capturing", lambda: True)
    mask = torch.ones(4, 8)
    torch.testing.assert_close(masked_scale(x, mask), x * 2.0 + mask)  # the original, not compiled
    torch.testing.assert_close(masked_scale(x), x * 2.0)  # the compiled code fits: it runs
    masked_scale(x, mask)  # the same layout again: one record
    assert compiled == [1]
    misses = region.take_capture_misses()
    assert len(misses) == 1 and misses[0].grad_enabled

    monkeypatch.setattr(region, "cuda_graph_capturing", lambda: False)
    assert region.compile_missed(misses) == [masked_scale.__wrapped__.__qualname__]
    assert compiled == [1, 2] and region.take_capture_misses() == []

    monkeypatch.setattr(region, "cuda_graph_capturing", lambda: True)
    torch.testing.assert_close(masked_scale(x, mask), x * 2.0 + mask)
    assert compiled == [1, 2] and region.take_capture_misses() == []
    assert region_state(masked_scale) == ("compiled", None)


def test_a_call_recorded_under_capture_keeps_its_layout_and_state(monkeypatch):
    """The record: tensors by shape, stride, dtype and requires_grad (one tensor passed twice stays one),
    other arguments as passed, and the grad / autocast state, restored when compiling it."""
    from opadvisor.kernels import region

    seen = []

    @compile_region(backend=_counting_backend([]))
    def add(a, b, *, flag):
        seen.append((a is b, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), flag))
        return a + b

    monkeypatch.setattr(region, "cuda_graph_capturing", lambda: True)
    x = torch.randn(3, 5).t()  # not contiguous
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        add(x, x, flag="on")
    (miss,) = region.take_capture_misses()
    spec = miss.args[0]
    assert miss.args[1] is spec and miss.kwargs == {"flag": "on"}
    assert (spec.shape, spec.stride, spec.dtype) == ((5, 3), (1, 5), torch.float32)
    assert not miss.grad_enabled

    monkeypatch.setattr(region, "cuda_graph_capturing", lambda: False)
    seen.clear()
    region.compile_missed([miss])
    assert seen[0] == (True, False, True, "on")  # traced by dynamo with the capture's state and aliasing
    (a, b), _ = miss.rebuild()
    assert a is b and a.stride() == (1, 5) and not a.any()
