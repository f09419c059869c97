"""DeBERTa-v2/v3 (transformers' DebertaV2*): the disentangled self-attention as one
`opadvisor.kernels.disentangled_bias` and one `F.scaled_dot_product_attention` (hf_deberta_attention), the
encoder's relative positions built once per sequence length (hf_deberta_positions). Its output blocks are
patched as BERT's (bert.py), its masked-LM loss as BertForMaskedLM's (lm_loss.py)."""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from opadvisor.kernels import autocast_shared

from .arguments import _arguments
from .fingerprint import _fingerprint_problem
from .shared import _NOTHING_TO_GAIN, CalledLinear, _no_hooks, _sdpa_mask, _State, _types

# -- DeBERTa-v2/v3 disentangled self-attention (hf_deberta_attention) ---------------------------------------------
# The original forms the [batch*heads, Sq, Sk] scores by hand: the content scores, two gathers of the
# relative-position tables each divided by the scale and added, the padding mask filled in, softmax, dropout,
# then the product with the values: a dozen passes over the scores each way, each a kernel launch. The
# replacement computes the relative-position term in one kernel (opadvisor.kernels.disentangled_bias) and
# hands it, with the mask added as finfo.min, to one scaled_dot_product_attention (whose memory-efficient
# backend gives the bias its gradient).
_DEBERTA_METHODS = ("forward", "disentangled_attention_bias", "transpose_for_scores")
_DEBERTA_HELPERS = ("scaled_size_sqrt", "build_rpos")  # module-level functions the forward calls


def _check_deberta_attention(module: nn.Module) -> str | None:
    cls = type(module)
    namespace = sys.modules.get(cls.__module__)
    problem = None
    for name in _DEBERTA_METHODS:
        key = f"DisentangledSelfAttention.{name}"
        problem = problem or _fingerprint_problem(cls, key, getattr(cls, name, None), None)
    for name in _DEBERTA_HELPERS:
        key = f"deberta_v2.{name}"
        problem = problem or _fingerprint_problem(cls, key, getattr(namespace, name, None), None)
    if problem is None and module.relative_attention and not isinstance(module.pos_ebd_size, int):
        problem = f"its pos_ebd_size is {module.pos_ebd_size!r}, not an int"
    return problem or _types(module, _deberta_parts(module)) or _no_hooks(module)


def _deberta_parts(module: nn.Module) -> dict[str, type]:
    """The submodules the forward calls, by what they must be (an nn.Dropout the first-call check turns off)."""
    parts = {
        "query_proj": CalledLinear, "key_proj": CalledLinear, "value_proj": CalledLinear, "dropout": nn.Dropout
    }  # fmt: skip
    if module.relative_attention:
        parts["pos_dropout"] = nn.Dropout
        if not module.share_att_key and "c2p" in module.pos_att_type:
            parts["pos_key_proj"] = CalledLinear
        if not module.share_att_key and "p2c" in module.pos_att_type:
            parts["pos_query_proj"] = CalledLinear
    return parts


def _deberta_call_problem(
    module: nn.Module, hidden_states, attention_mask, query_states, relative_pos, rel_embeddings
) -> str | None:
    """Why this call runs the original forward, or None: the calls the original refuses or computes
    otherwise than the replacement reproduces."""
    if attention_mask is None:
        return "no attention mask (the original requires one)"
    queries = hidden_states if query_states is None else query_states
    sq, sk = queries.shape[-2], hidden_states.shape[-2]
    if "p2c" in module.pos_att_type and module.relative_attention and sq != sk:
        return "queries and keys of different lengths with p2c (the original builds other positions then)"
    if relative_pos is not None and (
        relative_pos.dim() not in (2, 3, 4)
        or tuple(relative_pos.shape[-2:]) != (sq, sk)
        or any(d != 1 for d in relative_pos.shape[:-2])
    ):
        return f"relative_pos of shape {tuple(relative_pos.shape)} (the kernel takes one [Sq, Sk] map)"
    uses_table = "c2p" in module.pos_att_type or "p2c" in module.pos_att_type
    if module.relative_attention and uses_table:
        if rel_embeddings is None or rel_embeddings.shape[0] < 2 * module.pos_ebd_size:
            return "rel_embeddings missing or shorter than 2 x pos_ebd_size"
    return None


