"""`patch` / `unpatch` / `patch_report`: the walk over a model's modules. Each module whose class a patcher of
the registry (`registry.PATCHERS`, read at each call) knows, and whose check passes, is installed
(install.py); compile_blocks' blocks first, the modules inside them reported as left; what was patched and
left is the model's `PatchReport`."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch.nn as nn

from opadvisor.libraries import block_of

from . import registry
from .compile_blocks import _BlockGroup, _compile_blocks
from .hf_switch import _hf_switch_roots, _inner_hf_roots, _own_attention_patch
from .install import _install, _restore
from .report import PatchReport, _short
from .shared import _NOTHING_TO_GAIN, STATE, _is_library, _Patcher, _qualified

__all__ = ["PatchReport", "patch", "patch_report", "unpatch"]

REPORT = "_opadvisor_patch_report"  # the model's PatchReport (an entry in its __dict__)

# Library classes whose name says they are a model block: an unrecognised one is reported by name.
_BLOCK_WORDS = ("Attention", "MLP", "SelfOutput", "FeedForward", "EncoderLayer", "DecoderLayer")


# ---- patch / unpatch -------------------------------------------------------------------------------------------
def patch(
    model: nn.Module,
    rules: Sequence[str] | None = None,
    *,
    unsafe: bool = False,
    check: bool = True,
    quiet: bool = False,
) -> nn.Module:
    """Replace, per instance, the forward of every module of `model` opadvisor recognises with a fused
    equivalent (see opadvisor.patching's docstring); returns `model` itself.

    rules: only the replacements that fix these rules' findings (`sdpa_attention`, `fused_softmax`,
        `fused_dropout_add`, `gemm_align`, ...) or these fix names (opadvisor/libraries.py); None: all.
    unsafe: also the replacements labelled unsafe (they change what a caller can observe).
    check: compare each replacement with the original on its first call (False: trust it).
    quiet: do not print the report (`patch_report(model)` returns it either way).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"opadvisor.patch expects a torch.nn.Module, got {type(model).__name__}")
    patchers = _selected(rules, unsafe)
    report = PatchReport(type(model).__name__)
    blocks_patcher = next((p for p in patchers if p.fix.name == "compile_blocks"), None)
    asked = rules is not None or unsafe
    install_parts = functools.partial(
        _install_parts, patchers=patchers, check=check, report=report, asked=asked
    )
    blocks = _compile_blocks(model, blocks_patcher, check, report, install_parts) if blocks_patcher else {}
    hf_roots = set(_hf_switch_roots(model))
    for path, module in model.named_modules():
        block = block_of(path, blocks)
        if block is not None:
            _left_in_block(module, path, patchers, blocks[block], report)
            continue
        _patch_one(module, path, patchers, check, report, asked, hf_roots)
    _drop_known_containers(report)
    model.__dict__[REPORT] = report
    if not quiet:
        print(str(report), file=sys.stderr)
    return model


def _drop_known_containers(report: PatchReport) -> None:
    """An unknown block whose parts opadvisor knows (BertAttention holding BertSelfAttention and
    BertSelfOutput, GPT2MLP holding its activation) is a container, not an unknown architecture."""
    known = [path for path, _, _ in report.patched] + [
        path for path, _, reason in report.left if not reason.startswith("unknown architecture")
    ]

    def inside(path: str, other: str) -> bool:
        return other.startswith(path + ".") if path else bool(other)

    report.left = [
        entry
        for entry in report.left
        if not (entry[2].startswith("unknown architecture") and any(inside(entry[0], k) for k in known))
    ]


