"""Real model families laid out as a user's project: model files vendored into `src/`, a training script
that puts `src/` on `sys.path` itself (issue 29's end-to-end proving ground).

The model code is taken from the installed packages (transformers, timm, vit-pytorch) at run time, never
from the repository: each family's modules are copied into `<project>/src/<pkg>/`, their relative imports
rewritten to absolute imports of the package they came from (`from ...activations import ACT2FN` ->
`from transformers.activations import ACT2FN`, `from ._builder import x` -> `from timm.models._builder import
x`), as a user who vendors a model file does. `<project>/train.py` then does
`sys.path.insert(0, os.path.join(os.path.dirname(__file__), "src"))`, imports the model class from the copy,
builds it from a configuration object (nothing downloaded) and trains with AdamW on random data, printing the
loss of each step. A transformers copy also gets a footer that has transformers initialise its classes as its own
(`native_init_footer`): without it, transformers 5 treats the copy as custom code and skips part of its init.

    build_project(FAMILIES["llama"], Path("proj"))   # proj/src/hf_llama/modeling_llama.py, proj/train.py
    python proj/train.py --size tiny --steps 4        # CPU, fp32
    python proj/train.py --size base --device cuda --bf16

Used by tests/realcode/test_families.py (CPU, tiny) and benchmarks/realcode.py (GPU, base sizes).
"""

from __future__ import annotations

import importlib.util
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

import libcst as cst


# ---- vendoring -------------------------------------------------------------------------------------------------
class _AbsoluteImports(cst.CSTTransformer):
    """`from .x import y` / `from ..a.b import c` -> absolute imports from the module's original package."""

    def __init__(self, package: str) -> None:
        super().__init__()
        self.package = package.split(".")

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        dots = len(updated.relative)
        if not dots:
            return updated
        base = self.package[: len(self.package) - (dots - 1)]
        tail = [cst.helpers.get_full_name_for_node(updated.module)] if updated.module is not None else []
        dotted = ".".join([*base, *tail])
        return updated.with_changes(relative=[], module=cst.parse_expression(dotted))


def absolute_imports(source: str, package: str) -> str:
    """`source` (a module of `package`) with its relative imports made absolute."""
    return cst.parse_module(source).visit(_AbsoluteImports(package)).code


def _pretrained_model_classes(module: cst.Module) -> list[str]:
    """The module-level classes of `module` that subclass `PreTrainedModel` directly (`XPreTrainedModel`)."""
    names = []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and any(
            (cst.helpers.get_full_name_for_node(arg.value) or "").rpartition(".")[2] == "PreTrainedModel"
            for arg in stmt.bases
        ):
            names.append(stmt.name.value)
    return names


def native_init_footer(source: str) -> str:
    """What a copy of a transformers modeling file needs appended to initialise like the installed one.

    transformers 5 counts a `PreTrainedModel` whose `__module__` is outside `transformers.` as custom code
    (`is_custom_code()`), and for custom code `_initialize_weights` skips `_init_weights` on a module whose own
    parameters and buffers all carry the `_is_hf_initialized` flag (meant for remote code that writes loaded
    weights in place); a module with none of its own passes vacuously (`all()` of nothing) and is marked
    initialised untouched. So whatever `_init_weights` initialises from such a container never runs in a copy:
    T5Attention's q/k/v/o and relative attention bias and T5DenseActDense's wi/wo keep the generic std
    `initializer_factor` = 1.0 (max |w| ~5, first-step gradient norm ~1e5x the installed model's), GPT-2's
    residual c_proj keeps 0.02 instead of 0.02/sqrt(2 n_layer). The copy is transformers' own code, using its
    guarded `transformers.initialization` functions, so it is declared native again. Empty when the file
    defines no `PreTrainedModel` subclass."""
    classes = _pretrained_model_classes(cst.parse_module(source))
    if not classes:
        return ""
    lines = "".join(
        f"{name}.is_custom_code = classmethod(lambda cls: cls.is_remote_code())\n" for name in classes
    )
    return (
        "\n\n# Vendored from transformers: initialise as transformers initialises its own classes (outside the\n"
        "# `transformers.` package they count as custom code, and `_init_weights` is then skipped for every module\n"
        "# without parameters of its own, e.g. the attention blocks whose projections it initialises).\n"
        + lines
    )


