"""The torch.compile fixes (graph_break, recompile) run: each rewritten model compiles as the fix promises and
computes what the original computed.

For every kind of graph break: the original forward fails under `torch.compile(..., fullgraph=True)` (with
the `aot_eager` backend: no C++ compile here), the rewritten one compiles whole, and its outputs and
gradients equal the original's run eagerly from the same weights. An untraceable call stays a break (a
`torch.compiler.disable`d function is one dynamo steps over): there the rewrite must leave fewer graphs. A
shape recompile: the rewritten `torch.compile(..., dynamic=True)` compiles once for every size. Every golden
fixture of both rules is applied again with its targets moved onto the output as apply moves them: nothing
changes. The process-wide dynamo settings the rewritten files make are put back after each test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from fixture_cases import cases, expected_path, fixture_target, options

from opadvisor.rewrite.base import Target
from opadvisor.rewrite.engine import LineMap, rewrite_source

pytest.importorskip("torch._dynamo.testing")
from torch._dynamo.testing import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _dynamo_settings():
    """Each test starts from dynamo's defaults and leaves them as it found them (the rewritten files set
    `capture_scalar_outputs` and add to `reorderable_logging_functions` when imported)."""
    config = torch._dynamo.config
    saved = (config.capture_scalar_outputs, set(config.reorderable_logging_functions))
    torch._dynamo.reset()
    yield
    config.capture_scalar_outputs = saved[0]
    config.reorderable_logging_functions = saved[1]
    torch._dynamo.reset()


def _line(source: str, text: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def _target(rule: str, source: str, first: str, last: str | None = None, **facts) -> Target:
    """A target from the statement starting at the line holding `first` to the one holding `last`."""
    start = _line(source, first)
    end = _line(source, last) if last else start
    where = {"line": start} if rule == "graph_break" else {}  # the break's line: a graph_break fact only
    return fixture_target(rule, start, end, {**where, **facts})


def _rewrite(rule: str, source: str, targets: list[Target]) -> str:
    after, result = rewrite_source(source.encode(), rule, targets, "model.py")
    assert result.changes, result.skipped
    return after.decode()


def _load(folder: Path, name: str, source: str):
    """`source` imported as module `name` from a file in `folder` (dynamo reads the file's lines)."""
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _run(model: torch.nn.Module, *inputs: torch.Tensor):
    """Outputs and the gradients of inputs and parameters, for a fixed random weighting of the output."""
    inputs = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs)
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    grads = [x.grad for x in inputs if x.requires_grad] + [p.grad for p in model.parameters()]
    return out.detach(), grads


def _assert_same(actual, expected) -> None:
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    assert len(actual[1]) == len(expected[1])
    for a, e in zip(actual[1], expected[1], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def _breaks(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """How many graph breaks compiling `model` (without fullgraph, as scripts compile) meets."""
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(*inputs).graph_break_count


def _check_fix(
    tmp_path: Path, before: str, after: str, *inputs: torch.Tensor, fullgraph_raised: bool = True
) -> str:
    """The original breaks (and raises under fullgraph=True, where torch does: torch 2.13 traces `.item()`
    under fullgraph by itself), the rewrite compiles whole, also under fullgraph=True, and computes the same
    outputs and gradients as the original run eagerly; what the compiled rewrite printed."""
    original = _load(tmp_path, "before_fix", before)
    torch.manual_seed(0)
    eager = original.Model()
    expected = _run(eager, *inputs)
    assert _breaks(eager, *inputs) >= 1
    if fullgraph_raised:
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported):
            _run(torch.compile(eager, backend="aot_eager", fullgraph=True), *inputs)
    rewritten = _load(tmp_path, "after_fix", after)  # its config lines take effect here
    torch.manual_seed(0)
    model = rewritten.Model()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert _breaks(model, *inputs) == 0
        torch._dynamo.reset()
        actual = _run(torch.compile(model, backend="aot_eager", fullgraph=True), *inputs)
    _assert_same(actual, expected)
    return printed.getvalue()


HEADER = """import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
"""
FWD = {"function": "forward", "compiled_function": "forward"}


def test_print_made_reorderable(tmp_path: Path) -> None:
    before = (
        HEADER
        + """
    def forward(self, x):
        y = torch.tanh(self.proj(x))
        print("mean", y.mean())
        return y * 2
"""
    )
    after = _rewrite("graph_break", before, [_target("graph_break", before, "print(", kind="print", **FWD)])
    assert "reorderable_logging_functions.add(print)" in after
    printed = _check_fix(tmp_path, before, after, torch.randn(4, 8))
    assert (
        printed.count("mean tensor(") == 2
    )  # explain's run and the compiled one: after the graph, the value  # printed after the graph, the tensor's value


@pytest.mark.parametrize(
    ("read", "use", "kept"),
    [
        ("y.abs().max().item()", "return y / (v + 1.0)", "y.abs().max().detach()"),
        ("float(y.norm())", "return torch.clamp(y, max=v) * 2", "y.norm().detach().float()"),
        ("int(x.shape[0] * y.mean().abs() + 1)", "return y * v", ".detach().long()"),
    ],
    ids=["item", "float", "int"],
)
def test_scalar_read_kept_as_tensor(tmp_path: Path, read: str, use: str, kept: str) -> None:
    before = (
        HEADER
        + f"""
    def forward(self, x):
        y = self.proj(x)
        v = {read}
        {use}
"""
    )
    after = _rewrite(
        "graph_break", before, [_target("graph_break", before, "v = ", kind="scalar_read", **FWD)]
    )
    assert kept in after and "capture_scalar_outputs" not in after
    _check_fix(tmp_path, before, after, torch.randn(4, 8), fullgraph_raised=False)


def test_scalar_read_captured(tmp_path: Path) -> None:
    before = (
        HEADER
        + """
    def forward(self, x):
        y = self.proj(x)
        peak = max(y.abs().max().item(), 1e-6)
        return y / peak
"""
    )
    after = _rewrite(
        "graph_break", before, [_target("graph_break", before, "peak = ", kind="scalar_read", **FWD)]
    )
    assert "torch._dynamo.config.capture_scalar_outputs = True" in after
    _check_fix(tmp_path, before, after, torch.randn(4, 8), fullgraph_raised=False)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["taken", "not_taken"])
