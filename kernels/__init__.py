"""Fused kernels bundled with opadvisor, imported by rewritten scripts as ``opadvisor.kernels``.

- ``masked_softmax(x, mask=None, *, dim=-1, scale=None, fill_value=-inf, zero_masked=False,
  dropout_p=0.0, training=True)``: scale -> mask -> softmax -> zero masked -> dropout, one kernel.
- ``bias_dropout_add(x, bias, residual, p, training=True)``: ``residual + dropout(x + bias)``.
- ``cross_entropy(input, target, ...)``: ``F.cross_entropy``'s drop-in; 16-bit logits read once per
  direction, in place (a column slice of a padded LM-head output included), without float32 copies.
- ``PaddedLinear`` / ``padded_linear``: ``nn.Linear`` whose GEMM runs on sizes padded to a multiple of 8.
- ``cuda_graphed(module)``: the module's forward and backward replayed from CUDA graphs, per input shape.
- ``cell_sequence(cell, inputs, state=None, *, time_dim=0)``: an ``nn.LSTMCell`` / ``nn.GRUCell`` /
  ``nn.RNNCell`` run over a whole sequence in one call of the op ``nn.LSTM`` runs (cuDNN on CUDA), with
  the cell's own parameters.
- ``dropout(x, p, training=True)``: ``F.dropout`` whose backward recomputes the mask from a seed.
- ``quick_gelu(x)``: ``x * sigmoid(1.702 * x)``, one kernel each way.
- ``silu_mul(g, u)``: ``F.silu(g) * u`` (a SwiGLU MLP's gate), one kernel each way, g and u saved only;
  ``silu_mul_linear(g, u, weight)``: the down projection of it, whose backward computes it again.
- ``rms_norm(x, weight, eps)``: transformers' RMSNorm (LlamaRMSNorm and its copies), one kernel each way.
- ``rotary_embedding(x, cos, sin)``: transformers' rotary embedding of q or k, one kernel each way.
- ``linear_cross_entropy(hidden, weight, target, ..., bias=None)``: an LM head's matrix product (and bias) and
  cross-entropy, chunked over tokens: never the whole [tokens, vocabulary] logits, never in float32.
- ``disentangled_bias(c2p, p2c, c2p_index, p2c_index, scale)``: DeBERTa's relative-position scores.
- ``autocast_shared(x, n)``: one autocast-dtype copy of ``x`` for ``n`` linear layers that read it (in place of
  the ``n`` copies autocast makes and keeps for backward), gradients summed in float32 as eager does.
- ``AdamW``: ``torch.optim.AdamW`` (same arguments, same state) whose step updates all of a group's tensors
  in one launch, at close to the GPU's memory bandwidth.
- ``autocast_linear(x, weight, bias=None)``: ``F.linear`` under autocast whose float32 weight's gradient the
  product writes in float32 (with ``casts.WEIGHT_GRAD_F32`` on CUDA; eager's computation otherwise).
- ``compile_region``: a decorator compiling one function with torch.compile, the original kept on failure.
- ``fixed_dropout_seed(seed=(1, 2, 3))``: a context manager in which every dropout of these kernels uses
  one seed (the same mask each call): for timing CUDA-graph replays and debugging, never for training.

Which implementation runs (Triton on CUDA, Triton's interpreter under ``TRITON_INTERPRET=1``, plain
PyTorch otherwise) is decided by ``backend()`` and the per-op ``*_backend()`` functions before a call;
``dispatch_counts()`` says afterwards which path each op's calls took ("kernel", "chain", "reference"), and
every fallback that is not the documented size dispatch warns once with its reason. Importing this package
does not import Triton.
"""

from ._backend import EAGER, backend, cuda_graph_capturing, is_kv_cache
from ._dispatch import dispatch_counts, reset_dispatch_counts
from ._rng import fixed_dropout_seed
from .activations import (
    quick_gelu,
    quick_gelu_backend,
    reference_quick_gelu,
    reference_silu_mul,
    silu_mul,
    silu_mul_backend,
    silu_mul_linear,
)
from .adamw import AdamW
from .casts import autocast_linear, autocast_shared
from .cross_entropy import cross_entropy, cross_entropy_backend, reference_cross_entropy
from .dropout_add import bias_dropout_add, bias_dropout_add_backend, reference_bias_dropout_add
from .graphs import cuda_graphed
from .linear import PaddedLinear, padded_linear
from .linear_cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_backend,
    reference_linear_cross_entropy,
)
from .region import compile_region, region_state
from .relpos import disentangled_bias, disentangled_bias_backend, reference_disentangled_bias
from .rms_norm import reference_rms_norm, rms_norm, rms_norm_backend
from .rnn import cell_sequence
from .rope import reference_rotary_embedding, rotary_embedding, rotary_embedding_backend
from .seeded_dropout import dropout, dropout_backend, reference_dropout
from .softmax import masked_softmax, masked_softmax_backend, reference_masked_softmax

__all__ = [
    "AdamW",
    "EAGER",
    "cuda_graph_capturing",
    "is_kv_cache",
    "autocast_linear",
    "autocast_shared",
    "PaddedLinear",
    "backend",
    "bias_dropout_add",
    "bias_dropout_add_backend",
    "cell_sequence",
    "compile_region",
    "cross_entropy",
    "cross_entropy_backend",
    "cuda_graphed",
    "dispatch_counts",
    "disentangled_bias",
    "disentangled_bias_backend",
    "dropout",
    "dropout_backend",
    "fixed_dropout_seed",
    "linear_cross_entropy",
    "linear_cross_entropy_backend",
    "masked_softmax",
    "masked_softmax_backend",
    "padded_linear",
    "quick_gelu",
    "quick_gelu_backend",
    "reference_bias_dropout_add",
    "reference_cross_entropy",
    "reference_disentangled_bias",
    "reference_dropout",
    "reference_linear_cross_entropy",
    "reference_masked_softmax",
    "reference_rms_norm",
    "reference_rotary_embedding",
    "reference_silu_mul",
    "reset_dispatch_counts",
    "reference_quick_gelu",
    "region_state",
    "rms_norm",
    "rms_norm_backend",
    "rotary_embedding",
    "rotary_embedding_backend",
    "silu_mul",
    "silu_mul_backend",
    "silu_mul_linear",
]
