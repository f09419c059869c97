"""The corpus of public-code forms (tests/rewrite/corpus, measured by its measure.py): what a run of it
found and what guards it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixture_cases import FIXTURES, fixture_target, run

CORPUS = Path(__file__).parent / "corpus"


def test_a_chain_read_above_the_findings_first_line_answers_the_finding():
    """The profile's finding starts at the mask (line 33, under `if`) and its chain at the scale above
    (line 30): one change, and no "not rewritten" note for the same finding (apply printed both)."""
    source = (FIXTURES / "fused_softmax" / "hf_bert_conditional_mask.in.py").read_text()
    details = {
        "ops": ["scale", "mask", "softmax", "dropout"],
        "lines": {"scale": [30, 30], "mask": [33, 33], "softmax": [36, 36], "dropout": [37, 37]},
        "scores_dtype": "float32",
        "scale": {"kind": "number", "shape": [], "dtype": "float64", "requires_grad": False, "value": None},
        "scale_divides": True,
        "mask_kind": "additive",
        "mask": {"kind": "tensor", "shape": [4, 1, 1, 16], "dtype": "float32"},
        "dropout_p": 0.1,
        "softmax_dim": -1,
        "softmax_dtype": "float32",
        "out_dtype": "float32",
    }
    _, codemod = run("fused_softmax", source, [fixture_target("fused_softmax", 33, 37, details)])
    assert [c.line for c in codemod.changes] == [30]
    assert codemod.skipped == []


def _dropout_add_facts(bias: int, dropout: int) -> dict:
    return {
        "ops": ["bias", "dropout", "residual"],
        "lines": {"bias": [bias, bias], "dropout": [dropout, dropout], "residual": [dropout, dropout]},
        "shape": [4, 16, 32],
        "dtype": "float32",
        "bias": None,
        "producer": "linear",
        "residual_shape": [4, 16, 32],
        "residual_kinds": ["tensor", "tensor"],
        "inplace": False,
        "dropout_p": 0.1,
        "dropout_inplace": False,
    }


@pytest.mark.parametrize("order", [1, -1])
def test_a_finding_inside_another_keeps_its_own_facts(order: int):
    """T5: the block's finding spans its call of the feed-forward (lines 61-89: the projection in the
    attention, the dropout and add in the block) and the feed-forward's own finding lies inside it (74-75).
    In either order both are rewritten (the outer one took line 75 with facts for line 89 when it came
    first, and suggest then blocked the inner one)."""
    source = (CORPUS / "t5_style.py").read_text()
    targets = [
        fixture_target("fused_dropout_add", 61, 89, _dropout_add_facts(61, 89)),
        fixture_target("fused_dropout_add", 74, 75, _dropout_add_facts(74, 75)),
    ]
    _, codemod = run("fused_dropout_add", source, targets[::order])
    assert sorted(c.line for c in codemod.changes) == [75, 89], codemod.skipped
    assert codemod.skipped == []


@pytest.mark.slow
def test_opt_style_corpus_model_is_fixed_and_keeps_its_losses(tmp_path: Path):
    """OPT's decoder layer reassigns its residual's name from itself; the fused_dropout_add rewrite recursed
    without end there and suggest blocked both sites. measure.py: every offered fix applied, losses kept."""
    done = subprocess.run(
        [sys.executable, str(CORPUS / "measure.py"), "--keep", str(tmp_path), "opt_style"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("opt_style"))
    assert row[1:4] == ["2", "2", "match"], done.stdout
