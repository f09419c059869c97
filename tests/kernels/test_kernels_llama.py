"""The Llama family's kernels: rms_norm (against transformers' LlamaRMSNorm), silu_mul (a SwiGLU MLP's gate)
and linear_cross_entropy (an LM head and its loss chunked over tokens), values and gradients, through
Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1); their custom ops under torch.compile."""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_testutil import rel_err
from opadvisor.kernels import (
    linear_cross_entropy,
    linear_cross_entropy_backend,
    reference_linear_cross_entropy,
    reference_rotary_embedding,
    reference_silu_mul,
    rms_norm,
    rms_norm_backend,
    rotary_embedding,
    rotary_embedding_backend,
    silu_mul,
    silu_mul_backend,
)

transformers = pytest.importorskip("transformers")
rn = importlib.import_module("opadvisor.kernels.rms_norm")
act = importlib.import_module("opadvisor.kernels.activations")
lce = importlib.import_module("opadvisor.kernels.linear_cross_entropy")
rope = importlib.import_module("opadvisor.kernels.rope")

# Relative error allowed per dtype of the inputs (one rounding of that dtype, and sums in another order).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _grads(fn, *inputs: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    # drawn on the CPU (the same numbers on every device), then moved to the output's device
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    out.backward(dy)
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "shape"),
    [
        (torch.float32, torch.float32, (2, 5, 48)),
        (torch.bfloat16, torch.float32, (3, 7, 40)),  # autocast's case: bf16 activations, float32 weight
        (torch.bfloat16, torch.bfloat16, (9, 64)),  # bf16 parameters
        (torch.float16, torch.float16, (2, 3, 4, 24)),  # Qwen3's per-head q_norm / k_norm
    ],
)
def test_rms_norm_is_transformers_llama_rms_norm(x_dtype, w_dtype, shape) -> None:
    torch.manual_seed(0)
    module = transformers.models.llama.modeling_llama.LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape[-1]) * 0.2 + 1)
    x = torch.randn(shape).to(x_dtype)
    w = module.weight.detach().to(w_dtype)
    assert rms_norm_backend(x, w) == "interpreter"
    got, (gx, gw) = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w)
    module = module.to(w_dtype)
    want, (wx, ww) = _grads(lambda x, w: torch.func.functional_call(module, {"weight": w}, (x,)), x, w)
    assert got.dtype == want.dtype == torch.promote_types(x_dtype, w_dtype) and got.shape == want.shape
    tol = TOL[x_dtype]
    assert rel_err(got, want) <= tol and rel_err(gx, wx) <= tol and rel_err(gw, ww) <= max(tol, TOL[w_dtype])
    assert gx.dtype == x_dtype and gw.dtype == w_dtype


def test_rms_norm_takes_the_reference_where_the_kernel_does_not(monkeypatch) -> None:
    x, w = torch.randn(4, 32, dtype=torch.float64), torch.ones(32, dtype=torch.float64)
    assert rms_norm_backend(x, w) == "reference"
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rn.reference_rms_norm(x, w, 1e-6))
    monkeypatch.setattr(rn, "MAX_COLS", 16)
    assert rms_norm_backend(torch.randn(4, 32), torch.ones(32)) == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_gate_times_up(dtype) -> None:
    g, u = torch.randn(3, 7, 40).to(dtype), torch.randn(3, 7, 40).to(dtype)
    assert silu_mul_backend(g, u) == "interpreter"
    got, (dg, du) = _grads(silu_mul, g, u)
    want, (wg, wu) = _grads(reference_silu_mul, g.double(), u.double())
    assert got.dtype == dtype and dg.dtype == du.dtype == dtype
    tol = TOL[dtype]
    assert rel_err(got, want) <= tol and rel_err(dg, wg) <= tol and rel_err(du, wu) <= tol