def module_file(dotted: str) -> Path:
    """The installed file of a module, found without importing it (timm's import needs torchvision)."""
    parent, _, name = dotted.rpartition(".")
    spec = importlib.util.find_spec(parent.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{dotted.split('.')[0]} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root.joinpath(*parent.split(".")[1:], f"{name}.py")
    if not path.is_file():
        raise ModuleNotFoundError(f"{dotted}: no {path}")
    return path


def _top_level_names(module: cst.Module) -> set[str]:
    """The classes and functions `module` defines at its top level (what another module may import)."""
    return {stmt.name.value for stmt in module.body if isinstance(stmt, (cst.ClassDef, cst.FunctionDef))}


class _VendoredImports(cst.CSTTransformer):
    """`from timm.layers import Attention, DropPath` -> `from timm.layers import DropPath` plus `from
    timm_vit.attention import Attention` when timm.layers.attention was vendored as timm_vit/attention.py: the
    imports a user who copied the layer files too would write, so the copies are the code that runs."""

    def __init__(self, vendored: dict[str, tuple[str, set[str]]]) -> None:
        super().__init__()
        self.vendored = vendored  # original dotted module -> (the copy's dotted module, names it defines)

    def _target(self, module: str, name: str) -> str | None:
        # `module` is the vendored module itself, or a package above it that re-exports its names
        for dotted, (copy, names) in self.vendored.items():
            if name in names and (dotted == module or dotted.startswith(module + ".")):
                return copy
        return None

    def leave_SimpleStatementLine(self, original, updated):  # noqa: ANN001, ANN201 - libcst's hook
        stmt = updated.body[0] if len(updated.body) == 1 else None
        if not isinstance(stmt, cst.ImportFrom) or stmt.relative or isinstance(stmt.names, cst.ImportStar):
            return updated
        module = cst.helpers.get_full_name_for_node(stmt.module) or ""
        kept, moved = [], {}
        for alias in stmt.names:
            target = self._target(module, cst.helpers.get_full_name_for_node(alias.name) or "")
            (moved.setdefault(target, []) if target else kept).append(
                alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)
            )
        if not moved:
            return updated
        lines = (
            [updated.with_changes(body=[stmt.with_changes(names=kept, lpar=None, rpar=None)])] if kept else []
        )
        for target, names in moved.items():
            new = cst.ImportFrom(module=cst.parse_expression(target), names=names)
            lines.append(cst.SimpleStatementLine(body=[new]))
        return cst.FlattenSentinel(lines)


def vendor(modules: tuple[str, ...], dest: Path) -> list[Path]:
    """Copy each module's file into `dest` (a package folder of the user's), imports made absolute."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "__init__.py").write_text("")
    copied = []
    for dotted in modules:
        package = dotted.rpartition(".")[0]
        target = dest / module_file(dotted).name
        source = absolute_imports(module_file(dotted).read_text(), package)
        if dotted.split(".")[0] == "transformers":
            source += native_init_footer(source)
        target.write_text(source)
        copied.append(target)
    point_imports_at_copies(modules, copied, dest.name)
    return copied


def point_imports_at_copies(modules: tuple[str, ...], copied: list[Path], pkg: str) -> None:
    """Rewrite the copies' imports of each other's originals (through a re-exporting package too) to the
    copies: with several modules vendored (a timm model file and the timm.layers modules it builds on), the
    model must run the copied layers, not the installed ones."""
    if len(modules) < 2:
        return
    trees = {path: cst.parse_module(path.read_text()) for path in copied}
    vendored = {
        dotted: (f"{pkg}.{path.stem}", _top_level_names(trees[path]))
        for dotted, path in zip(modules, copied, strict=True)
    }
    for path, tree in trees.items():
        own = {k: v for k, v in vendored.items() if v[0] != f"{pkg}.{path.stem}"}
        path.write_text(tree.visit(_VendoredImports(own)).code)


# ---- the families ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One model family: what to vendor, how the script imports and builds it, and its batch and loss.

    `build` is the body of `build(size)` returning the model (`size` is "tiny" or "base"); `batch` the body
    of `make_batch(size, g)` returning a tuple of CPU tensors from the generator `g`; `loss` an expression
    over `model` and `batch`."""

    name: str
    zoo: str  # the installed package the code comes from
    modules: tuple[str, ...]  # dotted modules to vendor, into src/<pkg>/
    pkg: str  # the user's package name under src/
    imports: str  # the script's imports of the vendored code (and of configuration classes)
    build: str
    batch: str
    loss: str
    env: tuple[tuple[str, str], ...] = ()  # environment the script sets before importing the model


