"""`linear_cross_entropy`: an LM head's matrix product and its cross-entropy, chunked over tokens, so that the
[tokens, vocabulary] logits never exist whole (and never in float32).

An LM head written as transformers writes it (`logits = lm_head(h)`, then `ForCausalLMLoss`: `logits.float()`,
`F.cross_entropy`) holds, at Llama-3's vocabulary (128256) and 8192 tokens: the logits in bf16 (2.1 GB), their
float32 copy (4.2 GB), log_softmax's float32 output saved for the backward (4.2 GB), and in the backward the
same again as gradients. Here the tokens are taken CHUNK at a time (the chunk's logits under MAX_CHUNK_BYTES):
the chunk's logits in the compute dtype (autocast's, else the inputs'), their loss and at once their gradient
(`cross_entropy`'s kernels, the gradient written over the logits in place), then the gradient of the chunk's
hidden states (`dlogits @ W`) and of the weight (`dlogits^T @ h`, summed over chunks in float32). The
gradients are computed in the forward, when autograd will want them (grad enabled and an input requiring
grad), and the backward only scales them by the loss's upstream gradient. Peak memory for the head: one
chunk's logits, plus the weight's float32 gradient.

A head with a bias (BERT's MLM decoder) adds it in the chunk's product (addmm) and sums the chunk's logit
gradients into its float32 gradient. The vocabulary is padded to PAD_MULTIPLE with zero rows inside (aligned
products; the padding columns never reach the loss or a gradient).

Values: the loss is F.cross_entropy's on the float32 logits (as `ForCausalLMLoss` computes it) from the
compute-dtype logits; the gradients are the eager chain's up to the order of summation over chunks (the
weight's is summed in float32 and rounded once to its dtype).

Layers: `_chunk_step_*` (kernels: `cross_entropy`'s forward and in-place backward kernels; reference: PyTorch)
-> `_run` -> the custom op `opadvisor::linear_cross_entropy` (one node for torch.compile: inductor cannot chunk
this itself; a fake implementation and autograd registered) -> `linear_cross_entropy`. `reference_linear_cross_
entropy` is the eager chain, the tests' oracle.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import _backend, _dispatch

# (the package's `cross_entropy` attribute is the function: its module's kernels by name)
from .cross_entropy import MAX_BLOCK as CE_MAX_BLOCK
from .cross_entropy import _forward as ce_forward
from .cross_entropy import _launch_plan as ce_launch_plan

# The largest chunk of logits held at once (bytes, in the compute dtype). 1 GiB: 4096 rows of Llama-3's
# 128256 classes in bf16, two chunks at 8192 tokens; GPT-2's 8192 x 50264 in one. Smaller chunks cost more
# passes over the weight's float32 gradient and smaller products: the head's forward and backward on an H200
# (benchmarks/lce_chunks.py, RESULTS.md) at 256 / 512 / 1024 MiB: Llama-3 23.8 / 22.8 / 22.0 ms, GPT-2
# 5.07 / 4.72 / 4.64, BERT 3.21 / 3.06 / 2.88.
MAX_CHUNK_BYTES = 1 << 30
OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum")


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the logits are computed in: autocast's for the device where it is on, else F.linear's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


# Chunk rows are rounded up to a multiple of ROW_ALIGN where that stays under MAX_CHUNK_BYTES: the products'
# tiles then divide the chunk
ROW_ALIGN = 64


def chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk: the fewest chunks that keep each chunk's logits under MAX_CHUNK_BYTES, of equal size
    (a multiple of ROW_ALIGN where that fits), not the largest then a remainder (at 512 MiB and GPT-2's 8192
    x 50264: two chunks of 4096 rather than 5340 + 2852, 4.72 against 4.79 ms on an H200)."""
    most = max(1, MAX_CHUNK_BYTES // max(1, vocab * dtype.itemsize))
    if most >= n_rows:
        return n_rows
    chunks = -(-n_rows // most)
    rows = -(-n_rows // chunks)
    aligned = rows + -rows % ROW_ALIGN
    return aligned if aligned <= most else rows


def linear_cross_entropy_backend(hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """ "triton" / "interpreter": the chunks' loss and gradient in `cross_entropy`'s kernels; "reference":
    in PyTorch (CPU without the interpreter, float64, no Triton). Chunked either way."""
    dtype = compute_dtype(hidden, weight)
    be = _backend.backend(hidden)
    if be == _backend.REFERENCE or dtype not in _backend.KERNEL_DTYPES or hidden.numel() == 0:
        return _backend.REFERENCE
    return be


def reference_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    reduction: str = "mean", bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The eager chain: `F.cross_entropy(F.linear(hidden, weight, bias).float(), target)` (ForCausalLMLoss's)."""
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)  # fmt: skip


def _chunk_step_kernel(logits, target, ignore_index, grads, count, g):
    """Per-row loss (float32 [n]) of the chunk; with `grads`, its gradient written over `logits`."""
    rows, lse = ce_forward(logits, target, ignore_index, False)
    if grads:
        mean = count is not None
        call = (logits.dtype, target.dtype, ignore_index, g.dtype, 0)
        launch, ints = ce_launch_plan(
            True,
            tuple(logits.shape),
            logits.stride(),
            target.stride(0),
            call,
            logits.device,
            mean,
            CE_MAX_BLOCK,
        )
        launch((logits, target, lse, g, count if mean else g, logits, *ints, 0, ignore_index))
    return rows


def _chunk_step_reference(logits, target, ignore_index, grads, count, g):
    """`_chunk_step_kernel` in PyTorch: float32 log-softmax, its gradient (softmax - onehot) / count."""
    lf = logits.float()
    rows = F.cross_entropy(lf, target, ignore_index=ignore_index, reduction="none")
    if grads:
        valid = target != ignore_index
        grad = torch.softmax(lf, dim=-1)
        grad.scatter_add_(1, torch.where(valid, target, 0)[:, None], -valid[:, None].to(grad.dtype))
        grad *= valid[:, None] * (g / count if count is not None else g)
        logits.copy_(grad)
    return rows


class _Head:
    """The head as the chunks multiply it: the weight (and bias) in the compute dtype, padded to a multiple of
    PAD_MULTIPLE classes with zeros, and the float32 gradient buffers of the chunks' sums."""

    def __init__(self, weight, bias, dtype, grad_weight, grad_bias, chunked):
        self.vocab = weight.shape[0]
        self.w = _padded_weight(weight, dtype)  # [padded vocabulary, H]: its extra rows are zeros
        self.b = None if bias is None else F.pad(bias.to(dtype), (0, self.w.shape[0] - self.vocab))
        zeros = functools.partial(torch.zeros, dtype=torch.float32, device=weight.device)
        # the first chunk's product writes dw whole where it can (cuBLAS's beta = 0): no zeros written first
        self.dw_in_product = _first_product_writes(weight.device, dtype)
        make_dw = torch.empty if self.dw_in_product else torch.zeros
        self.dw = (
            make_dw(self.w.shape, dtype=torch.float32, device=weight.device)
            if grad_weight and chunked
            else None
        )
        self.dw_started = False
        self.db = zeros(self.w.shape[0]) if grad_bias else None

    def logits(self, h, out):
        if self.b is None:
            return torch.mm(h, self.w.t(), out=out)
        return torch.addmm(self.b, h, self.w.t(), out=out)


def _run(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    ignore_index: int, reduction: str, dtype: torch.dtype, grad_hidden: bool, grad_weight: bool,
    grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss float32 0-d, d loss / d hidden, / d weight, / d bias, each empty where not asked for): see the
    module docstring."""
    n = hidden.shape[0]
    step = (
        _chunk_step_reference
        if linear_cross_entropy_backend(hidden, weight) == "reference"
        else _chunk_step_kernel
    )
    count = (target != ignore_index).sum().float() if reduction == "mean" else None
    g = torch.ones((), dtype=torch.float32, device=hidden.device)
    rows_per_chunk = chunk_rows(n, _padded_size(weight.shape[0]), dtype)
    head = _Head(weight, bias, dtype, grad_weight, grad_bias, chunked=rows_per_chunk < n)
    buffer = hidden.new_empty((rows_per_chunk, head.w.shape[0]), dtype=dtype)
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    dw = weight.new_empty(0)
    grads = grad_hidden or grad_weight or grad_bias
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        h = hidden[start:stop].to(dtype)
        logits = head.logits(h, buffer[: stop - start])
        # the loss and its gradient over the real classes; the padding columns' values meet only zero rows of w
        # below, or the padding rows of dw and db that are cut off
        losses[start:stop] = step(logits[:, : head.vocab], target[start:stop], ignore_index, grads, count, g)
        _chunk_gradients(head, logits, h, dh[start:stop] if grad_hidden else None, grad_weight)
        if grad_weight and head.dw is None:  # one chunk: its product is the gradient
            dw = torch.mm(logits.t(), h)
    loss = losses.sum()
    if count is not None:
        loss = loss / count
    dw = _cut(dw if head.dw is None else head.dw, head.vocab, weight.dtype) if grad_weight else dw
    db = _cut(head.db, head.vocab, bias.dtype) if grad_bias else weight.new_empty(0)
    return loss, dh, dw, db


def _chunk_gradients(head: _Head, dlogits, h, dh, grad_weight: bool) -> None:
    """The chunk's shares of the gradients, from its logits' gradient (written over the logits)."""
    if dh is not None and dh.dtype == dlogits.dtype:  # written in place: no product's copy to move
        torch.mm(dlogits, head.w, out=dh)
    elif dh is not None:
        dh.copy_(torch.mm(dlogits, head.w))
    if grad_weight and head.dw is not None:
        if head.dw_in_product and not head.dw_started:
            torch.addmm(head.dw, dlogits.t(), h, out_dtype=head.dw.dtype, beta=0, out=head.dw)
        else:
            _accumulate(head.dw, dlogits.t(), h)
        head.dw_started = True
    if head.db is not None:
        head.db += dlogits.sum(0, dtype=torch.float32)


def _accumulate(dw: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """dw += a @ b, dw float32, a and b 16-bit: on CUDA in the product itself (cuBLAS's beta = 1, float32
    output); otherwise (and where this torch has no dtype-out addmm) through a float32 product added after,
    which costs a read and a write of dw more per chunk (Llama-3's 1 GiB weight gradient: 1 ms a chunk)."""
    if dw.is_cuda and a.dtype != dw.dtype and _HAS_ADDMM_DTYPE_OUT:
        torch.addmm(dw, a, b, out_dtype=dw.dtype, out=dw)
    else:
        dw += torch.mm(a, b)


_HAS_ADDMM_DTYPE_OUT = hasattr(torch.ops.aten.addmm, "dtype_out")


def _first_product_writes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the first chunk's weight-gradient product can write the float32 buffer whole (addmm with a
    float32 output and beta = 0 on a buffer never written: 1 GiB of zeros and their read saved a step at
    Llama-3's head). Asked of this torch once per device and dtype with a small product over a buffer of
    NaN, which beta = 0 must ignore; where it raises or keeps a NaN, the buffer starts as zeros instead.
    Not asked while a CUDA graph is captured (the answer is read on the host): zeros then."""
    if device.type != "cuda" or dtype == torch.float32 or not _HAS_ADDMM_DTYPE_OUT:
        return False
    key = (device, dtype)
    if key not in _FIRST_PRODUCT_WRITES:
        if torch.cuda.is_current_stream_capturing():
            return False
        _FIRST_PRODUCT_WRITES[key] = _probe_beta_zero(device, dtype)
    return _FIRST_PRODUCT_WRITES[key]


_FIRST_PRODUCT_WRITES: dict[tuple[torch.device, torch.dtype], bool] = {}


def _probe_beta_zero(device: torch.device, dtype: torch.dtype) -> bool:
    a = torch.ones(16, 8, dtype=dtype, device=device)
    b = torch.ones(8, 16, dtype=dtype, device=device)
    out = torch.full((16, 16), float("nan"), device=device)
    try:
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=0, out=out)
    except (RuntimeError, TypeError):
        return False
    return bool((out == 8).all())


# The vocabulary is padded to a multiple of PAD_MULTIPLE inside the op: at GPT-2's 50257 classes the chunk's
# logits otherwise have a leading dimension cuBLAS cannot vectorise, and all three products ran sm75-era
# align1 kernels (H200: 15.8 ms a step against 2.4 ms for the same products padded)
PAD_MULTIPLE = 8


def _padded_size(vocab: int) -> int:
    return vocab + -vocab % PAD_MULTIPLE


def _padded_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = weight.to(dtype)
    pad = _padded_size(w.shape[0]) - w.shape[0]
    return F.pad(w, (0, 0, 0, pad)) if pad else w


def _cut(grad: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight's (or bias's) gradient: the padded one's real rows, in the parameter's dtype, a tensor of its
    own."""
    if grad.shape[0] == vocab:
        return grad.to(dtype)
    return grad[:vocab].to(dtype, copy=True)


@torch.library.custom_op("opadvisor::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    ignore_index: int, reduction: str, dtype: torch.dtype, grad_hidden: bool, grad_weight: bool,
    grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, its gradient w.r.t. hidden, weight and bias, each empty where not asked for). `dtype`, the
    logits' compute dtype, is decided where the call is traced (autocast is off where a compiled graph runs
    the op)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return _run(hidden, weight, bias, target, ignore_index, reduction, dtype, grad_hidden, grad_weight,
                    grad_bias)  # fmt: skip


@linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, dtype, grad_hidden, grad_weight, grad_bias):
    loss = hidden.new_empty((), dtype=torch.float32)
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if grad_weight else weight.new_empty(0)
    db = torch.empty_like(bias) if grad_bias else weight.new_empty(0)
    return loss, dh, dw, db


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.grads = inputs[7:10]


def _op_backward(ctx, dloss, _ddh, _ddw, _ddb):
    # In place: the gradients are this op's own buffers, read by this backward only (a second backward through
    # the same graph fails on their version counters rather than reading scaled values); out of place the
    # weight's gradient would be allocated twice at the start of the model's backward (1 GiB at Llama-3's head).
    grads = (
        t.mul_(dloss.to(t.dtype)) if asked else None
        for t, asked in zip(ctx.saved_tensors, ctx.grads, strict=True)
    )
    return (*grads, None, None, None, None, None, None, None)  # hidden, weight, bias; none for the rest


torch.library.register_autograd(linear_cross_entropy_op, _op_backward, setup_context=_setup_context)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    reduction: str = "mean", bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ignore_index=..., reduction=...)`
    (float32 loss) without the whole logits: hidden [..., H], weight [V, H], bias [V] or None, target [...]
    class indices (int64 / int32); reduction "mean" (over the rows not ignored) or "sum"."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, not {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    if t.device != h.device:
        t = t.to(h.device)
    backend = linear_cross_entropy_backend(h, weight)
    if backend == _backend.REFERENCE:
        _dispatch.record_reference(OP, _backend.fallback_reason(h))
    else:
        _dispatch.record(OP, _dispatch.KERNEL)
    grad = torch.is_grad_enabled()
    asked = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    dtype = compute_dtype(hidden, weight)
    loss, *_ = linear_cross_entropy_op(h, weight, bias, t, ignore_index, reduction, dtype, *asked)
    return loss
