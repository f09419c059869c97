"""Source analysis is bounded: read-through-temporaries never loops (issue 29), and past its budget a
rule's fix is reported as not checked, never hung and never half-written."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import libcst as cst
import pytest
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.rewrite import _budget
from opadvisor.rewrite._bindings import Resolver, block_index
from opadvisor.rewrite.base import Target
from opadvisor.rewrite.engine import dry_run, rewrite_source
from opadvisor.rules.regions.fuse_region import FuseRegionFacts

CAST_MASK = b"""import torch
from torch import nn


class M(nn.Module):
    def forward(self, out, mask):
        mask = mask.to(out.dtype)
        return out * mask
"""

RMS_NORM = b"""import torch
from torch import nn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
"""

SILU_THRICE = b"""import torch


def f(x):
    x = x * torch.sigmoid(x)
    x = x * torch.sigmoid(x)
    x = x * torch.sigmoid(x)
    return x
"""


def _plain_block(n: int) -> bytes:
    body = "".join(f"    v{i} = v{i - 1} * b + a\n" for i in range(1, n))
    return f"import torch\n\n\ndef f(a, b):\n    v0 = a + b\n{body}    return v{n - 1}\n".encode()


@pytest.mark.parametrize("source", [CAST_MASK, RMS_NORM, _plain_block(80)], ids=["cast", "rmsnorm", "80"])
def test_fuse_region_reads_rebound_names_to_the_end(source):
    after, result = rewrite_source(source, "fuse_region", None, "m.py", allow_unsafe=True)
    assert after == source  # nothing there is a hand-written activation or dropout
    assert result.changes == []


def test_repeated_silu_is_rewritten_each_time():
    after, result = rewrite_source(SILU_THRICE, "fuse_region", None, "m.py", allow_unsafe=True)
    assert after.decode().count("x = torch.nn.functional.silu(x)") == 3
    assert [n.line for n in result.changes] == [5, 6, 7]


def test_a_name_read_in_its_own_binding_resolves_to_the_earlier_one():
    stmts = list(cst.parse_module("x = a + 1\nx = x.to(t)\ny = x * 2\n").body)
    resolver = Resolver(stmts, 2)
    outer = stmts[2].body[0].value.left  # the x of `y = x * 2`
    value = resolver.resolve(outer)
    assert cst.Module([]).code_for_node(value) == "x.to(t)"
    inner = value.func.value  # the x of `x.to(t)`: statement 0's, never statement 1 again
    assert resolver.resolve(inner) is None  # a second binding of x is not followed ...
    assert resolver.stale == {"x"}  # ... and the leaf it leaves means another x at y: the match is refused


def test_resolver_follows_temporaries_relative_to_their_binding():
    stmts = list(cst.parse_module("g = torch.sigmoid(x)\nh = g * x\ny = h + 1\n").body)
    resolver = Resolver(stmts, 2)
    h = resolver.resolve(stmts[2].body[0].value.left)
    g = resolver.resolve(h.left)
    assert cst.Module([]).code_for_node(g) == "torch.sigmoid(x)"
    assert resolver.used == {"h": 1, "g": 0} and not resolver.stale


def test_block_index_lookup_and_rebinding():
    stmts = list(cst.parse_module("a = 1\nfor b in c:\n    pass\na = b\nd = a\n").body)
    index = block_index(stmts)
    assert index is block_index(stmts)  # built once per block
    assert index.lookup("a", before=3).index == 2
    assert index.lookup("a", before=2).index == 0
    assert index.lookup("b", before=3).value is None  # bound by a loop: not followed
    assert index.lookup("a", before=0) is None
    assert index.rebound({"a"}, 0, 3) and not index.rebound({"a"}, 0, 2)


def test_block_index_simple_bindings():
    """`name = value` look-ups (ChainFinder's temporaries, sdpa's mask values, fused_dropout_add's in-place
    check) go through the block's one index: other bindings (`+=`, a loop) are stepped over."""
    stmts = list(cst.parse_module("a = q @ k\na += m\nfor a in c:\n    pass\nb = a\na = b\n").body)
    index = block_index(stmts)
    assert index.lookup("a", before=3).value is None  # the nearest binding is the loop ...
    found = index.simple_before("a", before=3)  # ... the nearest `a = value` is the first statement
    assert found.index == 0 and cst.Module([]).code_for_node(found.value) == "q @ k"
    assert index.simple_before("a", before=3, start=1) is None
    assert index.simple_after("a", after=0).index == 4 and index.simple_after("a", after=4) is None