def _deberta_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, heads*d] -> [B, heads, S, d] (a view)."""
    return x.view(*x.shape[:-1], heads, -1).transpose(1, 2)


def _deberta_scale_of(size: int, dtype: torch.dtype) -> float:
    """sqrt(size) as the original divides by it: computed in float32, then rounded to the scores' dtype
    (bf16 under autocast: sqrt(64 x 3) = 13.856 becomes 13.875)."""
    return _deberta_scale_cached(size, dtype)


@functools.cache
def _deberta_scale_cached(size: int, dtype: torch.dtype) -> float:
    return torch.tensor(float(size), dtype=torch.float32).sqrt().to(dtype).item()


# a constant of the trace under torch.compile (as arguments._named_parameters)
_deberta_scale_of._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _deberta_relative_bias(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, relative_pos, rel_embeddings, scale: float
) -> torch.Tensor | None:
    """The c2p + p2c relative-position scores [B, H, Sq, Sk] (None when pos_att_type has neither): the
    position tables' products with q and k, gathered, scaled and summed by opadvisor.kernels.disentangled_bias."""
    from opadvisor.kernels import disentangled_bias  # looked up at call time, as bias_dropout_add

    c2p, p2c = "c2p" in module.pos_att_type, "p2c" in module.pos_att_type
    if not (c2p or p2c):
        return None
    batch, heads, sq, _ = q.shape
    sk = k.shape[-2]
    if relative_pos is None:
        relative_pos = sys.modules[type(module).__module__].build_relative_position(
            q, k, bucket_size=module.position_buckets, max_position=module.max_relative_positions
        )
    positions = relative_pos.to(device=q.device, dtype=torch.long).reshape(sq, sk)
    span = module.pos_ebd_size
    rel = module.pos_dropout(rel_embeddings)[: 2 * span]
    c2p_table = c2p_index = p2c_table = p2c_index = None
    if c2p:
        pos_key = _deberta_heads(
            (module.key_proj if module.share_att_key else module.pos_key_proj)(rel[None]), heads
        )
        c2p_table = torch.matmul(q, pos_key.transpose(-1, -2)).reshape(batch * heads, sq, 2 * span)
        c2p_index = torch.clamp(positions + span, 0, 2 * span - 1)
    if p2c:
        pos_query = _deberta_heads(
            (module.query_proj if module.share_att_key else module.pos_query_proj)(rel[None]), heads
        )
        p2c_table = torch.matmul(k, pos_query.transpose(-1, -2)).reshape(batch * heads, sk, 2 * span)
        p2c_index = torch.clamp(span - positions, 0, 2 * span - 1)
    bias = disentangled_bias(c2p_table, p2c_table, c2p_index, p2c_index, scale)
    return bias.view(batch, heads, sq, sk)


def _deberta_attention(
    module: nn.Module,
    state: _State,
    hidden_states,
    attention_mask,
    output_attentions=False,
    query_states=None,
    relative_pos=None,
    rel_embeddings=None,
):
    # Asked for the probabilities (output_attentions), which SDPA never forms, or a call the original refuses
    # or computes otherwise (_deberta_call_problem): this call runs the original forward.
    problem = _deberta_call_problem(
        module, hidden_states, attention_mask, query_states, relative_pos, rel_embeddings
    )
    if output_attentions or problem is not None:
        return state.original(
            hidden_states, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings
        )
    heads = module.num_attention_heads
    # one 16-bit copy of the hidden states for the projections that read them
    shared = autocast_shared(hidden_states, 3 if query_states is None else 2)
    q = _deberta_heads(module.query_proj(shared[2] if query_states is None else query_states), heads)
    k = _deberta_heads(module.key_proj(shared[0]), heads)
    v = _deberta_heads(module.value_proj(shared[1]), heads)
    factor = 1 + ("c2p" in module.pos_att_type) + ("p2c" in module.pos_att_type)
    scale = _deberta_scale_of(q.shape[-1] * factor, q.dtype)
    bias = None
    if module.relative_attention:
        bias = _deberta_relative_bias(module, q, k, relative_pos, rel_embeddings, scale)
    fill, dead = _deberta_mask_terms(attention_mask, q)
    mask = fill if bias is None else _sdpa_mask(bias, q) + fill
    with _deberta_backends(mask):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=module.dropout.p if module.training else 0.0, scale=1.0 / scale
        )
    out = torch.where(dead, v.mean(dim=-2, keepdim=True), out)
    return out.transpose(1, 2).flatten(2), None  # [B, Sq, heads*d], contiguous as the original's


