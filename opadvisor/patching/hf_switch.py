"""hf_attn_switch: transformers' own attention switch, set per instance at the first call, to its SDPA
attention under opadvisor's name (`hf_masks`); installed on the outermost transformers models
(`_hf_switch_roots`), never where opadvisor's own attention patch needs the eager attention."""

from __future__ import annotations

import sys

import torch.nn as nn

from opadvisor.libraries import HF_ATTENTION_CLASSES, bert_family_classes, deberta_v2_class

from . import hf_masks as _hf_masks
from .arguments import _arguments
from .shared import _no_hooks, _qualified, _State

# -- transformers' attention switch, per instance (hf_attn_switch) ----------------------------------------------
# A model built with a computed attn_implementation (`from_pretrained(..., attn_implementation=args.attn)`)
# that ran "eager": apply cannot write the literal, so the patch sets transformers' own switch on this
# instance at its first call, after running both attentions on that call and comparing them. Installed on the
# outermost transformers model only (a ForCausalLM, not the LlamaModel inside it, which shares its config), or,
# where a patch of that model's own class takes its forward (a causal-LM loss), on the models inside it.


def _hf_switch_roots(model: nn.Module) -> frozenset[int]:
    """ids of the outermost transformers models in `model` (parents come before children in modules())."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return frozenset()
    base = transformers.PreTrainedModel
    roots: set[int] = set()
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, base) and id(module) not in inside:
            roots.add(id(module))
            inside.update(id(sub) for sub in module.modules() if sub is not module)
    return frozenset(roots)


# The attention classes opadvisor patches itself (DeBERTa's is not in HF_ATTENTION_CLASSES: transformers' SDPA
# switch, which that list also offers, does not exist for it)
_OWN_ATTENTION_CLASSES = frozenset({*HF_ATTENTION_CLASSES, deberta_v2_class("DisentangledSelfAttention")})


# Own attention patches that take the masks transformers builds for SDPA (bool, or None where no token is masked)
# as well as eager's float mask: the BERT family's in an encoder (a decoder's None would mean causal). Under them
# the switch still pays: transformers then builds SDPA's masks, which can be built inside a CUDA graph capture;
# the eager mask of transformers <= 5.17 cannot (`torch.tensor(0.0, device=...)`, a host-to-device copy).
_TAKES_SDPA_MASKS = frozenset(bert_family_classes("SelfAttention"))


def _own_attention_patch(module: nn.Module) -> str | None:
    """The name of the first attention class under `module` that opadvisor has its own patch for and that
    cannot run under the switch (a causal one, or one that needs eager's float mask), or None."""
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return None  # opadvisor's own attention patches replace the eager attention only
    decoder = bool(getattr(config, "is_decoder", False))
    return next(
        (
            type(m).__name__
            for m in module.modules()
            if _qualified(type(m)) in _OWN_ATTENTION_CLASSES
            and (decoder or _qualified(type(m)) not in _TAKES_SDPA_MASKS)
        ),
        None,
    )


def _inner_hf_roots(module: nn.Module) -> frozenset[int]:
    """ids of the outermost transformers models strictly inside `module`."""
    return frozenset().union(*(_hf_switch_roots(child) for child in module.children()))


def _check_hf_switch(module: nn.Module) -> str | None:
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if attn not in _SWITCHED_FROM:
        return f'already runs attn_implementation="{attn}" (only eager and sdpa are switched)'
    if not getattr(type(module), "_supports_sdpa", False):
        return f"{type(module).__name__} does not support attn_implementation='sdpa'"
    if not type(module)._can_set_attn_implementation():
        return "its attention does not go through transformers' attention interface (no switch at run time)"
    if _hf_masks.register() is None:
        return (
            "this transformers has no attention and mask interfaces to register opadvisor's SDPA masks with"
        )
    own = _own_attention_patch(module)
    if own is not None:
        return (
            f"its {own} has opadvisor's own attention patch (hf_bert_self_attention / hf_gpt2_attention / "
            "hf_deberta_attention)"
        )
    return _no_hooks(module)


# The switch goes to transformers' SDPA attention under opadvisor's name (`hf_masks`: its masks skip themselves
# where no token is padded, under torch.compile and CUDA-graph capture too), from the eager attention or from
# transformers' own SDPA (which builds full masks there); undone to what the model ran before.
_SWITCHED_FROM = ("eager", "sdpa")
_ATTN_BEFORE = "_opadvisor_attn_before"  # the module's __dict__ key of what it ran before the switch


def _hf_switch(module: nn.Module, state: _State, *args, **kwargs):
    if module.config._attn_implementation != _hf_masks.NAME:  # once: transformers reads it at every call
        module.__dict__.setdefault(_ATTN_BEFORE, module.config._attn_implementation)
        module.set_attn_implementation(_hf_masks.NAME)
    with _hf_masks.own_positions(_counts_its_own_positions(module, args, kwargs)):
        return state.original(*args, **kwargs)


# The arguments that would give the model positions (or an offset) of the caller's: with none of them passed,
# a transformers model counts its positions from 0 itself (`cache_position` / `arange`)
_POSITION_ARGUMENTS = ("position_ids", "cache_position", "past_key_values", "cache")


def _counts_its_own_positions(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    arguments = _arguments(module, args, kwargs)
    return all(arguments.get(name) is None for name in _POSITION_ARGUMENTS)


def _hf_switch_undo(module: nn.Module) -> None:
    before = module.__dict__.pop(_ATTN_BEFORE, None)
    if before is not None and module.config._attn_implementation != before:
        module.set_attn_implementation(before)
