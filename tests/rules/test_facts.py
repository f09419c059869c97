"""Facts typed end to end (issue 32 item 4): a finding's facts are read only as their dataclass, a mismatch is
a FactsError that names the rule, the field and what was found, and engine bookkeeping is no fact."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from fixture_profiles import load_fixture_profile
from libcst.codemod import CodemodContext

from opadvisor.rewrite.base import Target, finding_target, target_facts
from opadvisor.rewrite.engine import rewrite_source
from opadvisor.rewrite.registry import LIBRARY_CODEMODS, fixable_rules, get_codemod
from opadvisor.rules.attention import AttentionFacts
from opadvisor.rules.dropout_add.fused_dropout_add_fix import FusedDropoutAddCodemod
from opadvisor.rules.engine import analyse
from opadvisor.rules.facts import Facts, FactsError, Operand, facts_class
from opadvisor.rules.finding import Alternative, Finding
from opadvisor.rules.gemm.gemm_align import GemmAlignFacts
from opadvisor.rules.layernorm.manual_layernorm import LayerNormFacts
from opadvisor.rules.regions.fuse_region import FuseRegionFacts
from opadvisor.rules.registry import rule_ids

PACKAGE = Path(__file__).resolve().parents[2] / "opadvisor"
# the facts module and the finding that carries them (its `facts()` and its JSON form) read `details`
ALLOWED = {"rules/facts.py", "rules/finding.py"}
DATA = Path(__file__).resolve().parents[1] / "data"


# ---- no raw details read outside the facts module ------------------------------------------------------------
def _raw_reads(tree: ast.AST) -> list[int]:
    """Lines reading a finding's or a target's `details`: `x.details` (any use), `details[...]`,
    `details.get(...)`, `getattr(x, "details")`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "details":
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Subscript) and _named_details(node.value) and isinstance(node.ctx, ast.Load)
        ):
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _named_details(node.func.value)
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"getattr", "hasattr"}:
            if any(isinstance(a, ast.Constant) and a.value == "details" for a in node.args[1:2]):
                lines.append(node.lineno)
    return lines