_LM_BATCH = """\
b, s, v = (2, 32, 1000) if size == "tiny" else {base}
ids = torch.randint(0, v, (b, s), generator=g)
return (ids,)
"""
_IMAGE_BATCH = """\
b, r, c = (2, {tiny_res}, 10) if size == "tiny" else (32, 224, 1000)
return torch.randn(b, 3, r, r, generator=g), torch.randint(0, c, (b,), generator=g)
"""
_HF_LM_LOSS = "model(input_ids=batch[0], labels=batch[0]).loss"
_CE_LOSS = "torch.nn.functional.cross_entropy(model(batch[0]), batch[1])"


def _hf(
    name: str, model_cls: str, config_cls: str, pkg_name: str, tiny: str, base: str, batch: str, loss: str
) -> Family:
    module = f"transformers.models.{pkg_name}.modeling_{pkg_name}"
    return Family(
        name=name,
        zoo="transformers",
        modules=(module,),
        pkg=f"hf_{pkg_name}",
        imports=f"from transformers import {config_cls}\nfrom hf_{pkg_name}.modeling_{pkg_name} import {model_cls}",
        build=(
            f'kw = dict({tiny}) if size == "tiny" else dict({base})\n'
            f'config = {config_cls}(**kw, attn_implementation="eager")\n'
            f"return {model_cls}(config)"
        ),
        batch=batch,
        loss=loss,
    )


