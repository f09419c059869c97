"""One libcst metadata wrapper per parsed source, shared by every codemod that runs on it.

libcst resolves a codemod's metadata (positions, scopes, qualified names, parents) on a wrapper of its own
at every run: on a 4,000-line model file that is most of a rule's time, and `apply --rule all` runs every
rule's codemod on the same text, two or three times each (the rewrite, the static pass of the stability
check, `suggest`'s dry run). Here the source is parsed once (memoised by its bytes, a few at a time) and its
module gets one wrapper whose resolved providers every later codemod reuses: libcst's trees are immutable,
so a codemod returns a new tree and leaves the wrapper's module, and what was computed on it, as it was.
"""

from __future__ import annotations

from collections import OrderedDict

import libcst as cst
from libcst.metadata import MetadataWrapper

from opadvisor.rewrite import _relevance

_KEEP = 4  # sources kept: a rule's before and after, and the next rule's
_BY_SOURCE: OrderedDict[bytes, MetadataWrapper] = OrderedDict()


def parse(source: bytes) -> cst.Module:
    """The module of `source`, parsed once while it is among the last few parsed (raises as parse_module)."""
    wrapper = _BY_SOURCE.get(source)
    if wrapper is None:
        wrapper = MetadataWrapper(cst.parse_module(source), unsafe_skip_copy=True)
        _BY_SOURCE[source] = wrapper
        while len(_BY_SOURCE) > _KEEP:
            _BY_SOURCE.popitem(last=False)
    else:
        _BY_SOURCE.move_to_end(source)
    return wrapper.module


def source_of(module: cst.Module) -> bytes | None:
    """The text `parse` parsed `module` from, while it is kept; None for any other module."""
    return next((source for source, w in _BY_SOURCE.items() if w.module is module), None)


def text(module: cst.Module) -> bytes:
    """The module's code: the text it was parsed from where `parse` kept it (no code generated again)."""
    source = source_of(module)
    return source if source is not None else module.bytes


def text_naming(module: cst.Module) -> bytes:
    """A text that names every word `module` names, for a search by words: its source (for a slim module,
    the whole source it was cut from, which names more), without generating code where one is kept."""
    for (source, _), hit in _SLIM.items():
        if hit is not None and hit[0].module is module:
            return source
    return text(module)


def wrapper_for(module: cst.Module) -> MetadataWrapper:
    """The shared wrapper of a module `parse` or `slim` returned; a new one (libcst's own way) for any other."""
    slims = (hit[0] for hit in reversed(_SLIM.values()) if hit is not None)
    for wrapper in (*reversed(_BY_SOURCE.values()), *slims):
        if wrapper.module is module:
            return wrapper
    return MetadataWrapper(module)


def resolved(module: cst.Module) -> bool:
    """Whether the shared wrapper of this parsed module has resolved metadata already (a pass over the
    whole module then costs no more than one over a slim one)."""
    wrapper = next((w for w in _BY_SOURCE.values() if w.module is module), None)
    return wrapper is not None and bool(wrapper._metadata)  # noqa: SLF001 - libcst keeps what it resolved there


_SLIM: OrderedDict[tuple[bytes, tuple[str, ...]], tuple[MetadataWrapper, dict[int, cst.CSTNode]] | None] = (
    OrderedDict()
)


def slim(source: bytes, words: tuple[str, ...]) -> tuple[cst.Module, dict[int, cst.CSTNode]] | None:
    """`_relevance.slim_module` of the parsed `source` for these words, with a wrapper of its own shared by
    every pass with the same words over the same text (a rule's pass and its stability check's); None
    where slimming saves little."""
    key = (source, words)
    if key not in _SLIM:
        found = _relevance.slim_module(parse(source), words, source)
        _SLIM[key] = None if found is None else (MetadataWrapper(found[0], unsafe_skip_copy=True), found[1])
        while len(_SLIM) > 4 * _KEEP:
            _SLIM.popitem(last=False)
    else:
        _SLIM.move_to_end(key)
    hit = _SLIM[key]
    return None if hit is None else (hit[0].module, hit[1])
