"""One declaration per pattern: the profile matcher and the source matcher read the same steps."""

from __future__ import annotations

import ast
from pathlib import Path

from opadvisor.rewrite import _chain
from opadvisor.rules import _attention, _regions, patterns
from opadvisor.rules.attention import fused_softmax
from opadvisor.rules.dropout_add import fused_dropout_add
from opadvisor.rules.patterns import (
    ATTENTION,
    DROPOUT,
    DROPOUT_ADD,
    FUSED_SOFTMAX,
    MASK,
    PV,
    QK,
    REGION_CHAINS,
    SCALE,
    SOFTMAX,
    ZERO,
)
from opadvisor.rules.regions import fuse_region as fuse_region_rule


def test_attention_declaration_orders():
    assert ATTENTION.before() == (QK, SCALE, MASK) and ATTENTION.after() == (ZERO, DROPOUT, PV)
    assert ATTENTION.orders() == [
        (QK, SCALE, MASK, SOFTMAX, ZERO, DROPOUT, PV),
        (QK, SCALE, MASK, SOFTMAX, DROPOUT, ZERO, PV),
    ]
    # after the softmax: zero and dropout either way, each once; the product after both
    assert ATTENTION.next_after([]) == (ZERO, DROPOUT, PV)
    assert ATTENTION.next_after([DROPOUT]) == (ZERO, PV)
    assert ATTENTION.next_after([ZERO, DROPOUT]) == (PV,)
    assert ATTENTION.next_after([PV]) == ()
    assert ATTENTION.arithmetic() == {SCALE, MASK}


def test_both_matchers_read_the_declaration():
    profile_chain = _attention.ATTENTION
    assert tuple(link.label for link in profile_chain.links) == ATTENTION.names
    assert [link.optional for link in profile_chain.links] == [s.optional for s in ATTENTION.steps]
    assert profile_chain.swaps == ATTENTION.swaps
    # fused_softmax's view of the pattern: no products, the rest as declared; the source matcher walks it
    # and the rule reports its steps (the scale folded, not reported)
    assert FUSED_SOFTMAX.names == (SCALE, MASK, SOFTMAX, ZERO, DROPOUT)
    assert FUSED_SOFTMAX.swaps == ATTENTION.swaps and _chain.FUSED_SOFTMAX is FUSED_SOFTMAX
    assert fused_softmax.FACT_LABELS == FUSED_SOFTMAX.names
    assert fused_softmax.LABELS == (MASK, SOFTMAX, ZERO, DROPOUT)


def test_dropout_add_declaration():
    chain = fused_dropout_add.CHAIN
    assert tuple(link.label for link in chain.links) == DROPOUT_ADD.names == ("bias", "dropout", "residual")
    assert [link.optional for link in chain.links] == [True, False, False]


def test_region_chains_declared_once():
    assert _regions.CHAIN_LABELS == {name: c.label for name, c in REGION_CHAINS.items()}
    assert fuse_region_rule.FIXES == {name: c.fix for name, c in REGION_CHAINS.items()}
    activations = {name for name, c in REGION_CHAINS.items() if c.function}
    assert activations == {"gelu_tanh", "gelu_erf", "silu", "sigmoid_gate"}
    assert _regions.WHOLE_FUNCTION_CHAINS == {"relpos_gather"}


def _step_name_keys(tree: ast.AST) -> list[int]:
    """Lines where a step name is spelled as a string used as a key (`ops["softmax"]`, `"qk" in bound`);
    a call's argument names (`step.params["mask"]`, `args["mask"]`) are not step names."""
    names = set(patterns.ATTENTION.names) | set(patterns.DROPOUT_ADD.names)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            owner = node.value
            argnames = (isinstance(owner, ast.Attribute) and owner.attr == "params") or (
                isinstance(owner, ast.Name) and owner.id == "args"
            )
            if node.slice.value in names and not argnames:
                lines.append(node.lineno)
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant):
            if node.left.value in names and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                lines.append(node.lineno)
    return lines


# files whose same-spelled strings are their own names: manual_layernorm's "bias" is the norm's bias role
_OWN_NAMES = {"manual_layernorm.py"}


def test_step_names_are_spelled_once() -> None:
    # issue 32: the rule code reads a step through its symbol in rules/patterns.py, never a second spelling
    root = Path(patterns.__file__).parents[1]
    found = {}
    for path in [*(root / "rules").rglob("*.py"), *(root / "rewrite").rglob("*.py")]:
        if path.name in _OWN_NAMES:
            continue
        if path.name != "patterns.py" and (lines := _step_name_keys(ast.parse(path.read_text()))):
            found[str(path.relative_to(root))] = lines
    assert found == {}
