"""A transformers model file copied into the user's project: transformers 5 does not initialise it alike.

transformers 5 counts a `PreTrainedModel` whose module lies outside `transformers.` as custom code
(`is_custom_code()`), and for custom code its weight initialisation skips `_init_weights` on every module
whose own parameters are all marked initialised, which a module with no parameters of its own passes
vacuously: what `_init_weights` sets from such a container never runs. A copied `modeling_t5.py` then keeps
std 1.0 in T5's attention and feed-forward weights (it trains to nan in mixed precision), a copied GPT-2 its
residual projections unscaled (RESULTS.md, thirteenth session). Nothing fails: the user's model is just not
the one the installed class builds. `profile` says so once, with the one-line fix.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

__all__ = ["vendored_transformers_words"]


def vendored_transformers_words(cls: type) -> str | None:
    """A warning when `cls` (the model the script calls) is a transformers model defined in a copy of one
    of transformers' own modeling files, registered neither as remote code; else None."""
    is_custom = getattr(cls, "is_custom_code", None)
    is_remote = getattr(cls, "is_remote_code", None)
    if not callable(is_custom) or not callable(is_remote) or cls.__module__.startswith("transformers."):
        return None
    try:
        if not is_custom() or is_remote():
            return None
    except Exception:  # a model class whose checks need an instance or a config: say nothing
        return None
    try:
        file = inspect.getfile(cls)
    except (TypeError, OSError):
        return None
    copied = _transformers_original(file)
    if copied is None:
        return None
    base = _pretrained_base(cls)
    return (
        f"{cls.__name__} comes from a copy of transformers' {copied}: transformers treats it as custom code and "
        "skips part of its weight initialisation (modules without parameters of their own), so its weights "
        f"do not start as the installed {cls.__name__}'s. Import the model from transformers, or add after "
        f"the classes: `{base}.is_custom_code = classmethod(lambda cls: cls.is_remote_code())`"
    )


def _transformers_original(file: str | None) -> str | None:
    """`models/bert/modeling_bert.py` when the installed transformers has a file of that name."""
    if not file or not Path(file).name.startswith("modeling_"):
        return None
    transformers = sys.modules.get("transformers")
    root = Path(getattr(transformers, "__file__", "") or "").parent
    name = Path(file).name
    candidate = root / "models" / name.removeprefix("modeling_").removesuffix(".py") / name
    return str(candidate.relative_to(root)) if candidate.is_file() else None


def _pretrained_base(cls: type) -> str:
    """The copied file's own PreTrainedModel class (`BertPreTrainedModel`), the one the fix goes on."""
    for klass in cls.__mro__:
        if klass.__module__ == cls.__module__ and klass.__name__.endswith("PreTrainedModel"):
            return klass.__name__
    return cls.__name__