def test_over_budget_names_class_and_method():
    with _budget.analysis_budget(0.0):
        _budget.enter("M")
        _budget.enter("forward")
        with pytest.raises(_budget.OverBudget) as exc:
            _budget.check()
    assert exc.value.where == "M.forward"
    assert str(exc.value) == "not checked: source analysis over budget (in `M.forward`)"
    _budget.check()  # outside a budget: nothing


def _burn_cpu(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_garbage_collections_do_not_count_against_the_budget():
    """A full collection in a process holding a large heap costs this thread seconds of CPU time inside a
    pass whose own work is tiny (CI: a fixture's 0.05 s analysis skipped as over budget); the budget counts
    the analysis only. A collection is made slow here by a callback that burns CPU when it starts."""

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "start":
            _burn_cpu(0.3)

    gc.callbacks.append(slow_collection)
    try:
        with _budget.analysis_budget(0.2):
            _budget.start_pass()
            gc.collect()
            for _ in range(_budget.CLOCK_EVERY):
                _budget.check()  # 0.3 s in the collector, none of it analysis: within 0.2 s
            _burn_cpu(0.25)  # the analysis itself past its budget
            with pytest.raises(_budget.OverBudget):
                for _ in range(_budget.CLOCK_EVERY):
                    _budget.check()
    finally:
        gc.callbacks.remove(slow_collection)


def test_over_budget_blocks_the_dry_run(tmp_path, monkeypatch):
    monkeypatch.setenv(_budget.BUDGET_ENV, "1e-9")
    path = tmp_path / "m.py"
    path.write_bytes(b"def forward(x):\n    return x * torch.sigmoid(x)\n")
    (reason,) = dry_run(path, "fuse_region", [Target(2, 2, FuseRegionFacts(chain="silu"))])
    assert reason == "not checked: source analysis over budget (in `forward`)"
    # the engine remembers the verdict (engine.rewrite_source): recalled, it says the same
    (again,) = dry_run(path, "fuse_region", [Target(2, 2, FuseRegionFacts(chain="silu"))])
    assert again == reason


def test_over_budget_apply_skips_the_rule_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # forward first: the first check (a tiny budget's overrun) is made there
    source = b"def forward(x):\n    return x * torch.sigmoid(x)\n\n\nimport torch  # noqa: E402\n"
    model: Path = tmp_path / "m.py"
    model.write_bytes(source)
    monkeypatch.setenv(_budget.BUDGET_ENV, "1e-9")
    result = CliRunner().invoke(app, ["apply", "--rule", "fuse_region", "m.py"])
    assert "m.py: fuse_region: not checked: source analysis over budget (in `forward`)" in result.stderr
    assert result.exit_code == 0, result.stderr
    assert model.read_bytes() == source
    monkeypatch.delenv(_budget.BUDGET_ENV)
    result = CliRunner().invoke(app, ["apply", "--rule", "fuse_region", "m.py"])
    assert result.exit_code == 0, result.stderr
    assert "torch.nn.functional.silu(x)" in model.read_text()


TWO_FUNCTIONS = b"""import torch


def f(x):
    return x * torch.sigmoid(x)


def g(y):
    return y * torch.sigmoid(y)
"""


def test_profile_mode_analyses_only_the_targeted_blocks():
    from opadvisor.rewrite import _bindings
    from opadvisor.rewrite.engine import _parse, _run_once
    from opadvisor.rules.regions.fuse_region_fix import FuseRegionCodemod

    _bindings._INDEXES.clear()
    module = _parse(TWO_FUNCTIONS, "m.py")
    new, codemod = _run_once(FuseRegionCodemod, module, [Target(5, 5, FuseRegionFacts(chain="silu"))], "m.py")
    assert "return torch.nn.functional.silu(x)" in new.code
    assert "return y * torch.sigmoid(y)" in new.code
    indexed = [cst.Module(list(index.stmts)).code for index in _bindings._INDEXES.values()]
    assert any("sigmoid(x)" in text for text in indexed)
    assert not any("sigmoid(y)" in text for text in indexed)  # g's block was never read


def test_a_temporary_read_twice_per_statement_converts_once_each():
    # a{i} = a{i-1} * a{i-1}: read through, 2**24 conversions before the memo (the budget cut them)
    body = "".join(f"    a{i} = a{i - 1} * a{i - 1}\n" for i in range(1, 25))
    source = (
        "import torch\n\n\ndef f(x):\n    a0 = x * torch.sigmoid(x)\n"
        f"{body}    return a24 * torch.sigmoid(a24)\n"
    ).encode()
    after, result = rewrite_source(source, "fuse_region", None, "m.py", allow_unsafe=True)
    assert "a0 = torch.nn.functional.silu(x)" in after.decode()
    assert "return torch.nn.functional.silu(a24)" in after.decode()
    assert len(result.changes) == 2
