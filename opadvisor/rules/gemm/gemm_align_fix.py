"""gemm_align: `nn.Linear` layers with sizes that are not a multiple of 8 become `PaddedLinear`.

Before::

    self.lm_head = nn.Linear(hidden, 30522)

After::

    self.lm_head = PaddedLinear(hidden, 30522)

`opadvisor.kernels.PaddedLinear(in_features, out_features, bias=True, device=None, dtype=None)` is a drop-in
for `nn.Linear` with the same constructor arguments and the same state_dict; it runs the matrix product on
padded sizes and slices the result, so the model computes the same function (a safe fix). Only the callee
changes: the arguments, their comments and layout stay as written.

In profile mode the findings name the constructions whose measured products were misaligned. In static
mode (no profile) a construction is rewritten when one of its sizes is an integer literal that is not a
multiple of 8; sizes given as names cannot be checked without a profile, so those are left alone.

Display-only notes (printed, never written, since they change the model): a literal vocabulary size, an
`nn.Embedding` size or a batch size that is not a multiple of 8, with the next multiple that would align
the products without any padding (for a vocabulary: extra rows that no token uses).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from opadvisor.rewrite import toolkit as mt
from opadvisor.rewrite.base import RuleCodemod
from opadvisor.rewrite.toolkit import reference
from opadvisor.rules.gemm.gemm_align import GemmAlignFacts

KERNEL = "opadvisor.kernels.PaddedLinear"
ALIGN = 8
_VOCAB_WORDS = ("vocab", "n_token", "ntoken", "num_tokens", "num_embeddings")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class GemmAlignCodemod(RuleCodemod):
    RULE = "gemm_align"
    FACTS = GemmAlignFacts
    SOURCE_WORDS: ClassVar[tuple[str, ...]] = (
        "linear",
        "embedding",
        *_VOCAB_WORDS,
        "batch_size",
        r"\bbs\b",
    )  # the layers it rewrites and the sizes it notes
    KERNEL_OP = "padded_linear"
    SAFETY = "safe"
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def visit_Module(self, node: cst.Module) -> bool:
        self._module = node
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if mt.resolves_to(self, original_node.func, mt.LINEAR_CLASSES):
            return self._linear(original_node, updated_node)
        if mt.resolves_to(self, original_node.func, mt.EMBEDDING_CLASSES) and self._notes_wanted(
            original_node
        ):
            args = mt.bind_args(original_node, ("num_embeddings", "embedding_dim"), required=0)
            size = mt.int_value(args["num_embeddings"].value) if args and "num_embeddings" in args else None
            if size is not None and size % ALIGN and size >= 64:
                self._size_note(original_node, "nn.Embedding size", size)
        return updated_node

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self._literal_note(node, node.keyword.value, node.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            name = target.target
            label = name.value if isinstance(name, cst.Name) else mt.self_attr(name)
            if label:
                self._literal_note(node, label, node.value)

    # ---- the rewrite -------------------------------------------------------------------------------------
    def _linear(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        target = self.targeted(original)
        if target is None:
            return updated
        args = mt.bind_args(original, ("in_features", "out_features", "bias", "device", "dtype"), required=2)
        if args is None:
            if self.targets is not None:
                self.skip(
                    original,
                    "not rewritten: the nn.Linear arguments could not be read (*args or unknown keywords)",
                )
            return updated
        facts = self.facts_of(target)
        sizes = {k: mt.int_value(args[k].value) for k in ("in_features", "out_features")}
        for key in ("in_features", "out_features"):  # a size the source computes: the profile's
            if sizes[key] is None and facts is not None:
                sizes[key] = getattr(facts, key)
        known = [v for v in sizes.values() if v is not None]
        pad_to = facts.pad_to if facts is not None and facts.pad_to is not None else ALIGN
        if self.targets is None:
            if not any(v % ALIGN for v in known):
                return updated  # static mode: aligned, or sizes only a profile can tell
        elif len(known) == 2 and not any(v % pad_to for v in known):
            self.skip(
                original,
                f"not rewritten: {sizes['in_features']} x {sizes['out_features']} is already aligned",
            )
            return updated
        out = sizes["out_features"]
        if out is not None and out % pad_to:
            self._size_note(original, "output size", out, pad_to)
        assert self._module is not None
        padded = reference(self.context, self._module, KERNEL)
        shown = ", ".join(
            str(sizes[k]) if sizes[k] is not None else mt.code(args[k].value)
            for k in ("in_features", "out_features")
        )
        self.record_change(
            original, f"nn.Linear({shown}) -> opadvisor.kernels.PaddedLinear (same state_dict)"
        )
        return updated.with_changes(func=padded)

    # ---- display-only notes ----------------------------------------------------------------------------------
    def _notes_wanted(self, node: cst.CSTNode) -> bool:
        return self.targets is None or bool(self.targets)

    def _literal_note(self, node: cst.CSTNode, label: str, value_node: cst.BaseExpression) -> None:
        if not self._notes_wanted(node):
            return
        value = mt.int_value(value_node)
        if value is None or value % ALIGN:
            lowered = label.lower()
            if value is None:
                return
            if any(word in lowered for word in _VOCAB_WORDS) and value >= 64:
                self._size_note(node, f"vocabulary size `{label}`", value)
            elif lowered in {"batch_size", "micro_batch_size", "bs"} and value >= ALIGN:
                self._size_note(node, f"batch size `{label}`", value)

    def _size_note(self, node: cst.CSTNode, what: str, value: int, multiple: int = ALIGN) -> None:
        line = self.lines_of(node)[0]
        if (line, value) in getattr(self, "_noted_pairs", set()):
            return
        self._noted_pairs = getattr(self, "_noted_pairs", set()) | {(line, value)}
        self.note(
            node,
            f"{what} {value} is not a multiple of {multiple}: {_round_up(value, multiple)} would align the matrix "
            "products without padding (display-only: it changes the model, so it is not written)",
        )
