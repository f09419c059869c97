"""A static `apply --rule all` runs every rule's first pass on the original and puts the rewrites together
(engine._first_round, _merge.py): it must write and say exactly what running each rule on the text the rule
before it left does (engine.sequential()), and its applied.json must chain one rule's text to the next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opadvisor.rewrite import _merge, engine

# softmax + dropout-add + a Linear of 2 outputs: three rules rewrite three places, each adding an import
MODEL = '''\
"""A small model, written the way people write them."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        return probs @ v


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = Attention(dim)
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, mask):
        h = self.attn(x, mask)
        h = self.dropout(h)
        return self.norm(h + x)


class Head(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.classifier = nn.Linear(dim, 2)

    def forward(self, x):
        return self.classifier(x)
'''


def _said(result: engine.ApplyResult) -> tuple:
    rules = [
        (
            r.rule,
            r.before != r.after,
            [(n.line, n.where, n.message) for n in (*r.changes, *r.skipped, *r.notes)],
        )
        for f in result.files
        for r in f.rules
    ]
    return [f.after for f in result.files], sorted(result.messages), sorted(rules)


def test_hunks_put_together_and_clash() -> None:
    old = b"a\nb\nc\nd\n"
    one = _merge.hunks(old, b"a\nB\nc\nd\n")
    two = _merge.hunks(old, b"a\nb\nc\nD\n")
    assert not _merge.clashes(one, two)
    assert _merge.applied(old, [*one, *two]) == b"a\nB\nc\nD\n"
    # two insertions at one point: their order would be a guess
    ins1, ins2 = _merge.hunks(old, b"a\nx\nb\nc\nd\n"), _merge.hunks(old, b"a\ny\nb\nc\nd\n")
    assert _merge.clashes(ins1, ins2)
    # an import inserted where a rewrite inserts: the import goes first
    imports = _merge.hunks(old, b"a\nimport k\nb\nc\nd\n", _merge.IMPORTS)
    assert not _merge.clashes(imports, ins2)
    assert _merge.applied(old, [*ins2, *imports]) == b"a\nimport k\ny\nb\nc\nd\n"
    # neighbouring lines clash too (which rewrite owns the border is not known)
    assert _merge.clashes(_merge.hunks(old, b"a\nB\nc\nd\n"), _merge.hunks(old, b"a\nb\nC\nd\n"))


@pytest.mark.parametrize("unsafe", [False, True])
def test_rule_all_writes_and_says_what_one_rule_at_a_time_does(tmp_path: Path, monkeypatch, unsafe) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    rounds = []
    first_round = engine._first_round
    monkeypatch.setattr(engine, "_first_round", lambda job: rounds.append(first_round(job)) or rounds[-1])
    merged = engine.apply_files("all", [path], allow_unsafe=unsafe, write=False)
    # put together, not one at a time (an earlier round is the dry run of the rules --unsafe would add)
    assert len(rounds[-1].results) >= 3
    # the second round checks the merged rules; a rule that found nothing, in code nobody rewrote (no
    # cross entropy here, nor in what the rewrites wrote), is not run again
    assert {"fused_softmax", "fused_dropout_add", "gemm_align"} <= set(rounds[-1].again)
    assert "fused_cross_entropy" not in rounds[-1].again
    with engine.sequential():
        one_by_one = engine.apply_files("all", [path], allow_unsafe=unsafe, write=False)
    changed = [r.rule for r in merged.files[0].rules if r.before != r.after]
    assert {"fused_softmax", "fused_dropout_add", "gemm_align"} <= set(changed), changed
    assert _said(merged) == _said(one_by_one)
    compile(merged.files[0].after, "model.py", "exec")


def test_each_rules_snapshot_is_the_text_the_next_one_starts_from(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    engine.apply_files("all", [path], allow_unsafe=False)
    entries = json.loads((tmp_path / ".opadvisor" / "static" / "applied.json").read_text())["applied"]
    assert len(entries) >= 3
    texts = [(tmp_path / ".opadvisor" / "static" / e["after"]).read_bytes() for e in entries]
    assert entries[0]["sha256_before"] == engine.sha256(MODEL.encode())
    for before, entry in zip([MODEL.encode(), *texts], entries, strict=False):
        assert entry["sha256_before"] == engine.sha256(before)  # chained: one's after is the next's before
        compile(before, "model.py", "exec")  # verify times each of these programs
    assert texts[-1] == path.read_bytes()
    # each rule's changes are on the text it ran from: its lines there show what it rewrote
    for before, entry in zip([MODEL.encode(), *texts], entries, strict=False):
        lines = before.decode().splitlines()
        for change in entry["changes"]:
            assert 1 <= change["line"] <= len(lines)
