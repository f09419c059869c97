"""Recognising the source a replacement was written against: a transformers forward is patched only when its
code, read by `ast` without annotations, docstrings and decorators, hashes to one of `_FINGERPRINTS`; a
release that changed it is reported by name (`_fingerprint_problem`), never patched blindly."""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any


class _Normalise(ast.NodeTransformer):
    """Drop what does not change behaviour (annotations, docstrings) and a class-name prefix."""

    def __init__(self, prefix: str | None) -> None:
        self.prefix = prefix

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        node.decorator_list = []
        for arg in [*node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
            if arg is not None:
                arg.annotation = None
        if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            node.body = node.body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        node.annotation = ast.Constant(None)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if self.prefix and node.id.startswith(self.prefix):
            node.id = "Bert" + node.id[len(self.prefix) :]
        return node


def source_fingerprint(function: Callable[..., Any], prefix: str | None = None) -> str | None:
    """sha256 (16 hex digits) of a function's code as `ast` reads it, without annotations, docstrings,
    comments and decorators, with class names starting with `prefix` renamed to Bert...; None when its
    source cannot be read."""
    # a @torch.jit.script function (transformers 5.17's DeBERTa helpers) keeps its Python function here
    function = getattr(function, "_torchdynamo_inline", function)
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    tree = _Normalise(prefix).visit(ast.parse(source))
    # The code as text, not `ast.dump`: the dump's fields differ between Python versions (3.12 added
    # `type_params` to every function), so the same source hashed differently on 3.11 and 3.12.
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]


# The forwards the replacements reproduce (transformers 5.17 to 5.24; the same on Python 3.11 and 3.12).
_FINGERPRINTS: dict[str, frozenset[str]] = {
    # 5.24 renamed the cache argument past_key_values -> cache and passes its **kwargs to cache.update
    "BertSelfAttention.forward": frozenset({"c9aff623cb3bee7b", "981d4541628e79d8"}),
    "BertSelfAttention.eager": frozenset({"7e3246ffb0cd92ec"}),  # modeling_bert.eager_attention_forward
    "BertOutput.forward": frozenset({"3799d79263d3217e"}),  # BertSelfOutput.forward is the same code
    "GPT2Attention.forward": frozenset({"9776498c57bbfab9", "c4aacbab42a83441"}),  # 5.24: as BERT's
    "GPT2Attention.eager": frozenset({"129ae75c51935f73"}),  # modeling_gpt2.eager_attention_forward
    "NewGELUActivation.forward": frozenset({"9d0b9dd7175386e1"}),
    "BertForMaskedLM.forward": frozenset({"9b5ba72bf54eebe4"}),
    # 5.17 and 5.23 differ in how the hidden states are sliced for logits_to_keep, not in the loss; 5.24 in the
    # cache's name only
    "GPT2LMHeadModel.forward": frozenset({"a598ab66858c87fb", "6e1be7c84478d45d", "3c72e5d417e3c073"}),
    "ForCausalLMLoss": frozenset({"0637640fcbd0cbda"}),  # transformers.loss.loss_utils
    "fixed_cross_entropy": frozenset({"7c2fdd59ca33bb6a"}),
    # the Llama family (libraries._LLAMA_FAMILY), class-name prefix renamed as for BERT's (5.24)
    "LlamaRMSNorm.forward": frozenset({"9635bcd843f309a0"}),
    "LlamaMLP.forward": frozenset({"7d2027d4464e3e71"}),
    "SiLUActivation.forward": frozenset({"e730f54291b81588"}),  # transformers.activations
    # 5.17 (the GPU machine's): past_key_values for cache (the replacements read either), 5.17's slicing for
    # logits_to_keep; checked against 5.17's source by the same normalisation
    "LlamaForCausalLM.forward": frozenset({"3eb801727fee5813", "9581bf6d6970304e"}),
    "LlamaAttention.forward": frozenset({"935ef6caf5ea6f75", "b9c6a0ecf29f0cc8"}),
    "apply_rotary_pos_emb": frozenset({"4a8f8b85ee37bd3f"}),  # modeling_llama's (unsqueeze_dim=1)
    "rotate_half": frozenset({"7b6c9b425ca04287"}),
    # DeBERTa-v2/v3 (modeling_deberta_v2; 5.17 and 5.24 differ in docstrings and 5.17's @torch.jit.script on the
    # helpers, which the normalisation drops: the same hashes)
    "DisentangledSelfAttention.forward": frozenset({"4edf7fe927f84b6f"}),
    "DisentangledSelfAttention.disentangled_attention_bias": frozenset({"abd13563f00f5297"}),
    "DisentangledSelfAttention.transpose_for_scores": frozenset({"9e2e88a086a82748"}),
    "deberta_v2.scaled_size_sqrt": frozenset({"c49cfc8a827e57a9"}),
    "deberta_v2.build_rpos": frozenset({"52c32cbadb10d6b0"}),
    "DebertaV2ForMaskedLM.forward": frozenset({"6287eefe7a10c131"}),
    "DebertaV2Encoder.forward": frozenset({"1d68963a0fcae18e"}),
    "DebertaV2Encoder.get_rel_pos": frozenset({"c883843f1be1f573"}),
    "deberta_v2.build_relative_position": frozenset({"eaea63754e0df637"}),
    "deberta_v2.make_log_bucket_position": frozenset({"2e29ec6ff25a1132"}),
}


def _fingerprint_problem(
    cls: type, key: str, function: Callable[..., Any] | None, prefix: str | None
) -> str | None:
    if function is None:
        return f"{key} is missing in this transformers"
    got = source_fingerprint(function, prefix)
    if got is None or got in _FINGERPRINTS[key]:
        return None if got is not None else f"the source of {key} cannot be read"
    version = getattr(sys.modules.get("transformers"), "__version__", "?")
    return (
        f"transformers {version} changed {key} (not the code this patch reproduces); "
        "opadvisor needs an update for it"
    )