_TINY_DEC = "hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, max_position_embeddings=64"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _hf(
            "llama",
            "LlamaForCausalLM",
            "LlamaConfig",
            "llama",
            tiny=_TINY_DEC + ", num_key_value_heads=2",
            base="hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, "
            "num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024",
            batch=_LM_BATCH.format(base="(4, 1024, 32000)"),
            loss=_HF_LM_LOSS,
        ),
        _hf(
            "gpt2",
            "GPT2LMHeadModel",
            "GPT2Config",
            "gpt2",
            tiny="n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64",
            base="",  # GPT-2 124M
            batch=_LM_BATCH.format(base="(4, 1024, 50257)"),
            loss=_HF_LM_LOSS,
        ),
        _hf(
            "bert",
            "BertForMaskedLM",
            "BertConfig",
            "bert",
            tiny=_TINY_DEC,
            base="",  # bert-base
            batch=_LM_BATCH.format(base="(8, 512, 30522)"),
            loss=_HF_LM_LOSS,
        ),
        _hf(
            "deberta_v2",
            "DebertaV2ForMaskedLM",
            "DebertaV2Config",
            "deberta_v2",
            tiny=_TINY_DEC + ", relative_attention=True, position_buckets=16, pos_att_type=['p2c', 'c2p'], "
            "max_relative_positions=-1, position_biased_input=False",
            # DeBERTa-v3-base
            base="hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, "
            "vocab_size=128100, relative_attention=True, position_buckets=256, pos_att_type=['p2c', 'c2p'], "
            "max_relative_positions=-1, position_biased_input=False, norm_rel_ebd='layer_norm', share_att_key=True",
            batch=_LM_BATCH.format(base="(8, 512, 128100)"),
            loss=_HF_LM_LOSS,
        ),
        _hf(
            "t5",
            "T5ForConditionalGeneration",
            "T5Config",
            "t5",
            tiny="d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=1000, decoder_start_token_id=0",
            base="decoder_start_token_id=0",  # T5-small
            batch=_LM_BATCH.format(base="(8, 512, 32128)"),
            loss=_HF_LM_LOSS,
        ),
        _hf(
            "vit",
            "ViTForImageClassification",
            "ViTConfig",
            "vit",
            tiny="hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, "
            "image_size=32, patch_size=8, num_labels=10",
            base="num_labels=1000",  # ViT-B/16 224
            batch=_IMAGE_BATCH.format(tiny_res=32),
            loss="model(pixel_values=batch[0], labels=batch[1]).loss",
        ),
        Family(
            name="timm_vit",
            zoo="timm",
            # timm 1.x keeps ViT's Attention and Mlp in timm.layers: vendored too, as a user copies them
            modules=("timm.models.vision_transformer", "timm.layers.attention", "timm.layers.mlp"),
            pkg="timm_vit",
            imports="from timm_vit.vision_transformer import VisionTransformer",
            build=(
                'if size == "tiny":\n'
                "    return VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)\n"
                "return VisionTransformer(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, num_classes=1000)"
            ),
            batch=_IMAGE_BATCH.format(tiny_res=32),
            loss=_CE_LOSS,
            env=(("TIMM_FUSED_ATTN", "0"),),  # timm's attention written op by op, as on older torch
        ),
        Family(
            name="timm_convnext",
            zoo="timm",
            modules=("timm.models.convnext", "timm.layers.mlp"),  # ConvNeXt's Mlp lives in timm.layers
            pkg="timm_convnext",
            imports="from timm_convnext.convnext import ConvNeXt",
            build=(
                'if size == "tiny":\n'
                "    return ConvNeXt(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64), num_classes=10)\n"
                "return ConvNeXt(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), num_classes=1000)  # convnext_tiny"
            ),
            batch=_IMAGE_BATCH.format(tiny_res=64),
            loss=_CE_LOSS,
        ),
        Family(
            name="timm_swin",
            zoo="timm",
            modules=("timm.models.swin_transformer",),
            pkg="timm_swin",
            imports="from timm_swin.swin_transformer import SwinTransformer",
            build=(
                'if size == "tiny":\n'
                "    return SwinTransformer(img_size=64, patch_size=4, window_size=4, embed_dim=32, depths=(1, 1),"
                " num_heads=(2, 4), num_classes=10)\n"
                "return SwinTransformer(img_size=224, patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2),"
                " num_heads=(3, 6, 12, 24), num_classes=1000)  # swin_tiny"
            ),
            batch=_IMAGE_BATCH.format(tiny_res=64),
            loss=_CE_LOSS,
            env=(("TIMM_FUSED_ATTN", "0"),),
        ),
        Family(
            name="vit_pytorch",
            zoo="vit_pytorch",
            modules=("vit_pytorch.vit",),
            pkg="vitp",
            imports="from vitp.vit import ViT",
            build=(
                'if size == "tiny":\n'
                "    return ViT(image_size=32, patch_size=8, num_classes=10, dim=64, depth=2, heads=4, mlp_dim=128)\n"
                "return ViT(image_size=224, patch_size=16, num_classes=1000, dim=768, depth=12, heads=12, mlp_dim=3072)"
            ),
            batch=_IMAGE_BATCH.format(tiny_res=32),
            loss=_CE_LOSS,
        ),
    )
}


# ---- the project ---------------------------------------------------------------------------------------------------
_SCRIPT = '''\
"""Train {name} (vendored under src/{pkg}/) a few steps on random data."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "src"))
{env}
import torch

{imports}


def build(size):
{build}


def make_batch(size, g):
{batch}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny", choices=["tiny", "base"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build(args.size).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        batch = tuple(t.to(args.device) for t in make_batch(args.size, g))
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16):
            loss = {loss}
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {{step}} loss {{loss.item():.6f}}", flush=True)


if __name__ == "__main__":
    main()
'''


def available(family: Family) -> str | None:
    """None when the family's package is installed, else why not."""
    try:
        for dotted in family.modules:
            module_file(dotted)
    except ModuleNotFoundError as exc:
        return str(exc)
    return None


def build_project(family: Family, project: Path) -> list[Path]:
    """Lay out `project` as a user's: src/<pkg>/ (the vendored files) and train.py. Returns the copies."""
    if (project / "src").exists():
        shutil.rmtree(project / "src")
    copied = vendor(family.modules, project / "src" / family.pkg)
    env = "".join(f'os.environ.setdefault("{k}", "{v}")\n' for k, v in family.env)
    (project / "train.py").write_text(
        _SCRIPT.format(
            name=family.name,
            pkg=family.pkg,
            env=env,
            imports=family.imports,
            build=textwrap.indent(family.build, "    "),
            batch=textwrap.indent(family.batch, "    "),
            loss=family.loss,
        )
    )
    return copied