def _rope_case(x_dtype, cos_dtype, cos_batch: int, heads: int = 3):
    """q or k as transformers makes them: [B, H, S, D], a transposed view of [B, S, H, D]; cos and sin of
    cat(freqs, freqs) as LlamaRotaryEmbedding makes them, for 1 or B rows of positions."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, heads, 8, generator=g).to(x_dtype).transpose(1, 2)
    freqs = torch.randn(cos_batch, 5, 4, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x, emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)


@pytest.mark.parametrize(
    ("x_dtype", "cos_dtype", "cos_batch"),
    [
        (torch.float32, torch.float32, 2),
        (torch.bfloat16, torch.float32, 1),
        (torch.bfloat16, torch.bfloat16, 2),
    ],
)
def test_rotary_embedding_is_transformers_apply_rotary_pos_emb(x_dtype, cos_dtype, cos_batch) -> None:
    apply = transformers.models.llama.modeling_llama.apply_rotary_pos_emb
    x, cos, sin = _rope_case(x_dtype, cos_dtype, cos_batch)
    assert rotary_embedding_backend(x, cos, sin) == "interpreter"
    got, (gx,) = _grads(lambda x: rotary_embedding(x, cos, sin), x)
    want, (wx,) = _grads(lambda x: apply(x, x, cos, sin)[0], x)
    assert got.dtype == want.dtype == torch.promote_types(x_dtype, cos_dtype) and gx.dtype == x_dtype
    tol = TOL[x_dtype if cos_dtype == torch.float32 else torch.bfloat16]
    assert rel_err(got, want) <= tol and rel_err(gx, wx) <= tol
    torch.testing.assert_close(reference_rotary_embedding(x, cos, sin), want)


def test_rotary_embedding_takes_the_reference_for_what_the_kernel_does_not() -> None:
    x, cos, sin = _rope_case(torch.float32, torch.float32, 2)
    assert rotary_embedding_backend(x, cos[..., :7], sin[..., :7]) == "reference"  # shapes that do not match
    assert rotary_embedding_backend(x[..., :7], cos[..., :7], sin[..., :7]) == "reference"  # odd head size
    assert rotary_embedding_backend(x, cos.requires_grad_(), sin) == "reference"  # no gradient for cos, sin


def _lce_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 11, 16, generator=g)
    weight = torch.randn(37, 16, generator=g) * 0.3
    target = torch.randint(0, 37, (2, 11), generator=g)
    target[0, ::3] = -100
    return hidden, weight, target


@pytest.mark.parametrize("chunk_rows", [100, 4])  # one chunk; several (the last one short)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_is_the_heads_loss(chunk_rows, reduction, autocast, monkeypatch) -> None:
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", chunk_rows * 37 * (2 if autocast else 4))
    hidden, weight, target = _lce_case()
    assert lce.chunk_rows(22, 37, torch.bfloat16 if autocast else torch.float32) == min(22, chunk_rows)
    # (22 rows at most 4 a chunk: 6 chunks, the last one of 2)
    assert linear_cross_entropy_backend(hidden, weight) == "interpreter"

    def run(fn):
        def call(h, w):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return fn(h, w, target, reduction=reduction)

        return _grads(call, hidden, weight)

    got, (gh, gw) = run(linear_cross_entropy)
    want, (wh, ww) = run(reference_linear_cross_entropy)
    assert got.dtype == want.dtype == torch.float32
    tol = TOL[torch.bfloat16 if autocast else torch.float32]
    assert rel_err(got, want) <= 1e-5 and rel_err(gh, wh) <= tol and rel_err(gw, ww) <= tol
    assert gh.dtype == hidden.dtype and gw.dtype == weight.dtype


def test_linear_cross_entropy_multiplies_on_a_vocabulary_padded_to_eight(monkeypatch) -> None:
    """37 classes: the three products run on 40 (cuBLAS's aligned kernels for GPT-2's 50257), the loss and
    both gradients still the 37-class head's."""
    shapes = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: shapes.append((a.shape, b.shape)) or mm(a, b, **kw))
    hidden, weight, target = _lce_case()
    got, (gh, gw) = _grads(lambda h, w: linear_cross_entropy(h, w, target), hidden, weight)
    monkeypatch.setattr(torch, "mm", mm)
    want, (wh, ww) = _grads(lambda h, w: reference_linear_cross_entropy(h, w, target), hidden, weight)
    assert {40} == {d for pair in shapes for shape in pair for d in shape if d in (37, 40)}
    assert rel_err(got, want) <= 1e-5 and rel_err(gh, wh) <= 1e-5 and rel_err(gw, ww) <= 1e-5
    assert gw.shape == weight.shape and gw.is_contiguous()


@pytest.mark.parametrize("chunk_rows", [100, 4])
@pytest.mark.parametrize("autocast", [False, True])
def test_linear_cross_entropy_with_a_bias_is_the_heads_loss(chunk_rows, autocast, monkeypatch) -> None:
    """A head with a bias (BERT's MLM decoder): the loss and the gradients of hidden, weight and bias, in one
    chunk and in several."""
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", chunk_rows * 40 * (2 if autocast else 4))
    hidden, weight, target = _lce_case(2)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(3))

    def run(fn):
        def call(h, w, b):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                return fn(h, w, target, bias=b)

        return _grads(call, hidden, weight, bias)

    got, (gh, gw, gb) = run(linear_cross_entropy)
    want, (wh, ww, wb) = run(reference_linear_cross_entropy)
    tol = TOL[torch.bfloat16 if autocast else torch.float32]
    assert rel_err(got, want) <= 1e-5 and rel_err(gh, wh) <= tol and rel_err(gw, ww) <= tol
    assert rel_err(gb, wb) <= tol and gb.shape == bias.shape and gb.dtype == bias.dtype


