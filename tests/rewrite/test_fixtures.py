"""Golden before/after fixtures for every codemod (TorchFix style): fixtures/<rule>/<case>.in.py.

For every case (see fixture_cases.py for the header options a case may set): the rewrite of `<case>.in.py`
(static mode unless the header names targets) must equal `<case>.out.py` byte for byte (a case whose two
files are equal is one the codemod must leave alone); the output re-parses and compiles; a second run
changes nothing. A case named `*_unsafe` runs with unsafe fixes allowed (`opadvisor apply --unsafe`).

Numerical equivalence: a fixture that defines `make_inputs()` returning `(callable, args)` is run before
and after the rewrite (fp32, CPU, dropout 0, the same seed, so modules start from the same weights): the
outputs and the gradients of every input and parameter must match, with a random weighting of the outputs
so the gradients are not trivially zero (softmax rows sum to one).
"""

from __future__ import annotations

import os
from pathlib import Path

import libcst as cst
import pytest
import torch
from fixture_cases import case_id, cases, expected_path, options

from opadvisor.rewrite.engine import rewrite_source
from opadvisor.rewrite.registry import LIBRARY_CODEMODS, fixable_rules

CASES = cases()
CPU_RULES = {
    "fused_softmax",
    "sdpa_attention",
    "fused_dropout_add",
    "manual_layernorm",
    "rnn_cell_loop",
}  # find on a CPU profile
# OPADVISOR_REGEN_FIXTURES=1 rewrites the .out.py files from the codemods, for review with `git diff`
REGEN = os.environ.get("OPADVISOR_REGEN_FIXTURES") == "1"
_id = case_id
_out = expected_path


def test_every_fixable_rule_has_fixtures():
    """Here (fixtures/<rule>/) or in a rule's own golden harness (a tests/rewrite/<folder>/fixtures/ whose
    test module names the rule: fuse_region's distribution checks for random rewrites)."""
    here = {p.parent.name for p in CASES}
    known = set(fixable_rules()) | set(LIBRARY_CODEMODS)  # library fixes' codemods have folders too
    assert here <= known, f"fixture folders of no fixable rule or library fix: {here - known}"
    elsewhere = {
        rule
        for folder in Path(__file__).parent.glob("*/fixtures")
        for test in folder.parent.glob("test_*.py")
        for rule in fixable_rules()
        if f'"{rule}"' in test.read_text() and any(folder.glob("*.in.py"))
    }
    assert set(fixable_rules()) <= here | elsewhere, "a fixable rule without golden fixtures"
    missing = [_id(p) for p in CASES if not _out(p).is_file()]
    assert not missing, f"fixtures without an .out.py: {missing}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_golden(case: Path):
    rule = case.parent.name
    before = case.read_bytes()
    opts = options(before.decode(), rule)
    kwargs = dict(opts.kwargs)
    unsafe = case.name.endswith("_unsafe.in.py") or bool(kwargs.pop("allow_unsafe", False))
    after, result = rewrite_source(before, rule, opts.targets, case, allow_unsafe=unsafe, options=kwargs)
    if REGEN:
        _out(case).write_bytes(after)
    expected = _out(case).read_bytes()
    assert after.decode() == expected.decode()
    assert after == expected  # line endings included
    cst.parse_module(after)
    compile(after, str(case), "exec")
    rerun = opts.rerun_targets if opts.rerun_targets is not None else opts.targets
    again, second = rewrite_source(after, rule, rerun, case, allow_unsafe=unsafe, options=kwargs)
    assert again == after and not second.changes, "the codemod is not idempotent"
    if before == expected:
        assert not result.changes
    else:
        assert result.changes, "the file changed but no change was recorded"
    if opts.changes is not None:
        assert len(result.changes) == opts.changes, result.changes
    for reason in opts.skipped:
        assert any(reason in note.message for note in result.skipped), (reason, result.skipped)


def _weighted_loss(out) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The tensor outputs, and their sum weighted by fixed random numbers (softmax rows sum to one)."""
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, torch.Tensor)]
    generator = torch.Generator(device="cpu").manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=generator, device="cpu").to(o.device)).sum() for o in outs)
    return outs, loss


def _run(source: bytes, name: str):
    """Outputs and gradients of the fixture's `make_inputs()` callable, dropout off (modules in eval mode)."""
    namespace: dict = {"__name__": name}
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own fixture files
    torch.manual_seed(0)
    fn, args = namespace["make_inputs"]()
    if isinstance(fn, torch.nn.Module):
        fn.eval()  # dropout draws different random numbers before and after: compare without it
        for m in fn.modules():  # cuDNN runs an RNN's backward only in training mode: no dropout there
            if isinstance(m, torch.nn.RNNBase):
                m.dropout = 0.0
                m.train()
    outs, loss = _weighted_loss(fn(*args))
    loss.backward()
    grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [(n, p.grad) for n, p in fn.named_parameters()] if isinstance(fn, torch.nn.Module) else []
    return [o.detach() for o in outs], grads, params


