"""The BERT family (transformers' BertSelfAttention and BertSelfOutput / BertOutput, and the classes that are
BERT's, class for class: RoBERTa, XLM-R, ELECTRA, ...): the eager attention as one
`F.scaled_dot_product_attention` (hf_bert_self_attention); the output blocks' dense bias, dropout and residual
add as one `opadvisor.kernels.bias_dropout_add`, then `F.layer_norm` (hf_bert_output)."""

from __future__ import annotations

import sys

import torch.nn as nn
import torch.nn.functional as F

from opadvisor.kernels import autocast_shared

from .arguments import _arguments, _kv_cache
from .fingerprint import _fingerprint_problem
from .shared import CalledLinear, _hf_eager, _linear_dropout_add, _sdpa_mask, _State, _types


def _bert_prefix(cls: type, block: str) -> str:
    return cls.__name__[: -len(block)]


# -- BERT-family self-attention --------------------------------------------------------------------------------
def _check_bert_attention(module: nn.Module) -> str | None:
    cls = type(module)
    prefix = _bert_prefix(cls, "SelfAttention")
    problem = _fingerprint_problem(cls, "BertSelfAttention.forward", cls.forward, prefix)
    eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    problem = problem or _fingerprint_problem(cls, "BertSelfAttention.eager", eager, prefix)
    return (
        problem
        or _hf_eager(module)
        or _types(
            module, {"query": CalledLinear, "key": CalledLinear, "value": CalledLinear, "dropout": nn.Dropout}
        )
    )


def _bert_attention(module: nn.Module, state: _State, hidden_states, *args, **kwargs):
    if _kv_cache(args, kwargs) is not None:  # a decoder's cache: the original handles it
        return state.original(hidden_states, *args, **kwargs)
    attention_mask = _arguments(module, (hidden_states, *args), kwargs).get("attention_mask")
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.attention_head_size)
    qx, kx, vx = autocast_shared(hidden_states, 3)  # one 16-bit copy for the three projections
    q = module.query(qx).view(*hidden_shape).transpose(1, 2)
    k = module.key(kx).view(*hidden_shape).transpose(1, 2)
    v = module.value(vx).view(*hidden_shape).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=_sdpa_mask(attention_mask, q),
        dropout_p=module.dropout.p if module.training else 0.0,
        scale=module.scaling,
    )
    return out.transpose(1, 2).reshape(*input_shape, -1).contiguous(), None


# -- BERT-family output blocks (BertSelfOutput / BertOutput) -------------------------------------------------------
def _check_bert_output(module: nn.Module) -> str | None:
    cls = type(module)
    block = "SelfOutput" if cls.__name__.endswith("SelfOutput") else "Output"
    problem = _fingerprint_problem(cls, "BertOutput.forward", cls.forward, _bert_prefix(cls, block))
    if problem is None and module.dense.bias is None:
        problem = "its dense layer has no bias"
    return problem or _types(module, {"dense": nn.Linear, "dropout": nn.Dropout, "LayerNorm": nn.LayerNorm})


def _bert_output(module: nn.Module, state: _State, hidden_states, input_tensor):
    h = _linear_dropout_add(module.dense, hidden_states, input_tensor, module.dropout.p, module.training)
    ln = module.LayerNorm
    return F.layer_norm(h, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