def test_linear_cross_entropy_without_grad_computes_the_loss_only(monkeypatch) -> None:
    calls = []
    op = lce.linear_cross_entropy_op
    monkeypatch.setattr(lce, "linear_cross_entropy_op", lambda *a: calls.append(a[-3:]) or op(*a))
    hidden, weight, target = _lce_case()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(loss, reference_linear_cross_entropy(hidden, weight, target))
    assert calls == [(False, False, False)]  # no gradient computed in the forward


def test_linear_cross_entropy_reference_path_matches_too(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 5 * 37 * 4)
    hidden, weight, target = _lce_case(1)
    assert linear_cross_entropy_backend(hidden, weight) == "reference"
    got, (gh, gw) = _grads(lambda h, w: linear_cross_entropy(h, w, target), hidden, weight)
    want, (wh, ww) = _grads(lambda h, w: reference_linear_cross_entropy(h, w, target), hidden, weight)
    assert rel_err(got, want) <= 1e-5 and rel_err(gh, wh) <= 1e-5 and rel_err(gw, ww) <= 1e-5


def test_the_custom_ops_pass_opcheck() -> None:
    """Schema, fake (meta) implementation and autograd registration of each op, as torch.library checks them
    (not its AOT-dispatch check: the compile test below traces them)."""
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    x, w = torch.randn(5, 24, requires_grad=True), torch.randn(24, requires_grad=True)
    torch.library.opcheck(rn.rms_norm_fwd_op, (x, w, 1e-6), test_utils=checks)
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    torch.library.opcheck(act.silu_mul_fwd_op, (g, u), test_utils=checks)
    x, cos, sin = _rope_case(torch.float32, torch.float32, 1)
    torch.library.opcheck(rope.rope_fwd_op, (x.detach().requires_grad_(), cos, sin), test_utils=checks)
    hidden, weight, target = _lce_case()
    h, w = hidden.view(-1, 16).requires_grad_(), weight.requires_grad_()
    for bias in (None, torch.randn(37, requires_grad=True)):
        args = (h, w, bias, target.view(-1), -100, "mean", torch.float32, True, True, bias is not None)
        torch.library.opcheck(lce.linear_cross_entropy_op, args, test_utils=checks)


def test_compiled_with_fullgraph_the_ops_are_one_node_each(monkeypatch) -> None:
    """torch.compile(fullgraph=True) traces each op without a graph break: the custom ops with COMPILE_PATH
    "custom_op" (linear_cross_entropy always: inductor cannot chunk it), the PyTorch chain with "native"."""
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, weight, target = _lce_case()
    norm_w = torch.randn(16) * 0.1 + 1

    def step(h, w):
        h = rms_norm(h, norm_w, 1e-6)
        h = silu_mul(h, h * 0.5)
        return linear_cross_entropy(h, w, target)

    want, (wh, ww) = _grads(step, hidden, weight)
    for path in ("custom_op", "native"):
        monkeypatch.setattr(rn, "COMPILE_PATH", path)
        monkeypatch.setattr(act, "SILU_MUL_COMPILE_PATH", path)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        got, (gh, gw) = _grads(torch.compile(step, backend=counter, fullgraph=True), hidden, weight)
        assert counter.frame_count == 1
        ops = {str(n.target) for n in counter.graphs[0].graph.nodes if "opadvisor" in str(n.target)}
        custom = {"opadvisor.rms_norm_fwd.default", "opadvisor.silu_mul_fwd.default"}
        assert ops == (
            {"opadvisor.linear_cross_entropy.default"} | (custom if path == "custom_op" else set())
        )
        assert rel_err(got, want) <= 1e-5 and rel_err(gh, wh) <= 1e-4 and rel_err(gw, ww) <= 1e-4


# ---- on the GPU: the compiled kernels at a Llama's sizes ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_rms_norm_on_cuda_at_llama_sizes(x_dtype, w_dtype) -> None:
    x = torch.randn(4, 2048, 2048, device="cuda").to(x_dtype)
    w = (torch.randn(2048, device="cuda") * 0.1 + 1).to(w_dtype)
    assert rms_norm_backend(x, w) == "triton"
    got, (gx, gw) = _grads(lambda x, w: rms_norm(x, w, 1e-5), x, w)
    want, (wx, ww) = _grads(lambda x, w: rn.reference_rms_norm(x.double(), w.double(), 1e-5), x, w)
    tol = 2e-2 if x_dtype == torch.bfloat16 else 1e-4
    assert rel_err(got, want) <= tol and rel_err(gx, wx) <= tol and rel_err(gw, ww) <= tol