def _named_details(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "details"


def test_no_raw_details_read_outside_the_facts_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("kernels/") or rel in ALLOWED:
            continue
        found += [f"{rel}:{line}" for line in _raw_reads(ast.parse(path.read_text()))]
    assert not found, f"raw `details` reads (read the facts dataclass: finding.facts(Cls), facts_of): {found}"


def test_the_checker_sees_each_form_of_raw_read():
    source = (
        "a = f.details\nb = details['x']\nc = details.get('x')\nd = getattr(t, 'details')\ne = g(details=1)\n"
    )
    assert _raw_reads(ast.parse(source)) == [1, 2, 3, 4]


# ---- a mismatch is an error that says so -----------------------------------------------------------------
def _attention() -> dict:
    return AttentionFacts(
        ops=["softmax"], lines={"softmax": [3, 3]}, scale=Operand(kind="number")
    ).to_details()


def test_a_missing_field_names_the_rule_and_the_field():
    details = _attention()
    del details["mask_kind"]
    with pytest.raises(
        FactsError, match=r"fused_softmax: facts AttentionFacts: field 'mask_kind' is missing"
    ):
        AttentionFacts.from_details(details, rule="fused_softmax")


def test_a_value_of_the_wrong_type_names_the_field_and_what_was_found():
    details = {**_attention(), "dropout_p": "0.1"}
    with pytest.raises(FactsError, match=r"sdpa_attention: facts AttentionFacts.dropout_p: .*found '0.1'"):
        AttentionFacts.from_details(details, rule="sdpa_attention")
    nested = {**_attention(), "scale": {"kind": 5}}
    with pytest.raises(FactsError, match=r"AttentionFacts.scale.kind: expected str, found 5"):
        AttentionFacts.from_details(nested, rule="fused_softmax")
    flag = {**FuseRegionFacts(chain="silu", fix="x").to_details(), "kernels_forward": True}
    with pytest.raises(FactsError, match=r"FuseRegionFacts.kernels_forward: expected int, found True"):
        FuseRegionFacts.from_details(flag, rule="fuse_region")  # a bool is no count


def test_another_rules_finding_is_refused():
    finding = _finding("fused_dropout_add", _attention())
    with pytest.raises(
        FactsError, match=r"fused_dropout_add: its finding's facts are read as AttentionFacts"
    ):
        finding.facts(AttentionFacts)


def test_a_field_this_version_does_not_know_is_an_error():
    """Facts of a newer schema (or another class's) are not read as these with the field dropped."""
    with pytest.raises(FactsError, match=r"unknown field 'new_fact' \(found 1\)"):
        AttentionFacts.from_details({**_attention(), "new_fact": 1}, rule="fused_softmax")
    with pytest.raises(FactsError, match=r"expected a mapping, found None"):
        AttentionFacts.from_details(None, rule="fused_softmax")


def test_a_field_only_some_findings_carry_reads_back_as_its_declared_default():
    """gemm_align writes only its kind's fields; the others are `absent_as` and read back as None, and
    the facts written again are the same JSON."""
    batch = GemmAlignFacts(kind="batch", rows=30, batch_size=None, odd=["M"])
    details = batch.to_details()
    assert details == {"kind": "batch", "rows": 30, "batch_size": None, "odd": ["M"]}
    again = GemmAlignFacts.from_details(details, rule="gemm_align")
    assert again == batch and again.to_details() == details
    with pytest.raises(FactsError, match=r"field 'odd' is missing"):
        GemmAlignFacts.from_details({"kind": "batch", "rows": 30}, rule="gemm_align")


def test_the_engine_boundary_refuses_facts_that_do_not_fit():
    """A finding whose facts do not fit the codemod's is an error when its target is built (suggest's dry
    run and apply build them the same way), not a target with no facts and its guards off."""
    broken = {**_attention(), "softmax_dim": "last"}
    with pytest.raises(FactsError, match=r"fused_softmax: facts AttentionFacts.softmax_dim"):
        finding_target(_finding("fused_softmax", broken), get_codemod("fused_softmax").FACTS)
    with pytest.raises(FactsError, match=r"fused_softmax: facts AttentionFacts: field 'ops' is missing"):
        finding_target(_finding("fused_softmax", {}), get_codemod("fused_softmax").FACTS)
    target = finding_target(_finding("fused_softmax", _attention()), get_codemod("fused_softmax").FACTS)
    assert isinstance(target.facts, AttentionFacts) and target.facts.scale == Operand(kind="number")


def test_a_target_carrying_another_class_is_refused():
    codemod = FusedDropoutAddCodemod(CodemodContext(), [])
    with pytest.raises(FactsError, match=r"its facts are AttentionFacts, read as DropoutAddFacts"):
        codemod.facts_of(Target(1, 1, AttentionFacts()))
    assert target_facts(Target(1, 1), AttentionFacts) is None  # a bare target: no facts, no pretence


# ---- every rule declares its facts, and every finding's facts are them ---------------------------------------
def test_each_facts_class_names_its_rules_and_each_fix_reads_its_rules_facts():
    classes = {r: facts_class(r) for r in rule_ids()}
    assert all(c is None or r in c.RULES for r, c in classes.items())
    for rule in fixable_rules():
        declared = get_codemod(rule).FACTS
        assert declared is None or declared is classes[rule], rule
    for name in LIBRARY_CODEMODS:  # the library fixes read what the engine builds for them, no rule's
        assert get_codemod(name).FACTS is not None and get_codemod(name).FACTS.RULES == ()


@pytest.mark.parametrize(
    "name", sorted(p.name.removesuffix(".profile.json") for p in DATA.glob("*.profile.json"))
)
def test_every_finding_carries_its_rules_facts_exactly(name: str):
    """On the recorded GPU profiles: each finding's details are its rule's facts dataclass, read strictly and
    written back unchanged (so the suggest JSON is what the dataclass says)."""
    report = analyse([load_fixture_profile(name)])
    for f in report.findings:
        cls = facts_class(f.rule)
        assert cls is not None or not f.details, f"{f.rule} writes details without a facts class"
        if cls is not None:
            assert f.facts(cls).to_details() == f.details, f.rule


# ---- bookkeeping is no fact ----------------------------------------------------------------------------------
def test_the_alternative_and_on_request_are_finding_fields_shown_in_the_json_details():
    f = _finding("fused_softmax", _attention())
    f.alternative = Alternative("sdpa_attention", 3, 9, bigger_win=False)
    f.on_request = True
    assert f.facts(AttentionFacts) == AttentionFacts.from_details(_attention())
    shown = f.details_json()
    assert list(shown)[-2:] == ["on_request", "alternative"]
    assert shown["alternative"] == {"rule": "sdpa_attention", "line": 3, "end_line": 9, "bigger_win": False}
    assert "alternative" not in f.details


def test_moved_lines_are_the_targets_not_the_facts():
    facts = AttentionFacts(lines={"softmax": [3, 3]})
    moved = Target(4, 6, facts, moved_lines={"softmax": [5, 5]})
    assert moved.step_line("softmax") == (5, 5) and Target(1, 4, facts).step_line("softmax") == (3, 3)
    assert facts.lines == {"softmax": [3, 3]}


# ---- LayerNormFacts is read by its fix ---------------------------------------------------------------------
LAYER_NORM = textwrap.dedent(
    """\
    import torch


    def norm(x, w, b):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + 1e-5) * w + b
    """
)


@pytest.mark.parametrize(("dims", "rewritten"), [([-1], True), ([-2, -1], False)])
def test_manual_layernorm_checks_the_profiled_statistics(dims: list[int], rewritten: bool):
    target = Target(5, 7, LayerNormFacts(normalized_shape=[64], reduce_dims=dims, weight=True, bias=True))
    after, result = rewrite_source(LAYER_NORM.encode(), "manual_layernorm", [target], "ln.py")
    assert ("layer_norm(" in after.decode()) is rewritten
    if not rewritten:
        assert "the profile saw statistics over dims [-2, -1] here" in result.skipped[0].message


def _finding(rule: str, details: dict) -> Finding:
    return Finding(rule, "/x/train.py", 3, 9, "message", "safe", details=details)


def test_facts_is_the_base_of_every_facts_class():
    assert all(issubclass(c, Facts) for c in {facts_class(r) for r in rule_ids()} - {None})