def _selected(rules: Sequence[str] | None, unsafe: bool) -> list[_Patcher]:
    if isinstance(rules, str):
        rules = [rules]
    patchers = registry.PATCHERS  # read at each call: the tests swap it
    if rules is not None:
        known = {r for p in patchers for r in p.fix.rules} | {p.fix.name for p in patchers}
        unknown = [r for r in rules if r not in known]
        if unknown:
            raise ValueError(
                f"opadvisor.patch: unknown rule(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
    chosen = []
    for p in patchers:
        if p.fix.opt_in and (rules is None or p.fix.name not in rules):
            continue  # compile time: only where asked for by name
        if rules is not None and p.fix.name not in rules and not set(p.fix.rules) & set(rules):
            continue
        if p.fix.safety == "unsafe" and not unsafe:
            continue
        chosen.append(p)
    return chosen


def _patch_one(
    module: nn.Module,
    path: str,
    patchers: list[_Patcher],
    check: bool,
    report: PatchReport,
    asked: bool,
    hf_roots: set[int] | None = None,
) -> None:
    qualified = _qualified(type(module))
    candidates = [p for p in registry.PATCHERS if qualified in p.fix.classes]
    switch = next((p for p in patchers if p.fix.name == "hf_attn_switch"), None)
    if switch is not None and hf_roots is not None and id(module) in hf_roots:  # the model as a whole
        if any(p in patchers for p in candidates):
            # a patch of the root's own class (a causal-LM loss) takes its forward: the switch goes to the
            # transformers model inside (LlamaModel; it shares the config, so the attention is the same),
            # unless opadvisor patches an attention that cannot run under the switch (GPT-2)
            if _own_attention_patch(module) is None:
                hf_roots.update(_inner_hf_roots(module))
        else:
            candidates.append(switch)
    if STATE in module.__dict__:
        report.left.append((path, qualified, f"already patched ({module.__dict__[STATE].fix})"))
        return
    usable = [p for p in candidates if p in patchers]
    # the first refusal's reason: reported whether a later fix takes the module or not
    refused: str | None = None
    for patcher in usable:
        reason = patcher.check(module)
        if reason is None:
            _install(module, path, patcher, check, report)
            report.patched.append((path, qualified, patcher.fix.name))
            if refused is not None:
                report.left.append((path, qualified, f"{refused} ({patcher.fix.name} patched it instead)"))
            return
        if reason != _NOTHING_TO_GAIN and refused is None:
            # the next fix in the order of preference may still apply (an unsafe fused LM head refused: the safe
            # loss patch)
            refused = f"{patcher.fix.name}: {reason}" if len(usable) > 1 else reason
    if refused is not None:
        report.left.append((path, qualified, refused))
        return
    if candidates and not usable and asked:
        names = ", ".join(p.fix.name for p in candidates)
        report.left.append(
            (path, qualified, f"not selected ({names}: by rules, or unsafe without unsafe=True)")
        )
    elif not candidates and _looks_like_a_block(module):
        report.left.append((path, qualified, f"unknown architecture: opadvisor has no patch for {qualified}"))


_INSIDE_BLOCK = "inside a compiled"  # how `_left_in_block` reports a module it leaves


def _left_in_block(
    module: nn.Module, path: str, patchers: list[_Patcher], block: str, report: PatchReport
) -> None:
    """A module inside (or being) a compiled block keeps its forward: the patches' first-call check cannot
    run under torch.compile, and the ops they fuse by hand inductor fuses there with their neighbours."""
    qualified = _qualified(type(module))
    names = [p.fix.name for p in patchers if qualified in p.fix.classes and p.check(module) is None]
    if names:
        fuses = "(compile_blocks: torch.compile fuses its ops)"
        reason = f"{_INSIDE_BLOCK} {_short(block)} {fuses}, not {', '.join(names)}"
        report.left.append((path, qualified, reason))


def _install_parts(
    group: _BlockGroup, *, patchers: list[_Patcher], check: bool, report: PatchReport, asked: bool
) -> list[str]:
    """After the blocks of `group` fell back: install the patches `_left_in_block` left out inside them;
    returns the fixes installed, as "fix xN"."""
    installed: dict[str, int] = {}
    for block, block_path in zip(group.modules, group.paths, strict=True):
        for sub_path, module in block.named_modules():
            if not sub_path:
                continue  # the block itself
            path = f"{block_path}.{sub_path}"
            report.left[:] = [e for e in report.left if not (e[0] == path and e[2].startswith(_INSIDE_BLOCK))]
            before = len(report.patched)
            _patch_one(module, path, patchers, check, report, asked)
            for _, _, fix in report.patched[before:]:
                installed[fix] = installed.get(fix, 0) + 1
    return [f"{fix} x{n}" for fix, n in installed.items()]


def _looks_like_a_block(module: nn.Module) -> bool:
    cls = type(module)
    package = cls.__module__.split(".", 1)[0]
    return package not in ("torch", "__main__") and cls.__name__.endswith(_BLOCK_WORDS) and _is_library(cls)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `patch` on every module of `model`: each original forward back, exactly; returns `model`."""
    for module in model.modules():
        if STATE in module.__dict__:
            _restore(module)
    model.__dict__.pop(REPORT, None)
    return model


def patch_report(model: nn.Module) -> PatchReport | None:
    """What the last `patch(model)` did (None when it was never patched, or was unpatched since)."""
    return model.__dict__.get(REPORT)
