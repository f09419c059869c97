"""gemm_align and sparse_launch (and the chain rules' GPU numbers) on real H200 profiles kept in tests/data."""

from __future__ import annotations

import pytest
from rules_testlib import MY_RULES, REPO, SCRIPTS, expected_lines, gpu_fixture

from opadvisor.rules.engine import analyse


def run(name, rules=MY_RULES):
    return analyse([gpu_fixture(name)], select=rules)


def test_gemm_align_odd_linear_on_gpu():
    report = run("bf16_gemm", ["gemm_align"])
    assert len(report.findings) == 1
    f = report.findings[0]
    assert f.path == str(SCRIPTS / "bf16_gemm.py")
    assert (f.line, f.end_line) == expected_lines(SCRIPTS / "bf16_gemm.py", "gemm_align")
    assert f.fix == "safe" and f.details["kind"] == "linear"
    assert (f.details["in_features"], f.details["out_features"], f.details["padded_out_features"]) == (
        4096,
        30522,
        30528,
    )
    assert f.evidence.time_basis == "gpu" and f.evidence.kernel_count
    # measured: slower per FLOP than the aligned 4096x4096 product of the same run, saving estimated from that
    assert 0 < f.est_saving_ms_per_step < f.time_ms_per_step
    assert any("aligned products in this run" in n for n in f.evidence.notes)
    assert 0 < f.evidence.share_of_step < 1


def test_gemm_align_nothing_when_aligned_or_fp32():
    # the same script with a 30528-wide head (its odd Linear runs in fp32), and 8192-wide products
    assert run("bf16_gemm_aligned", ["gemm_align"]).findings == []
    assert run("busy_gpu", ["gemm_align"]).findings == []


def test_sparse_launch_finds_the_tiny_kernel_function():
    report = run("tiny_kernels", ["sparse_launch"])
    top = report.findings[0]
    assert top.rule == "sparse_launch" and top.function == "activation"
    fn_line = expected_lines(SCRIPTS / "tiny_kernels.py", "sparse_launch function")[0]
    assert fn_line <= top.line <= top.end_line <= fn_line + 5
    assert top.fix == "unsafe" and top.evidence.time_basis == "gpu"  # CUDA graphs (launch/sparse_launch_fix)
    steps = top.details["steps"]
    assert len(steps) == 3 and all(s["idle_share"] > 0.5 for s in steps)
    assert top.details["tiny_kernels_per_step"] > 1000
    assert any("CUDA graphs" in r for r in top.details["remedies"])
    assert top.evidence.share_of_step > 0.3


def test_sparse_launch_quiet_when_gpu_is_busy():
    report = run("busy_gpu", ["sparse_launch"])
    assert report.findings == [] and report.notes == []


def test_sparse_launch_on_cpu_profile_is_a_note(tmp_path):
    from opadvisor.profile.model import Profile

    report = analyse([Profile()], select=["sparse_launch"])
    assert report.findings == []
    assert len(report.notes) == 1 and "needs a CUDA profile" in report.notes[0].message


@pytest.mark.parametrize(
    ("example", "softmax", "attention", "head_line"),
    [
        ("bert_train", "scores.masked_fill(~mask", "scores = q @ k", "self.lm_head = nn.Linear"),
        ("gpt_train", "att = att.masked_fill", "att = (q @ k", "self.lm_head = nn.Linear"),
    ],
)
def test_examples_on_gpu(example, softmax, attention, head_line):
    """The GPU profiles of the examples: every pattern they hold, with GPU times and savings."""
    profile = gpu_fixture(example)
    path = REPO / "examples" / f"{example}.py"
    if any(profile.sources.get(str(path)) != sha for sha in [_sha(path)]):
        pytest.skip(f"examples/{example}.py changed since its GPU fixture was recorded")
    report = analyse([profile], select=MY_RULES)
    lines = path.read_text().splitlines()
    first = next(i for i, t in enumerate(lines, 1) if softmax in t)
    head = next(i for i, t in enumerate(lines, 1) if head_line in t)
    rules = {f.rule for f in report.findings}
    assert {"fused_softmax", "sdpa_attention", "fused_dropout_add", "gemm_align", "sparse_launch"} <= rules
    soft = [f for f in report.findings if f.rule == "fused_softmax"]
    assert len(soft) == 1 and soft[0].line == first
    assert [f.line for f in report.findings if f.rule == "gemm_align"] == [head]
    assert len([f for f in report.findings if f.rule == "fused_dropout_add"]) == 2
    for f in report.findings:
        assert f.evidence.time_basis == "gpu" and f.time_ms_per_step is not None
        assert f.est_saving_ms_per_step is not None and f.est_saving_ms_per_step <= f.time_ms_per_step + 1e-9


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_dropout_add_under_the_kernel_size_is_fixed_without_a_saving(monkeypatch):
    """The examples' GPU profiles run the chain on small tensors: below the size where
    opadvisor.kernels.bias_dropout_add fuses outside CUDA graphs (it runs the same chain there), the finding
    keeps its measured time and the safe fix but claims no saving, and says the kernel runs only inside a
    CUDA graph; over that size the saving is estimated from the profile."""
    from opadvisor.rules.dropout_add import fused_dropout_add

    small = [f for f in run("gpt_train", ["fused_dropout_add"]).findings]
    assert len(small) == 2
    for f in small:
        assert f.fix == "safe" and f.est_saving_ms_per_step == 0.0 and f.time_ms_per_step > 0
        assert "the fused kernel runs only inside CUDA graphs" in f.advice
        assert "sparse_launch" in f.advice
    monkeypatch.setattr(fused_dropout_add, "KERNEL_MIN_NUMEL", 1)
    large = run("gpt_train", ["fused_dropout_add"]).findings
    assert [f.fix for f in large] == ["safe", "safe"]
    assert all(0 < f.est_saving_ms_per_step <= f.time_ms_per_step for f in large)
    assert all("CUDA graphs" not in f.advice for f in large)


def test_suggest_table_says_why_a_fix_claims_no_saving(tmp_path, monkeypatch):
    """A fix offered with no saving (the small dropout-adds) shows its reason next to the apply command."""
    import shutil

    from typer.testing import CliRunner

    from opadvisor.cli import app

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(REPO / "tests" / "data" / "gpt_train.profile.json", run_dir / "profile.json")
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "400")
    res = CliRunner().invoke(app, ["suggest", str(run_dir), "--select", "fused_dropout_add"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("fix: opadvisor apply --rule fused_dropout_add") == 2
    assert res.stdout.count("(no saving claimed: at this size") == 2


def test_rule_threshold_is_the_kernels_dispatch_size():
    from opadvisor.kernels import dropout_add

    from opadvisor.rules.dropout_add import fused_dropout_add

    assert fused_dropout_add.KERNEL_MIN_NUMEL == dropout_add.SMALL_NUMEL
