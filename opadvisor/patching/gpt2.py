"""GPT-2: the eager attention as one `F.scaled_dot_product_attention` (hf_gpt2_attention), the MLP's tanh GELU
written op by op (NewGELUActivation) as `F.gelu(x, approximate="tanh")` (hf_gelu_tanh)."""

from __future__ import annotations

import sys

import torch.nn as nn
import torch.nn.functional as F

from .arguments import _arguments, _kv_cache, _update_cache
from .fingerprint import _fingerprint_problem
from .shared import _hf_eager, _sdpa_mask, _State, _types


# -- GPT-2 ---------------------------------------------------------------------------------------------------
def _check_gpt2_attention(module: nn.Module) -> str | None:
    cls = type(module)
    problem = _fingerprint_problem(cls, "GPT2Attention.forward", cls.forward, None)
    eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    problem = problem or _fingerprint_problem(cls, "GPT2Attention.eager", eager, None)
    if problem is None and module.reorder_and_upcast_attn:
        problem = "it upcasts and reorders its attention (reorder_and_upcast_attn): left as written"
    if problem is None and module.is_cross_attention:
        problem = "cross-attention: left as written"
    return (
        problem
        or _hf_eager(module)
        or _types(module, {"attn_dropout": nn.Dropout, "resid_dropout": nn.Dropout})
    )


def _gpt2_attention(module: nn.Module, state: _State, hidden_states, *args, **kwargs):
    arguments = _arguments(module, (hidden_states, *args), kwargs)
    if arguments.get("encoder_hidden_states") is not None:
        return state.original(hidden_states, *args, **kwargs)
    q, k, v = module.c_attn(hidden_states).split(module.split_size, dim=2)
    shape = (*k.shape[:-1], -1, module.head_dim)
    q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
    cache = _kv_cache(args, kwargs)
    if cache is not None:  # GPT2Model passes a cache in training too (use_cache): fill it as the original
        k, v = _update_cache(module, cache, k, v, arguments)
    attention_mask = arguments.get("attention_mask")
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=_sdpa_mask(attention_mask, q),
        dropout_p=module.attn_dropout.p if module.training else 0.0,
        scale=module.scaling,
    )
    out = out.transpose(1, 2)
    out = out.reshape(*out.shape[:-2], -1).contiguous()
    return module.resid_dropout(module.c_proj(out)), None


def _check_gelu(module: nn.Module) -> str | None:
    return _fingerprint_problem(type(module), "NewGELUActivation.forward", type(module).forward, None)


def _gelu_tanh(module: nn.Module, state: _State, input):
    return F.gelu(input, approximate="tanh")
