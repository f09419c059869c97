"""`rotary_embedding`: transformers' rotary position embedding of q or k (`apply_rotary_pos_emb`'s
`x * cos + rotate_half(x) * sin`, Llama's and the classes that copy it) in one kernel each way.

The original runs, per tensor, two slices, a negation, a concatenation, two multiplications and an addition
forward (and their backward: about as many again), each a pass over q or k; under autocast it also writes its
result in float32 (bf16 q times float32 cos). The kernel reads x once and the token's cos and sin rows once
for all heads, and writes y; backward the same on dy. cos and sin are saved (they are shared by every layer),
not x. Values: float32 math rounded once to the result's dtype (torch's promotion of x and cos, as the
original's: float32 under autocast).

Layers: `_rope_triton.rope_kernel` -> `_apply` -> `RotaryFunction` (eager) and the custom ops
`opadvisor::rope_fwd` / `_bwd` (torch.compile with COMPILE_PATH "custom_op"; "native", the default, traces
the reference, which inductor fuses as well) -> `rotary_embedding`. `reference_rotary_embedding` is the
original, the fallback and the tests' oracle; `rotary_embedding_backend` says which runs ("reference" for
inputs the kernel does not take: x not [B, H, S, D] with an even D, cos / sin not [1 or B, S, D], cos or sin
requiring grad, float64, CPU without the interpreter).
"""

from __future__ import annotations

import functools

import torch

from . import _backend, _dispatch
from ._launch import Launcher
from .softmax import triton_next_power_of_2

SMALL_NUMEL = 1 << 20  # CUDA tensors under this run the reference (not measured: as rms_norm's)
COMPILE_PATH = "native"
OP = "rotary_embedding"


def rotary_embedding_backend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """Which implementation `rotary_embedding(x, cos, sin)` runs: "triton", "interpreter", "eager" or
    "reference"."""
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or x.shape[-1] % 2:
        return _backend.REFERENCE
    if cos.shape[0] not in (1, x.shape[0]) or cos.shape[1:] != x.shape[2:]:
        return _backend.REFERENCE
    if cos.requires_grad or sin.requires_grad or cos.dtype != sin.dtype or cos.device != x.device:
        return _backend.REFERENCE
    if cos.dtype not in _backend.KERNEL_DTYPES:
        return _backend.REFERENCE
    return _backend.for_tensor(x, SMALL_NUMEL)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def reference_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor (unsqueeze_dim=1), op for op."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


@functools.cache
def _launcher() -> Launcher:
    from . import _rope_triton as k

    return Launcher(k.rope_kernel)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, backward: bool):
    """The kernel on x (or dy, `backward`): a new contiguous [B, H, S, D] tensor of out_dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    b, h, s, d = x.shape
    y = torch.empty((b, h, s, d), dtype=out_dtype, device=x.device)
    _backend.check_launch(x)
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    half = d // 2
    meta = {
        "BLOCK_H": min(16, triton_next_power_of_2(h)),
        "BLOCK_D": max(16, triton_next_power_of_2(half)),
        "BACKWARD": backward,
        "RNE": _backend.emulate_rne(y),
        "num_warps": 4,
    }
    args = (x, cos, sin, y, s, h, x.stride(0), x.stride(1), x.stride(2), scb, cos.stride(1), half)
    _launcher()((b * s,), args, meta)
    return y


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _apply(x, cos, sin, torch.promote_types(x.dtype, cos.dtype), False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, ctx.x_dtype, True), None, None


@torch.library.custom_op("opadvisor::rope_fwd", mutates_args=())
def rope_fwd_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _apply(x, cos, sin, torch.promote_types(x.dtype, cos.dtype), False)


@rope_fwd_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype))


@torch.library.custom_op("opadvisor::rope_bwd", mutates_args=())
def rope_bwd_op(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    return _apply(dy, cos, sin, x_dtype, True)


@rope_bwd_op.register_fake
def _(dy, cos, sin, x_dtype):
    return dy.new_empty(dy.shape, dtype=x_dtype)


def _setup_context(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.x_dtype = x.dtype


def _op_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rope_bwd_op(dy, cos, sin, ctx.x_dtype), None, None


torch.library.register_autograd(rope_fwd_op, _op_backward, setup_context=_setup_context)
_apply_function = _backend.direct_apply(RotaryFunction)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)` for x [B, H, S, D] and cos, sin
    [1 or B, S, D] (transformers' apply_rotary_pos_emb for one of q, k), one kernel each way on CUDA."""
    backend = rotary_embedding_backend(x, cos, sin)
    if backend == _backend.REFERENCE:
        reason = _backend.fallback_reason(x)
        if reason is None and _backend.backend(x) != _backend.REFERENCE and x.numel():
            reason = (
                "shapes, dtypes or a cos / sin requiring grad the kernel does not take: the reference runs"
            )
        _dispatch.record_reference(OP, reason)
        return reference_rotary_embedding(x, cos, sin)
    if backend == _backend.EAGER or (torch.compiler.is_compiling() and COMPILE_PATH == "native"):
        _dispatch.record(OP, _dispatch.CHAIN)
        return reference_rotary_embedding(x, cos, sin)
    _dispatch.record(OP, _dispatch.KERNEL)
    if torch.compiler.is_compiling():
        return rope_fwd_op(x, cos, sin)
    return _apply_function(x, cos, sin)
