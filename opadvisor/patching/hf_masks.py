"""transformers' SDPA attention under opadvisor's name, with masks that skip themselves under tracing too.

transformers builds no attention mask where no token is padded (SDPA then runs flash attention, causal by its
flag), but only where it may look at the mask: under torch.compile and inside a CUDA-graph capture it builds the
full [batch, 1, queries, keys] mask, causal or all True, and SDPA takes the slower path a mask needs (BERT-base,
all of opadvisor's fixes replayed from CUDA graphs on an H200: 51.6 ms a step with the all-True mask, float32
GEMMs and mask additions the eager step does not run; 24.4 ms without it).

`opadvisor_sdpa` is transformers' own SDPA attention function and its own SDPA mask function, registered under
another name, except that a call with no padding mask and the plain causal (no cache offset) or bidirectional
pattern gets no mask whatever is tracing. transformers keeps the mask under tracing for torch.export, whose
graph would keep `is_causal` for every later input; under torch.compile a call with a padding mask is another
graph (dynamo guards on it), and a CUDA graph is captured per input signature.
"""

from __future__ import annotations

import functools
from typing import Any

NAME = "opadvisor_sdpa"


@functools.cache
def register() -> str | None:
    """Register NAME with transformers' attention and mask interfaces (once); None where this transformers has
    no such interfaces (then there is nothing to switch to)."""
    try:
        from transformers import masking_utils
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        return None
    if not hasattr(masking_utils, "AttentionMaskInterface") or not hasattr(masking_utils, "sdpa_mask"):
        return None
    AttentionInterface.register(NAME, sdpa_attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, _sdpa_mask)
    return NAME


def _sdpa_mask(**kwargs: Any) -> Any:
    """transformers' sdpa_mask, or None where no token is padded and the pattern is plain (see the module)."""
    from transformers import masking_utils

    if _needs_no_mask(kwargs, masking_utils):
        return None
    return masking_utils.sdpa_mask(**kwargs)


def _needs_no_mask(kwargs: dict[str, Any], masking_utils: Any) -> bool:
    if kwargs.get("attention_mask") is not None:
        return False
    if kwargs.get("local_size") is not None or kwargs.get("local_attention_size") is not None:
        return False
    pattern = kwargs.get("mask_function")
    if pattern is masking_utils.causal_mask_function:  # is_causal=True is upper-left aligned: no offset
        square = kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("q_offset", 0)
        return bool(kwargs.get("allow_is_causal_skip", True)) and square and not kwargs.get("kv_offset", 0)
    if pattern is getattr(masking_utils, "bidirectional_mask_function", None):
        return bool(kwargs.get("allow_is_bidirectional_skip", False))
    return False
