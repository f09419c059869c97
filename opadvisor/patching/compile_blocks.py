"""compile_blocks (asked for by name only): the model's repeated library blocks each run one forward compiled
by torch.compile (`opadvisor.kernels.compile_region`), shared by all instances of the class; a compile that
fails gives every instance its original forward back and installs the patches left out inside them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from opadvisor.kernels import region as _region
from opadvisor.libraries import TORCH_BLOCKS, repeated_blocks

from .arguments import _kv_cache
from .install import _install, _report_left, _restore
from .report import PatchReport
from .shared import STATE, _is_library, _Patcher, _qualified, _State

# -- repeated library blocks, compiled (compile_blocks) ----------------------------------------------------------
# torch.compile's options for the blocks' forward (the tests pass a backend that counts the graphs it gets)
BLOCK_COMPILE_OPTIONS: dict[str, Any] = {}


@dataclass
class _BlockGroup:
    """The compiled instances of one block class in one `patch`: they share one `compile_region` of the
    class's forward, so dynamo, whose cache is keyed by the code, traces it once for all of them."""

    forward: Callable[..., Any]  # compile_region(cls.forward): called as forward(module, *args, **kwargs)
    # (group) -> the fixes it installed: the patches left out inside these blocks, for when they fall back
    install_parts: Callable[[_BlockGroup], list[str]]
    modules: list[nn.Module] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # the modules' paths in the model
    fell_back: bool = False


def _check_block(module: nn.Module) -> str | None:
    if "forward" in module.__dict__:
        return "its forward was replaced on the instance (by another tool): left as it is"
    for path, sub in module.named_modules():
        if sub is not module and STATE in sub.__dict__:
            return (
                f"its {path} is patched already ({sub.__dict__[STATE].fix}): call opadvisor.patch once with "
                "every rule (or unpatch first)"
            )
    return None


def _compiled_block(module: nn.Module, state: _State, *args, **kwargs):
    group: _BlockGroup = state.shared
    if group.fell_back:
        return state.original(*args, **kwargs)
    cache = _kv_cache(args, kwargs)
    if cache is not None:
        reason = (
            f"a KV cache ({type(cache).__name__}) is passed to each block (use_cache=True while training): "
            "each block updates it at its own layer index, so a compiled forward would recompile per layer and "
            "run uncompiled past dynamo's limit; call the model with use_cache=False to compile them"
        )
        _block_fallback(group, reason, warn=True)
        return state.original(*args, **kwargs)
    out = group.forward(module, *args, **kwargs)
    status, error = _region.region_state(group.forward)
    if status == _region.FAILED and not group.fell_back:
        _block_fallback(group, f"torch.compile failed ({error})")
    return out


def _block_fallback(group: _BlockGroup, reason: str, *, warn: bool = False) -> None:
    """The blocks cannot run compiled (compile failed: compile_region has printed the one line; or `reason`):
    every instance of the group gets its original forward back, the patches left out inside them are
    installed, and the report says so (with `warn`, a warning too)."""
    group.fell_back = True
    for module in group.modules:
        state = module.__dict__.get(STATE)
        if state is not None and state.shared is group:
            _restore(module)
            _report_left(state, f"{reason}: runs its original forward")
    parts = group.install_parts(group)
    if warn and group.modules:
        name = type(group.modules[0]).__name__
        also = f"; patched inside them instead: {', '.join(parts)}" if parts else ""
        warnings.warn(
            f"opadvisor.patch: {name} x{len(group.modules)} not compiled (compile_blocks): {reason}{also}",
            RuntimeWarning,
            stacklevel=4,
        )


def _library_class(cls: type) -> bool:
    return _qualified(cls) in TORCH_BLOCKS or _is_library(cls)


def _compile_blocks(
    model: nn.Module,
    patcher: _Patcher,
    check: bool,
    report: PatchReport,
    install_parts: Callable[[_BlockGroup], list[str]],
) -> dict[str, str]:
    """Install compile_blocks on each of the model's repeated library blocks; returns those compiled
    ({path: qualified class}). `install_parts`: what a group that falls back calls (engine._install_parts)."""
    classes = {path: type(m) for path, m in model.named_modules()}
    found = repeated_blocks(
        {path: _qualified(cls) for path, cls in classes.items()},
        lambda q: _library_class(_class_named(classes, q)),
    )
    if not found:
        report.left.append(
            ("", _qualified(type(model)), "compile_blocks: the model has no repeated library block (a library "
             "class holding modules, with two or more instances)")
        )  # fmt: skip
    groups: dict[type, _BlockGroup] = {}
    compiled = {}
    for path, qualified in found.items():
        module = model.get_submodule(path)
        reason = _check_block(module) if STATE not in module.__dict__ else "already patched"
        if reason is not None:
            report.left.append((path, qualified, reason))
            continue
        cls = type(module)
        group = groups.get(cls)
        if group is None:
            forward = _region.compile_region(cls.forward, **BLOCK_COMPILE_OPTIONS)
            group = groups[cls] = _BlockGroup(forward, install_parts)
        _install(module, path, patcher, check, report)
        module.__dict__[STATE].shared = group
        group.modules.append(module)
        group.paths.append(path)
        report.patched.append((path, qualified, patcher.fix.name))
        compiled[path] = qualified
    return compiled


def _class_named(classes: dict[str, type], qualified: str) -> type:
    return next(cls for cls in classes.values() if _qualified(cls) == qualified)