@pytest.mark.parametrize(
    ("rows", "vocab", "want"),
    [
        (8192, 50264, 4096),  # GPT-2: two equal chunks, not 5340 + 2852
        (8192, 128256, 2048),  # Llama-3: four
        (8192, 30528, 8192),  # BERT: one
        (3000, 128256, 1536),  # aligned to 64 and still under the limit
        (4100, 128256, 2050),  # aligned (2112) would pass the limit (2092): equal but unaligned
    ],
)
def test_chunks_are_equal_and_aligned_where_they_fit(rows, vocab, want, monkeypatch) -> None:
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 512 << 20)
    assert lce.chunk_rows(rows, vocab, torch.bfloat16) == want
    assert want * vocab * 2 <= lce.MAX_CHUNK_BYTES


@pytest.mark.gpu
def test_silu_mul_on_cuda_at_llama_sizes() -> None:
    g, u = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert silu_mul_backend(g, u) == "triton"
    got, (dg, du) = _grads(silu_mul, g, u)
    want, (wg, wu) = _grads(reference_silu_mul, g.float(), u.float())
    assert rel_err(got, want) <= 1e-2 and rel_err(dg, wg) <= 1e-2 and rel_err(du, wu) <= 1e-2


@pytest.mark.gpu
def test_linear_cross_entropy_on_cuda_chunked_under_autocast(monkeypatch) -> None:
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 1000 * 32000 * 2)  # 4 chunks of 768 rows
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2, 1536, 1024, device="cuda", generator=g)
    weight = torch.randn(32000, 1024, device="cuda", generator=g) * 0.02
    target = torch.randint(0, 32000, (2, 1536), device="cuda", generator=g)
    target[:, :100] = -100

    def run(fn):
        def call(h, w):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(h, w, target)

        return _grads(call, hidden, weight)

    def peak_of(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = run(fn)
        return out, torch.cuda.max_memory_allocated() - base

    (got, (gh, gw)), peak = peak_of(linear_cross_entropy)
    (want, (wh, ww)), eager_peak = peak_of(reference_linear_cross_entropy)
    assert rel_err(got, want) <= 1e-4 and rel_err(gh, wh) <= 2e-2 and rel_err(gw, ww) <= 2e-2
    # the first chunk's weight-gradient product wrote the float32 buffer whole (beta = 0), no zeros first
    assert lce._first_product_writes(weight.device, torch.bfloat16)
    # eager holds the [3072, 32000] logits in bf16 and float32 and their gradients; here one chunk at a time
    assert peak < 0.6 * eager_peak, (peak, eager_peak)


@pytest.mark.gpu
def test_linear_cross_entropy_on_cuda_at_berts_odd_vocabulary_with_a_bias(monkeypatch) -> None:
    """BERT's MLM decoder: 30522 classes (padded to 30528 inside), a bias, 3 chunks under autocast."""
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 1100 * 30528 * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4, 768, 768, device="cuda", generator=g)
    weight = torch.randn(30522, 768, device="cuda", generator=g) * 0.02
    bias = torch.randn(30522, device="cuda", generator=g) * 0.1
    target = torch.randint(0, 30522, (4, 768), device="cuda", generator=g)
    target[:, ::7] = -100

    def run(fn):
        def call(h, w, b):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(h, w, target, bias=b)

        return _grads(call, hidden, weight, bias)

    got, (gh, gw, gb) = run(linear_cross_entropy)
    want, (wh, ww, wb) = run(reference_linear_cross_entropy)
    assert rel_err(got, want) <= 1e-4 and rel_err(gh, wh) <= 2e-2 and rel_err(gw, ww) <= 2e-2
    assert rel_err(gb, wb) <= 2e-2


@pytest.mark.gpu
def test_rotary_embedding_on_cuda_at_llama_sizes() -> None:
    """q [4, 32, 2048, 64] as a transposed view, bf16, with autocast's float32 cos and sin."""
    q = torch.randn(4, 2048, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    freqs = torch.randn(1, 2048, 32, device="cuda")
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    assert rotary_embedding_backend(q, cos, sin) == "triton"
    got, (gq,) = _grads(lambda x: rotary_embedding(x, cos, sin), q)
    want, (wq,) = _grads(lambda x: reference_rotary_embedding(x.double(), cos.double(), sin.double()), q)
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-5 and rel_err(gq, wq) <= 1e-2
