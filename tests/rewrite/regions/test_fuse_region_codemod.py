"""fuse_region's codemod on golden fixtures: fixtures/<case>.in.py -> <case>.out.py.

A fixture may start with comment lines (kept in the output) that set the run:

    # codemod-args: {"targets": [[12, 14, {"chain": "gelu_tanh"}]]}   profile-mode targets (line, end, details)
    # rerun-targets: [[12, 14, {"chain": "gelu_tanh"}]]               targets of the second run (default: none)
    # expect-skipped: read again at line                               a skip whose reason holds this

Without targets the codemod runs in static mode (every exact equivalent it recognises). For every case:
the output equals the .out.py byte for byte, parses and compiles, the engine accepts it (its stability
check), and a second run on the output (static, or with `rerun-targets`) changes nothing. A fixture with `make_inputs()` (returning `(callable,
args)`) is run before and after the rewrite: outputs and gradients of inputs and parameters must agree
(fp32, CPU). The dropout fixtures are checked in distribution instead (dropout is random).
`OPADVISOR_REGEN_FIXTURES=1` rewrites the .out.py files from the codemod, for review with git diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import libcst as cst
import pytest
import torch
from libcst.codemod import CodemodContext

from opadvisor.rewrite.base import Target
from opadvisor.rewrite.engine import rewrite_source
from opadvisor.rules.regions.fuse_region import FuseRegionFacts
from opadvisor.rules.regions.fuse_region_fix import FuseRegionCodemod

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(FIXTURES.glob("*.in.py"))
REGEN = os.environ.get("OPADVISOR_REGEN_FIXTURES") == "1"
_HEADER = re.compile(r"^# (codemod-args|rerun-targets|expect-skipped): (.*)$")


def _out(case: Path) -> Path:
    return case.with_name(case.name.removesuffix(".in.py") + ".out.py")


def _targets(raw: list) -> list[Target]:
    return [
        Target(a, b, FuseRegionFacts.from_details(d[0], partial=True) if d and d[0] else None)
        for a, b, *d in raw
    ]


def _options(source: str) -> tuple[list[Target] | None, list[Target] | None, list[str]]:
    targets = rerun = None
    skipped = []
    for line in source.splitlines():
        m = _HEADER.match(line)
        if m and m.group(1) == "codemod-args":
            targets = _targets(json.loads(m.group(2))["targets"])
        elif m and m.group(1) == "rerun-targets":
            rerun = _targets(json.loads(m.group(2)))
        elif m:
            skipped.append(m.group(2).strip())
    return targets, rerun, skipped


def _run(source: str, targets: list[Target] | None) -> tuple[str, FuseRegionCodemod]:
    codemod = FuseRegionCodemod(CodemodContext(), targets)
    return codemod.transform_module(cst.parse_module(source)).code, codemod


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name.removesuffix(".in.py"))
def test_golden(case: Path) -> None:
    source = case.read_text()
    targets, rerun, skipped = _options(source)
    out, codemod = _run(source, targets)
    if REGEN:
        _out(case).write_text(out)
    assert out == _out(case).read_text()
    compile(out, str(case), "exec")
    if out == source:
        assert not codemod.changes, codemod.changes
    else:
        assert codemod.changes, "the file changed but no change was recorded"
    for reason in skipped:
        assert any(reason in n.message for n in codemod.skipped), (reason, codemod.skipped)
    # the engine's own checks (parse, compile, stability) accept it, and it writes the same
    after, _ = rewrite_source(source.encode(), "fuse_region", targets, case)
    assert after.decode() == out
    again, second = _run(out, rerun)
    assert again == out and not second.changes, "a second run changed the output"


def _exec(source: str, name: str) -> dict:
    namespace: dict = {"__name__": name}
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own fixture files
    return namespace


def _outputs_and_grads(source: str, name: str):
    torch.manual_seed(0)
    fn, args = _exec(source, name)["make_inputs"]()
    out = fn(*args)
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]
    weights = torch.Generator().manual_seed(1)
    sum((o * torch.randn(o.shape, generator=weights)).sum() for o in outs).backward()
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        grads += [p.grad for p in fn.parameters()]
    return [o.detach() for o in outs], grads


RUNNABLE = [c for c in CASES if "def make_inputs" in c.read_text() and c.read_text() != _out(c).read_text()]


@pytest.mark.parametrize("case", RUNNABLE, ids=lambda p: p.name.removesuffix(".in.py"))
def test_same_values_and_gradients(case: Path, monkeypatch) -> None:
    # a function given @compile_region runs as written here: what the rewrite must keep is the function;
    # inductor's code for it is torch's business (tests/kernels compiles one for real)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    before = _outputs_and_grads(case.read_text(), "before")
    after = _outputs_and_grads(_out(case).read_text(), "after")
    for a, b in zip([*before[0], *before[1]], [*after[0], *after[1]], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["Drop", "drop_where", "drop_fixed"])
def test_inline_dropout_keeps_the_distribution(name: str) -> None:
    case = FIXTURES / "dropout_inline.in.py"
    x = torch.ones(200, 500, requires_grad=True)
    for source in (case.read_text(), _out(case).read_text()):
        ns = _exec(source, "dropout")
        torch.manual_seed(0)
        fn = ns["Drop"](0.1) if name == "Drop" else ns[name]
        y = fn(x, 0.1) if name == "drop_where" else fn(x)
        (g,) = torch.autograd.grad(y.sum(), [x])
        kept = y != 0
        assert abs(kept.double().mean().item() - 0.9) < 0.005  # 100000 draws: 5 standard deviations
        torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.9))
        assert torch.equal(g, y.detach()), "the gradient must be the same mask and scale"


def test_dropout_function_call_sites_keep_the_distribution() -> None:
    case = FIXTURES / "dropout_function.in.py"
    x = torch.ones(100, 1000, requires_grad=True)
    for source in (case.read_text(), _out(case).read_text()):
        ns = _exec(source, "xdropout")
        torch.manual_seed(0)
        for y, p in ((ns["StableDropout"](0.25)(x), 0.25), (ns["embed_dropout"](x), 0.1)):
            (g,) = torch.autograd.grad(y.sum(), [x])
            kept = y != 0
            assert abs(kept.double().mean().item() - (1 - p)) < 0.007
            torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
            assert torch.equal(g, y.detach())
