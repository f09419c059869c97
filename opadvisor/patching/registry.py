"""The patchers, one line each: the fix (opadvisor/libraries.py), its check, its replacement forward and, where
the forward returns more than a tensor, what the first-call check compares. The order is the order of
preference where two fixes know one class: a refused fix (its reason reported) leaves the module to
the next one. The engine reads `PATCHERS` at each call (the tests swap it)."""

from __future__ import annotations

from typing import Any

from opadvisor.libraries import FIXES, fix_by_name

from .bert import _bert_attention, _bert_output, _check_bert_attention, _check_bert_output
from .compile_blocks import _check_block, _compiled_block
from .deberta import _check_deberta_attention, _check_deberta_encoder, _deberta_attention, _deberta_encoder
from .gpt2 import _check_gelu, _check_gpt2_attention, _gelu_tanh, _gpt2_attention
from .hf_switch import _check_hf_switch, _hf_switch, _hf_switch_undo
from .llama import (
    _check_llama_attention,
    _check_rms_norm,
    _check_swiglu_mlp,
    _llama_attention,
    _rms_norm,
    _swiglu_mlp,
)
from .lm_loss import (
    _bert_mlm,
    _causal_lm,
    _check_bert_mlm,
    _check_causal_lm,
    _check_linear_cross_entropy,
    _check_mlm_linear_cross_entropy,
    _linear_cross_entropy,
    _mlm_linear_cross_entropy,
)
from .shared import _first, _first_tensor, _Patcher
from .torch_nn import (
    _check_encoder_layer,
    _check_linear,
    _check_mha,
    _encoder_layer,
    _mha_weights_off,
    _padded_linear,
)


def _p(fix: str, *parts: Any) -> _Patcher:
    """The patcher of the fix named `fix`: (check, forward[, main_output[, undo]])."""
    return _Patcher(fix_by_name(fix), *parts)


PATCHERS: tuple[_Patcher, ...] = (
    _p("hf_bert_self_attention", _check_bert_attention, _bert_attention, _first),
    _p("hf_bert_output", _check_bert_output, _bert_output),
    _p("hf_gpt2_attention", _check_gpt2_attention, _gpt2_attention, _first),
    _p("hf_deberta_attention", _check_deberta_attention, _deberta_attention, _first),
    _p("hf_deberta_positions", _check_deberta_encoder, _deberta_encoder, _first_tensor),
    _p("hf_attn_switch", _check_hf_switch, _hf_switch, _first_tensor, _hf_switch_undo),
    _p("hf_gelu_tanh", _check_gelu, _gelu_tanh),
    _p("transformer_encoder_layer", _check_encoder_layer, _encoder_layer),
    _p("mha_weights_off", _check_mha, _mha_weights_off, _first),
    _p("padded_linear", _check_linear, _padded_linear),
    _p("hf_mlm_linear_cross_entropy", _check_mlm_linear_cross_entropy, _mlm_linear_cross_entropy, _first),
    _p("hf_mlm_loss", _check_bert_mlm, _bert_mlm, _first),
    _p("hf_linear_cross_entropy", _check_linear_cross_entropy, _linear_cross_entropy, _first),
    _p("hf_causal_lm_loss", _check_causal_lm, _causal_lm, _first),
    _p("hf_rms_norm", _check_rms_norm, _rms_norm),
    _p("hf_swiglu_mlp", _check_swiglu_mlp, _swiglu_mlp),
    _p("hf_llama_rope", _check_llama_attention, _llama_attention, _first),
    _p("compile_blocks", _check_block, _compiled_block, _first_tensor),
)
# every patch fix of opadvisor/libraries.py has its patcher, and only those
assert {p.fix.name for p in PATCHERS} == {f.name for f in FIXES if f.kind == "patch"}
