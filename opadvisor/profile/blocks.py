"""The repeated blocks of a model handed to torch.compile whole: what regional compilation would compile.

A transformer is a stack of identical layers. Compiled whole, dynamo traces every layer again and the
backend compiles the whole unrolled graph; compiled one layer at a time (`layer.compile()` on each, the
"regional compilation" of PyTorch's compile-time recipe), the layers share one compiled graph, so compile
time falls roughly with the number of layers. `repeated_blocks(model)` finds that layer class when the
session sees `torch.compile(model)` (or `model.compile()`), as plain data for the `regional_compile` rule:

    {"cls": "Block", "qualified": "__main__.Block", "count": 12,
     "containers": ["blocks"],       # paths (from the compiled model) whose every child is such a block
     "singles": [],                  # paths of blocks outside such containers
     "param_share": 0.93,            # the blocks' share of the model's parameter tensors
     "variants": 1,                  # distinct graphs the blocks compile to (_variants)
     "differs": [],                  # the number attributes that differ between blocks
     "outside": ["emb", "head"]}     # the outermost modules holding no block (they run eagerly)

The block class is a class with at least two instances that has submodules of its own and is not one of
torch's modules (but nn.Transformer's layers); of several, the one whose instances hold the largest share
of the model's parameter tensors, discounted by one instance (`_score`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# torch's containers group modules: a stack of layers is their children, not them
CONTAINERS = frozenset({"ModuleList", "Sequential", "ModuleDict", "ParameterList", "ParameterDict"})
TORCH_LAYERS = "torch.nn.modules.transformer"  # nn.TransformerEncoderLayer and the like are layers
MAX_MODULES = 20_000  # bound the walk: beyond this the model is not walked (no finding)
MAX_OUTSIDE = 12  # outside modules named
MAX_PATHS = 64  # containers and singles kept (a stack of singles longer than this is listed by container)


def repeated_blocks(model: Any) -> dict[str, Any] | None:
    """The repeated block class of `model` (an nn.Module) and where its instances are; None if it has none."""
    named = _named_modules(model)
    if named is None:
        return None
    by_class: dict[type, list[str]] = defaultdict(list)
    for path, module in named.items():
        if path and _is_block(module):
            by_class[type(module)].append(path)
    repeated = {cls: paths for cls, paths in by_class.items() if len(paths) >= 2}
    if not repeated:
        return None
    total = len(_params(model))
    shares = {
        cls: len(_params(*(named[p] for p in paths))) / max(total, 1) for cls, paths in repeated.items()
    }
    cls = max(repeated, key=lambda c: (_score(shares[c], len(repeated[c])), shares[c]))
    paths = repeated[cls]
    containers, singles = _places(paths, named)
    if len(containers) + len(singles) > MAX_PATHS:
        return None
    return {
        "cls": cls.__name__,
        "qualified": f"{cls.__module__}.{cls.__qualname__}",
        "count": len(paths),
        "containers": containers,
        "singles": singles,
        "param_share": round(shares[cls], 4) if total else None,
        **_variants([named[p] for p in paths]),
        "outside": _outside(paths, named)[:MAX_OUTSIDE],
    }


def _named_modules(model: Any) -> dict[str, Any] | None:
    named: dict[str, Any] = {}
    for path, module in model.named_modules():
        if len(named) >= MAX_MODULES:
            return None
        named[path] = module
    return named


def _is_block(module: Any) -> bool:
    cls = type(module)
    if cls.__module__.startswith("torch.") and cls.__module__ != TORCH_LAYERS:
        return False  # torch's own modules (attention, containers): parts of a layer, not the layer
    return cls.__name__ not in CONTAINERS and next(module.children(), None) is not None


def _variants(blocks: list[Any]) -> dict[str, Any]:
    """How many different graphs the blocks compile to, as far as their Python numbers tell: dynamo treats a
    module's int, float and bool attributes as constants, so blocks that differ in one (a transformers
    layer's `layer_idx`, which indexes the cache; timm's per-block stochastic-depth rate; a Swin block's
    shift) compile once per distinct set of values, each a recompile of the same code, and past dynamo's
    recompile limit (8) the rest run eagerly. {"variants": distinct sets, "differs": the attributes that
    differ ("self_attn.layer_idx")}."""
    signatures = [_numbers(block) for block in blocks]
    differs = sorted({k for sig in signatures for k in sig if len({s.get(k) for s in signatures}) > 1})
    distinct = {tuple(sorted(sig.items())) for sig in signatures}
    return {"variants": len(distinct), "differs": differs[:6]}


def _numbers(block: Any) -> dict[str, Any]:
    """The block's Python-number attributes and its submodules', by path ("self_attn.layer_idx": 3)."""
    found: dict[str, Any] = {}
    for path, module in block.named_modules():
        for name, value in vars(module).items():
            if not name.startswith("_") and type(value) in (int, float, bool):
                found[f"{path}.{name}" if path else name] = value
    return found


def _score(share: float, count: int) -> float:
    """What compiling one instance for all saves, roughly: the share of the model the blocks hold, less the
    one instance still compiled (a T5's two stacks score below its 24 layers; a Llama's attention modules
    below its decoder layers, which hold them and the MLPs)."""
    return share * (1.0 - 1.0 / count)


def _outside(paths: list[str], named: dict[str, Any]) -> list[str]:
    """The outermost modules that hold no block and lie in none (an embedding, a head, a final norm)."""
    ancestors = {""}
    for path in paths:
        parts = path.split(".")
        ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    blocks = set(paths)
    return [
        p for p in named if p and p not in ancestors and p not in blocks and p.rpartition(".")[0] in ancestors
    ]


def _places(paths: list[str], named: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(containers whose every child is one of the blocks, the blocks outside such containers)."""
    blocks = set(paths)
    parents: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        parents[path.rpartition(".")[0]].append(path)
    containers, singles = [], []
    for parent, children in parents.items():
        container = named.get(parent)
        whole = (
            container is not None
            and parent
            and type(container).__name__ in ("ModuleList", "Sequential")
            and all(f"{parent}.{name}" in blocks for name, _ in container.named_children())
        )
        if whole:
            containers.append(parent)
        else:
            singles.extend(children)
    return containers, singles


def _params(*modules: Any) -> set[int]:
    """The ids of the parameters `modules` hold (a parameter shared by two counts once); the share is by
    parameter tensors, not elements, so one large embedding does not outweigh the layers."""
    return {id(p) for m in modules for p in m.parameters()}


__all__ = ["repeated_blocks"]
