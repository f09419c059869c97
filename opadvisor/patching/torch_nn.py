"""torch.nn's own modules: `nn.MultiheadAttention` called for weights it is not asked to give back
(mha_weights_off, unsafe), `nn.TransformerEncoderLayer` in training with each dropout + residual add as one
`bias_dropout_add` (transformer_encoder_layer), `nn.Linear` whose sizes are not multiples of 8 on padded sizes
(padded_linear)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from opadvisor.kernels import linear as _linear

from .shared import _NOTHING_TO_GAIN, _linear_dropout_add, _no_hooks, _State, _types

# -- torch.nn ------------------------------------------------------------------------------------------------
_MHA_PARAMS = ("self", "query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
_ENCODER_PARAMS = ("self", "src", "src_mask", "src_key_padding_mask", "is_causal")


def _signature_problem(function: Callable[..., Any], expected: Sequence[str], what: str) -> str | None:
    params = tuple(inspect.signature(function).parameters)
    if params[: len(expected)] != tuple(expected):
        return (
            f"torch {torch.__version__} changed {what}'s signature to {params} (expected {tuple(expected)})"
        )
    return None


def _check_mha(module: nn.Module) -> str | None:
    return _signature_problem(type(module).forward, _MHA_PARAMS, "MultiheadAttention.forward")


def _mha_weights_off(
    module: nn.Module,
    state: _State,
    query,
    key,
    value,
    key_padding_mask=None,
    need_weights=True,
    attn_mask=None,
    average_attn_weights=True,
    is_causal=False,
):
    out = state.original(
        query,
        key,
        value,
        key_padding_mask=key_padding_mask,
        need_weights=False,
        attn_mask=attn_mask,
        average_attn_weights=average_attn_weights,
        is_causal=is_causal,
    )
    return out[0], None


def _check_encoder_layer(module: nn.Module) -> str | None:
    problem = _signature_problem(type(module).forward, _ENCODER_PARAMS, "TransformerEncoderLayer.forward")
    expected = {
        "linear1": nn.Linear,
        "linear2": nn.Linear,
        "dropout": nn.Dropout,
        "dropout1": nn.Dropout,
        "dropout2": nn.Dropout,
    }
    if problem is None and module.linear2.bias is None:
        problem = "its linear2 has no bias"
    return problem or _types(module, expected)


def _encoder_layer(
    module: nn.Module, state: _State, src, src_mask=None, src_key_padding_mask=None, is_causal=False
):
    if not module.training:  # evaluation may take torch's fused fast path: the original decides
        return state.original(src, src_mask, src_key_padding_mask, is_causal)

    def attention(x: torch.Tensor) -> torch.Tensor:
        return module.self_attn(
            x,
            x,
            x,
            attn_mask=src_mask,
            key_padding_mask=src_key_padding_mask,
            need_weights=False,
            is_causal=is_causal,
        )[0]

    def feed_forward(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = module.dropout(module.activation(module.linear1(x)))
        return _linear_dropout_add(module.linear2, h, residual, module.dropout2.p, True)

    from opadvisor.kernels import bias_dropout_add

    x = src
    if module.norm_first:
        x = bias_dropout_add(attention(module.norm1(x)), None, x, module.dropout1.p, True)
        return feed_forward(module.norm2(x), x)
    x = module.norm1(bias_dropout_add(attention(x), None, x, module.dropout1.p, True))
    return module.norm2(feed_forward(x, x))


def _check_linear(module: nn.Module) -> str | None:
    if type(module) is not nn.Linear:
        return "a subclass of nn.Linear (wrapped or replaced)"
    if module.in_features % 8 == 0 and module.out_features % 8 == 0:
        return _NOTHING_TO_GAIN
    return _no_hooks(module)


def _padded_linear(module: nn.Module, state: _State, input):
    if not _linear.should_pad(input):
        return F.linear(input, module.weight, module.bias)
    from opadvisor.kernels import padded_linear

    return padded_linear(input, module.weight, module.bias)
