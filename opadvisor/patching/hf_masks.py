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

A causal model called without position_ids builds its own (0, 1, 2, ...), and transformers then looks for
sequences packed into one row (`find_packed_sequence_indices`): under tracing it cannot look, and ANDs a packed-
sequence mask into the causal one, so the mask is built and SDPA computes every block of the scores where
causal attention skips half (GPT-2 124M on an H200, under torch.compile or CUDA graphs: cuDNN's attention 6.6 ms
a step instead of 3.1). While a switched model runs such a call (`own_positions`), the search answers "not
packed" (None) without looking: positions the model counted itself are never packed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

NAME = "opadvisor_sdpa"

# > 0 while a switched model runs a call whose positions it counts itself. A list, not a contextvar or a
# threading.local: torch.compile traces its mutation and the reads in `_find_packed` (a call in flight in another
# thread would see it too; training runs one model call at a time per process).
_OWN_POSITIONS = [0]


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
    _MASKING_UTILS[0] = masking_utils
    AttentionInterface.register(NAME, sdpa_attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, _sdpa_mask)
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is not None and not getattr(find, "_opadvisor", False):
        masking_utils.find_packed_sequence_indices = _find_packed(find)
    return NAME


def _find_packed(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' find_packed_sequence_indices, answering None (not packed) inside `own_positions`;
    transformers' own answer everywhere else."""

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        if _OWN_POSITIONS[0]:
            return None
        return original(position_ids)

    find_packed_sequence_indices._opadvisor = True  # type: ignore[attr-defined]
    return find_packed_sequence_indices


@contextlib.contextmanager
def own_positions(counted_by_the_model: bool) -> Iterator[None]:
    """Around a switched model's call: where the caller passed no positions (`counted_by_the_model`), the
    packed-sequence search answers None (see the module)."""
    if not counted_by_the_model:
        yield
        return
    _OWN_POSITIONS[0] += 1
    try:
        yield
    finally:
        _OWN_POSITIONS[0] -= 1


# transformers.masking_utils, kept by `register`: an import inside `_sdpa_mask` broke torch.compile's graph
# (torch 2.11's dynamo: "Import result is not a Python module" for transformers' lazy package)
_MASKING_UTILS: list[Any] = [None]


def _sdpa_mask(**kwargs: Any) -> Any:
    """transformers' sdpa_mask, or None where no token is padded and the pattern is plain (see the module)."""
    masking_utils = _MASKING_UTILS[0]
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
