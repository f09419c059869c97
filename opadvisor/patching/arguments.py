"""The attention's arguments and its KV cache.

transformers 5.24 renamed the attention forwards' `past_key_values` to `cache` (same position) and hands the
forward's **kwargs on to `cache.update`; a replacement reads the call by the installed class's names and finds
the cache by its type, under whichever name."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import opadvisor.kernels as kernels


@functools.cache
def _parameter_names(function: Callable[..., Any]) -> tuple[str, ...]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(n for n, p in inspect.signature(function).parameters.items() if p.kind in kinds)


def _named_parameters(function: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of a forward that are not its **kwargs (those the caller may pass by name)."""
    return _parameter_names(function)


# Under torch.compile a constant of the trace (what `torch.compiler.assume_constant_result` marks, set directly as
# kernels/_dispatch.py does): dynamo would otherwise trace through the cache and inspect.signature, and warn.
_named_parameters._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _arguments(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, positional ones named as the module's class names them."""
    names = _named_parameters(type(module).forward)[1:]  # without self
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _kv_cache(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The transformers KV cache (a `transformers.cache_utils.Cache`) among a call's arguments, by position
    or under any name, or None. (An empty DynamicCache is falsy: compared with None, never tested for truth.)"""
    return next((v for v in (*args, *kwargs.values()) if kernels.is_kv_cache(v)), None)


def _update_cache(module: nn.Module, cache: Any, k: torch.Tensor, v: torch.Tensor, arguments: dict[str, Any]):
    """(keys, values) after the original's `cache.update` for this layer: the self-attention half of an
    encoder-decoder cache; where the class names it `cache` (5.24), with its **kwargs passed as `kwargs=`."""
    named = _named_parameters(type(module).forward)
    layer_cache = getattr(cache, "self_attention_cache", cache)
    if "cache" not in named:
        return layer_cache.update(k, v, module.layer_idx)
    extra = {n: a for n, a in arguments.items() if n not in named and a is not cache}
    return layer_cache.update(k, v, module.layer_idx, kwargs=extra)