RUNNABLE = [
    p for p in CASES if b"def make_inputs" in p.read_bytes() and p.read_bytes() != _out(p).read_bytes()
]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding, relative to the tensor's scale (a GEMM on padded sizes reduces in
    another order: on an H200 the padded LM head's upstream gradients differed by 7e-7 of their scale)."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", RUNNABLE, ids=_id)
def test_numerically_equivalent(case: Path):
    pytest.importorskip("opadvisor.kernels", reason="opadvisor.kernels is not importable")
    before = _run(case.read_bytes(), f"before_{case.stem}")
    after = _run(_out(case).read_bytes(), f"after_{case.stem}")
    for a, b in zip(before[0], after[0], strict=True):
        _close(b, a, "outputs differ")
    for a, b in zip(before[1], after[1], strict=True):
        _close(b, a, "input gradients differ")
    assert [n for n, _ in before[2]] == [n for n, _ in after[2]], (
        "the parameters differ (state_dict changed?)"
    )
    for (name, a), (_, b) in zip(before[2], after[2], strict=True):
        if a is None:
            assert b is None
            continue
        _close(b, a, f"gradient of {name} differs")


@pytest.mark.gpu
@pytest.mark.parametrize("case", RUNNABLE, ids=_id)
def test_numerically_equivalent_on_cuda(case: Path):
    """The same comparison on the GPU, where the fused kernels run as Triton kernels (fp32)."""
    pytest.importorskip("opadvisor.kernels", reason="opadvisor.kernels is not importable")
    torch.set_default_device("cuda")
    try:
        test_numerically_equivalent(case)
    finally:
        torch.set_default_device("cpu")


# ---- profile mode: the rule finds the form, and its facts lead the codemod to the same rewrite -------------
# library fixes' cases are profiled in tests/library (their findings are in an installed package's code)
PROFILED = [
    p for p in CASES if b"def make_inputs" in p.read_bytes() and p.parent.name not in LIBRARY_CODEMODS
]


def profiled_expected(case: Path) -> Path:
    """`<case>.profiled.out.py` where the facts of a profile lead elsewhere than the source alone, else .out.py."""
    special = case.with_name(case.name.removesuffix(".in.py") + ".profiled.out.py")
    return special if special.is_file() else _out(case)


# rule -> its note on a CPU profile ("needs a CUDA profile: ..."): the same for every fixture of the rule, so
# the rule's other fixtures are skipped without being profiled again (on this xdist worker)
NEEDS_CUDA: dict[str, str] = {}


def profiled_targets(case: Path, rule: str) -> tuple[list, list]:
    """(targets, findings) of `rule` in this fixture: `make_inputs()` profiled in training mode on the CPU."""
    from opadvisor.profile.runner import profile_steps
    from opadvisor.rewrite.base import finding_target
    from opadvisor.rewrite.registry import get_codemod
    from opadvisor.rules.engine import analyse

    if rule in NEEDS_CUDA:
        pytest.skip(f"{rule} on a CPU profile: {NEEDS_CUDA[rule]}")
    namespace: dict = {"__name__": f"profiled_{case.stem}"}
    exec(compile(case.read_bytes(), str(case), "exec"), namespace)  # noqa: S102 - our own fixture files
    torch.manual_seed(0)
    fn, args = namespace["make_inputs"]()

    def step() -> None:
        _, loss = _weighted_loss(fn(*args))
        loss.backward()

    profile = profile_steps(step, case, steps=1, warmup=1)
    report = analyse([profile], select=[rule])
    if report.notes:
        if report.notes[0].message.startswith("needs a CUDA profile"):
            NEEDS_CUDA[rule] = report.notes[0].message
        pytest.skip(f"{rule} on a CPU profile: {report.notes[0].message}")
    findings = [f for f in report.findings if Path(f.path) == case.resolve()]
    facts_type = get_codemod(rule).FACTS
    return [finding_target(f, facts_type) for f in findings if f.fix != "none"], findings


@pytest.mark.parametrize("case", PROFILED, ids=_id)
def test_profiled(case: Path):
    """The fixture profiled, its findings applied as `opadvisor apply` would: the expected rewrite."""
    rule = case.parent.name
    unsafe = case.name.endswith("_unsafe.in.py")
    targets, findings = profiled_targets(case, rule)
    allowed = [
        t
        for t, f in zip(targets, [f for f in findings if f.fix != "none"], strict=True)
        if unsafe or f.fix == "safe"
    ]
    after, result = rewrite_source(case.read_bytes(), rule, allowed, case, allow_unsafe=unsafe)
    expected = profiled_expected(case)
    if REGEN and expected.name.endswith(".profiled.out.py"):
        expected.write_bytes(after)
    assert after.decode() == expected.read_bytes().decode(), [
        (f.line, f.end_line, f.message) for f in findings
    ]