def test_tensor_branch_becomes_where(tmp_path: Path, sign: float) -> None:
    before = (
        HEADER
        + """
    def forward(self, x):
        y = self.proj(x)
        if x.sum() > 0:  # which branch: data dependent
            y = y * 2
        else:
            y = y - 1
        if x.mean() > 0:
            y += torch.sigmoid(y)
        return y
"""
    )
    targets = [
        _target("graph_break", before, "if x.sum()", "y = y - 1", kind="tensor_branch", **FWD),
        _target("graph_break", before, "if x.mean()", "y += ", kind="tensor_branch", **FWD),
    ]
    after = _rewrite("graph_break", before, targets)
    assert after.count("torch.where(") == 2
    _check_fix(tmp_path, before, after, sign * torch.rand(4, 8) + sign * 0.1)


def _graphs(model: torch.nn.Module, x: torch.Tensor) -> int:
    counter = CompileCounter()
    torch._dynamo.reset()
    torch.compile(model, backend=counter)(x)
    return counter.frame_count


def test_untraceable_call_disabled_in_its_helper(tmp_path: Path) -> None:
    """`@torch.compiler.disable` on the helper: dynamo steps over it (one break, at its call) instead of
    splitting the helper into graphs around the untraceable call; the same values."""
    before = (
        "import os\n\n"
        + HEADER
        + """
    def forward(self, x):
        y = self.proj(x)
        y = tag(y)
        return torch.relu(y)


def tag(t):
    t = t * 2
    pid = os.getpid()
    return t + pid % 2
"""
    )
    target = _target(
        "graph_break",
        before,
        "pid = os.getpid()",
        kind="unsupported_call",
        function="tag",
        compiled_function="forward",
        compiled_line=_line(before, "def forward"),
    )
    after = _rewrite("graph_break", before, [target])
    assert "@torch.compiler.disable\ndef tag(t):" in after
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    original = _load(tmp_path, "before_disable", before).Model()
    torch.manual_seed(0)
    rewritten = _load(tmp_path, "after_disable", after).Model()
    assert _graphs(rewritten, x) < _graphs(original, x)
    torch._dynamo.reset()
    expected = _run(original, x)
    _assert_same(_run(torch.compile(rewritten, backend="aot_eager"), x), expected)


def test_shape_recompile_compiles_once(tmp_path: Path) -> None:
    before = """import torch
import torch.nn as nn


def build(backend):
    model = nn.Linear(8, 8)
    return model, torch.compile(model, backend=backend)
"""
    target = _target("recompile", before, "torch.compile(", kind="shape", input="x", dim=0, values=["2", "3"])
    after = _rewrite("recompile", before, [target])
    assert "torch.compile(model, backend=backend, dynamic=True)" in after
    sizes = (2, 3, 4, 5)
    counts = []
    for name, source in (("before_dynamic", before), ("after_dynamic", after)):
        torch._dynamo.reset()
        counter = CompileCounter()
        torch.manual_seed(0)
        model, compiled = _load(tmp_path, name, source).build(counter)
        for n in sizes:
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x))
        counts.append(counter.frame_count)
    assert counts[1] == 1 < counts[0], counts


def test_scalar_recompile_compiles_once(tmp_path: Path) -> None:
    """A float argument that changes every call (a temperature): dynamic=True traces it as a symbol."""
    before = """import torch


def build(backend):
    def scaled(x, temperature):
        return torch.softmax(x / temperature, dim=-1)

    return scaled, torch.compile(scaled, backend=backend)
"""
    target = _target(
        "recompile", before, "torch.compile(", kind="scalar", input="temperature", values=["0.5", "0.6"]
    )
    after = _rewrite("recompile", before, [target])
    assert "torch.compile(scaled, backend=backend, dynamic=True)" in after
    counts = []
    for name, source in (("before_scalar", before), ("after_scalar", after)):
        torch._dynamo.reset()
        counter = CompileCounter()
        plain, compiled = _load(tmp_path, name, source).build(counter)
        x = torch.randn(4, 8)
        for temperature in (0.5, 0.6, 0.7, 0.8):
            torch.testing.assert_close(compiled(x, temperature), plain(x, temperature))
        counts.append(counter.frame_count)
    assert counts[1] == 1 < counts[0], counts


# ---- a second apply changes nothing: the targets moved onto the output as `opadvisor apply` moves them --------
FIXTURES = [*cases("graph_break"), *cases("recompile"), *cases("regional_compile")]


@pytest.mark.parametrize("case", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.name.removesuffix('.in.py')}")
def test_second_apply_changes_nothing(case: Path) -> None:
    rule = case.parent.name
    before, after = case.read_bytes(), expected_path(case).read_bytes()
    targets = options(before.decode(), rule).targets
    assert targets, "a fixture of a profile-only rule names its targets"
    line_map = LineMap(before, after)
    moved = [Target(*line_map.map(t.line, t.end_line)[:2], t.facts) for t in targets]
    again, result = rewrite_source(after, rule, moved, case)
    assert again == after and not result.changes, result.changes