def _deberta_mask_terms(attention_mask: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fill, dead) for a padding mask: the encoder hands every layer the same mask tensor, so they are
    computed once per mask (the last one seen, while it lives and is not changed in place), not per layer."""
    if torch.compiler.is_compiling() or attention_mask.is_inference():  # no version counter to check
        return _deberta_build_mask_terms(attention_mask, q)
    key = (attention_mask._version, q.dtype, q.device)
    last = _DEBERTA_LAST_MASK[0]
    if last is not None and last[0]() is attention_mask and last[1] == key:
        return last[2]
    terms = _deberta_build_mask_terms(attention_mask, q)
    _DEBERTA_LAST_MASK[0] = (weakref.ref(attention_mask), key, terms)
    return terms


# (a weak reference to the last mask, its (version, dtype, device), its terms): one entry for the process
_DEBERTA_LAST_MASK: list[Any] = [None]


def _deberta_build_mask_terms(
    attention_mask: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fill: the SDPA float mask's padding term in q's dtype, finfo.min where the original fills the scores
    with it (those keys then get probability 0, as after its masked_fill; added to the relative-position
    scores, not filled into them: an add's backward passes the gradient through, a masked_fill's is one more
    pass over the scores). dead: the query rows whose keys are all masked (a padded query), [..., Sq, 1].

    The original fills all of a dead row's scores with the same finfo.min, so softmax weighs every key alike and
    the row is the mean of the values, with no gradient to the scores. SDPA sees those rows unmasked (an
    all-finfo.min row has a logsumexp near -3.4e38, which some backends' backward overflows on) and the caller
    replaces them with that mean. (In training the original also drops out those uniform weights; here the row
    is their expectation.)"""
    keep = attention_mask.bool()
    dead = ~keep.any(dim=-1, keepdim=True)
    fill = torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
    return fill.masked_fill_(~(keep | dead), torch.finfo(q.dtype).min), dead


# cuDNN's SDPA backward returns no gradient for a float mask (aten::_scaled_dot_product_cudnn_attention_backward
# gives dq, dk, dv only) and SDPA prefers cuDNN on an H100/H200 with a recent cuDNN: where the bias needs its
# gradient, the call lets SDPA choose among the others (the memory-efficient backend computes it).
_BIAS_GRAD_BACKENDS = ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH")


def _deberta_backends(mask: torch.Tensor) -> Any:
    """A context for the SDPA call: without cuDNN where the mask is on CUDA and needs its gradient."""
    if not (mask.is_cuda and mask.requires_grad):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in _BIAS_GRAD_BACKENDS])


# -- DeBERTa-v2/v3 relative positions, built once per length (hf_deberta_positions) --------------------------------
# DebertaV2Encoder builds the [1, Sq, Sk] relative-position buckets at every forward: about twenty small ops and,
# with position_buckets (DeBERTa-v3), a Python number copied to the GPU (make_log_bucket_position's
# `torch.tensor(mid - 1).type_as(...)`: a host synchronisation, and what stops a CUDA-graph capture of the
# model). They depend on the lengths, the configuration and the device only: the patch builds them with the
# encoder's own get_rel_pos once per (lengths, device) and hands them to the encoder's forward as relative_pos.
_DEBERTA_POSITION_HELPERS = ("build_relative_position", "make_log_bucket_position")
_POSITIONS_KEPT = 8  # (lengths, device) entries an encoder keeps; past it the oldest goes


def _check_deberta_encoder(module: nn.Module) -> str | None:
    cls = type(module)
    namespace = sys.modules.get(cls.__module__)
    problem = None
    for name in ("forward", "get_rel_pos"):
        key = f"DebertaV2Encoder.{name}"
        problem = problem or _fingerprint_problem(cls, key, getattr(cls, name, None), None)
    for name in _DEBERTA_POSITION_HELPERS:
        problem = problem or _fingerprint_problem(
            cls, f"deberta_v2.{name}", getattr(namespace, name, None), None
        )
    if problem is None and not module.relative_attention:
        return _NOTHING_TO_GAIN  # no positions to build
    return problem or _no_hooks(module)


def _deberta_encoder(module: nn.Module, state: _State, *args, **kwargs):
    arguments = _arguments(module, args, kwargs)
    hidden_states = arguments.get("hidden_states")
    # Positions given by the caller, hidden states as a sequence of layers (the z_steps path), or a trace
    # (torch.compile traces the original's ops; no cache in the graph): the original forward as called.
    if arguments.get("relative_pos") is not None or not torch.is_tensor(hidden_states):
        return state.original(*args, **kwargs)
    if torch.compiler.is_compiling():
        return state.original(*args, **kwargs)
    positions = _deberta_positions(module, state, hidden_states, arguments.get("query_states"))
    return state.original(**{**arguments, "relative_pos": positions})


def _deberta_positions(module: nn.Module, state: _State, hidden_states: torch.Tensor, query_states) -> Any:
    """The encoder's relative positions for these lengths and this device, built once by its get_rel_pos."""
    queries = hidden_states if query_states is None else query_states
    key = (queries.shape[-2], hidden_states.shape[-2], hidden_states.device)
    positions = state.kept.get(key)
    if positions is None:
        if len(state.kept) >= _POSITIONS_KEPT:
            state.kept.pop(next(iter(state.kept)))
        positions = state.kept[key] = module.get_rel_pos(hidden_states, query_states, None)
    return positions
