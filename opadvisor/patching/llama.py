"""The Llama family (Llama, Mistral, Qwen2/3 and the classes `opadvisor.libraries.llama_family_classes` lists):
RMSNorm as `opadvisor.kernels.rms_norm` (hf_rms_norm), the SwiGLU MLP's `act(gate(x)) * up(x)` as
`opadvisor.kernels.silu_mul` (hf_swiglu_mlp), the attention's rotary embedding as
`opadvisor.kernels.rotary_embedding` (hf_llama_rope). The causal-LM loss is lm_loss's."""

from __future__ import annotations

import sys

import torch.nn as nn

from opadvisor.kernels import autocast_linear, autocast_shared, casts

from .arguments import _arguments, _kv_cache, _named_parameters, _update_cache
from .fingerprint import _fingerprint_problem
from .shared import CalledLinear, _no_hooks, _State, _types


# -- the Llama family: RMSNorm, SwiGLU MLP, the attention's rotary embedding ---------------------------------------
def _llama_prefix(cls: type, block: str) -> str:
    return cls.__name__[: -len(block)]


def _check_rms_norm(module: nn.Module) -> str | None:
    cls = type(module)
    problem = _fingerprint_problem(cls, "LlamaRMSNorm.forward", cls.forward, _llama_prefix(cls, "RMSNorm"))
    weight = getattr(module, "weight", None)
    if problem is None and not (isinstance(weight, nn.Parameter) and weight.dim() == 1):
        problem = "its weight is not a 1-d parameter"
    if problem is None and not isinstance(getattr(module, "variance_epsilon", None), float):
        problem = "its variance_epsilon is not a float"
    return problem or _no_hooks(module)


def _rms_norm(module: nn.Module, state: _State, hidden_states):
    from opadvisor.kernels import rms_norm  # looked up at call time, as bias_dropout_add

    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _silu_problem(act: nn.Module) -> str | None:
    """None when the MLP's activation is SiLU: nn.SiLU, or transformers' SiLUActivation (F.silu)."""
    if type(act) is nn.SiLU:
        return None if not act.inplace else "its activation is an in-place nn.SiLU"
    if type(act).__name__ != "SiLUActivation":
        return f"its activation is {type(act).__name__}, not SiLU (the kernel is silu(gate) * up)"
    return _fingerprint_problem(type(act), "SiLUActivation.forward", type(act).forward, None) or _no_hooks(
        act
    )


def _check_swiglu_mlp(module: nn.Module) -> str | None:
    cls = type(module)
    problem = _fingerprint_problem(cls, "LlamaMLP.forward", cls.forward, _llama_prefix(cls, "MLP"))
    problem = problem or _silu_problem(getattr(module, "act_fn", None))
    linears = {"gate_proj": CalledLinear, "up_proj": CalledLinear, "down_proj": CalledLinear}
    return problem or _types(module, linears) or _no_hooks(module)


def _swiglu_mlp(module: nn.Module, state: _State, x):
    from opadvisor.kernels import silu_mul, silu_mul_linear

    gx, ux = autocast_shared(x, 2)  # one 16-bit copy for the gate and up projections
    gate, up = _project(module.gate_proj, gx), _project(module.up_proj, ux)
    down = module.down_proj
    if type(down) is not nn.Linear:  # an adapter (LoRA) or a quantized layer: called, its weight never read
        return down(silu_mul(gate, up))
    # the down projection's input, silu_mul's output, is computed again in backward, not kept
    return silu_mul_linear(gate, up, down.weight, down.bias)


def _project(linear: nn.Module, x):
    """`linear(x)`; for a plain nn.Linear with `opadvisor.kernels.casts.WEIGHT_GRAD_F32`, its weight's gradient
    written in float32 by the product (autocast_linear; the check at patch time found no hooks on it)."""
    if casts.WEIGHT_GRAD_F32 and type(linear) is nn.Linear:
        return autocast_linear(x, linear.weight, linear.bias)
    return linear(x)


def _check_llama_attention(module: nn.Module) -> str | None:
    cls = type(module)
    namespace = sys.modules.get(cls.__module__)
    problem = _fingerprint_problem(
        cls, "LlamaAttention.forward", cls.forward, _llama_prefix(cls, "Attention")
    )
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        problem = problem or _fingerprint_problem(cls, name, getattr(namespace, name, None), None)
    linears = {"q_proj": CalledLinear, "k_proj": CalledLinear, "v_proj": CalledLinear, "o_proj": CalledLinear}
    return problem or _types(module, linears) or _no_hooks(module)


def _llama_attention(module: nn.Module, state: _State, hidden_states, *args, **kwargs):
    """LlamaAttention.forward with the rotary embedding as one kernel per tensor (q, k)."""
    from opadvisor.kernels import rotary_embedding

    arguments = _arguments(module, (hidden_states, *args), kwargs)
    position_embeddings = arguments.get("position_embeddings")
    if position_embeddings is None:
        return state.original(hidden_states, *args, **kwargs)
    namespace = sys.modules[type(module).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    qx, kx, vx = autocast_shared(hidden_states, 3)  # one 16-bit copy for the three projections
    q = _project(module.q_proj, qx).view(hidden_shape).transpose(1, 2)
    k = _project(module.k_proj, kx).view(hidden_shape).transpose(1, 2)
    v = _project(module.v_proj, vx).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rotary_embedding(q, cos, sin), rotary_embedding(k, cos, sin)
    cache = _kv_cache(args, kwargs)
    if cache is not None:
        k, v = _update_cache(module, cache, k, v, arguments)
    named = _named_parameters(type(module).forward)
    extra = {n: a for n, a in arguments.items() if n not in named}  # the forward's **kwargs
    attention = namespace.ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, namespace.eager_attention_forward
    )
    out, weights = attention(
        module,
        q,
        k,
        v,
        arguments.get("attention_mask"),
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **extra,
    )
    return _project(module.o_proj, out.reshape(*input_shape, -1).contiguous()), weights
