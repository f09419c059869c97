"""`opadvisor verify` end to end on CPU: the original rebuilt from backups, parity, exit codes, JSON.

The rewrites here are made by hand with `fake_apply` (what `opadvisor apply` records), so these tests pin
verify's own behaviour: a correct rewrite passes, a wrong one fails with exit 1 and its first diverging step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner
from verify_helpers import EXAMPLES, TINY, fake_apply, make_project

from opadvisor.cli import app

FAST = ["verify", "--steps", "3", "--no-timing", "--no-reprofile"]

BERT_ATTENTION = """\
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1)
        probs = probs.masked_fill(~mask, 0.0)
        probs = self.attn_dropout(probs)
        ctx = probs @ v
"""
GPT_ATTENTION = """\
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
"""

TRAIN = """\
import torch
from model import Net

torch.manual_seed(0)
net = Net()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(1000):
    loss = ((net(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(step, loss.item())
"""
MODEL = """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.lin(self.drop(x))
"""


def verify(project: Path, *args: str) -> tuple[int, str]:
    import os

    cwd = os.getcwd()
    os.chdir(project)
    try:
        res = CliRunner().invoke(app, [*FAST, *args])
    finally:
        os.chdir(cwd)
    return res.exit_code, res.output


def example(tmp_path: Path, name: str) -> tuple[Path, Path]:
    return make_project(tmp_path, {"train.py": (EXAMPLES / name).read_text()}, "train.py", TINY)


def small(tmp_path: Path) -> tuple[Path, Path]:
    return make_project(tmp_path, {"train.py": TRAIN, "model.py": MODEL}, "train.py", [])


def test_nothing_applied_is_exit_2(tmp_path: Path) -> None:
    project, _ = small(tmp_path)
    code, out = verify(project)
    assert code == 2 and "nothing applied in this run: run opadvisor apply first" in out


def test_bert_sdpa_rewrite_passes(tmp_path: Path) -> None:
    """A real rewrite passes, with dropout disabled in both runs (an unchanged copy passing is the same
    path with nothing rewritten: one verify proves both)."""
    project, run_dir = example(tmp_path, "bert_train.py")
    sdpa = (
        "        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, "
        "dropout_p=self.attn_dropout.p if self.training else 0.0)\n"
    )
    fake_apply(run_dir, project / "train.py", BERT_ATTENTION, sdpa, rule="sdpa_attention")
    code, out = verify(project)
    assert code == 0, out
    assert "parity passed" in out and "dropout was disabled" in out


def test_bert_kernel_rewrite_passes_with_kernel_dropout_neutralised(tmp_path: Path, monkeypatch) -> None:
    # dropout_p is a literal here: parity holds only because the harness forces the kernel's p to 0
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the children run the CPU reference
    fused = (
        "        probs = masked_softmax(scores, ~mask, fill_value=torch.finfo(scores.dtype).min, "
        "zero_masked=True, dropout_p=0.1, training=self.training)\n"
    )
    project, run_dir = example(tmp_path, "bert_train.py")
    old = BERT_ATTENTION.splitlines(keepends=True)
    fake_apply(run_dir, project / "train.py", "".join(old[1:5]), fused)
    fake_apply(
        run_dir,
        project / "train.py",
        "import math\n",
        "import math\n\nfrom opadvisor.kernels import masked_softmax\n",
    )
    code, out = verify(project, "--format", "json")
    assert code == 0, out
    report = json.loads(out)
    # on the CPU without Triton's interpreter the kernel cannot run: the record and a warning say so
    assert report["fused_calls"] == [
        {"op": "masked_softmax", "rules": ["fused_softmax"], "counts": {"reference": 3}, "run": "parity"}
    ]
    (warning,) = report["warnings"]
    assert warning.startswith("opadvisor.kernels.masked_softmax (fused_softmax's fix) never ran its kernel")


@pytest.mark.slow
def test_the_kernel_run_under_the_interpreter_is_recorded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children run the Triton kernel on the CPU
    fused = (
        "        probs = masked_softmax(scores, ~mask, fill_value=torch.finfo(scores.dtype).min, "
        "zero_masked=True)\n"
    )
    project, run_dir = example(tmp_path, "bert_train.py")
    fake_apply(run_dir, project / "train.py", "".join(BERT_ATTENTION.splitlines(keepends=True)[1:4]), fused)
    fake_apply(
        run_dir,
        project / "train.py",
        "import math\n",
        "import math\n\nfrom opadvisor.kernels import masked_softmax\n",
    )
    code, out = verify(project, "--steps", "2", "--format", "json")
    assert code == 0, out
    report = json.loads(out)
    assert report["fused_calls"][0]["counts"] == {"kernel": 2} and report["warnings"] == []
    assert report["parity"]["gradients"]["ok"]


def test_bert_flipped_mask_fails_at_step_1(tmp_path: Path) -> None:
    project, run_dir = example(tmp_path, "bert_train.py")
    fake_apply(run_dir, project / "train.py", "masked_fill(~mask", "masked_fill(mask", count=2)
    code, out = verify(project)
    assert code == 1, out
    assert "parity FAILED" in out and "losses diverge at step 1" in out


def test_gpt_sdpa_rewrite_passes_and_json(tmp_path: Path) -> None:
    project, run_dir = example(tmp_path, "gpt_train.py")
    sdpa = (
        "        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, "
        "dropout_p=self.attn_dropout.p if self.training else 0.0)\n"
    )
    fake_apply(run_dir, project / "train.py", GPT_ATTENTION, sdpa, rule="sdpa_attention")
    code, out = verify(project, "--format", "json")
    assert code == 0, out
    data = json.loads(out)
    assert data["schema"] == 1 and data["ok"] and data["applied_rules"] == ["sdpa_attention"]
    assert [s["step"] for s in data["parity"]["steps"]] == [1, 2, 3]
    assert data["parity"]["precision"] == "fp32" and data["parity"]["dropout_disabled"]
    assert data["parity"]["grad_norm"]["ok"] is True


def test_every_gradient_is_compared_and_the_tolerances_are_said(tmp_path: Path, monkeypatch) -> None:
    """The original's dropout is a module, the rewrite's a function drawing other random numbers first:
    both are neutralised in the parity runs, so every gradient matches (one verify for both promises)."""
    from opadvisor.verify import core

    project, run_dir = small(tmp_path)
    fake_apply(
        run_dir,
        project / "model.py",
        "self.lin(self.drop(x))",
        "self.lin(torch.nn.functional.dropout(torch.rand_like(x) * 0 + x, 0.3, self.training))",
    )
    reports = []
    real = core.verify
    monkeypatch.setattr(core, "verify", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    code, out = verify(project, "--format", "json")
    assert code == 0, out
    parity = json.loads(out)["parity"]
    grads = parity["gradients"]
    assert grads["ok"] and grads["compared"] == 2 and grads["worst"]["name"] in ("lin.weight", "lin.bias")
    tol = parity["tolerances"]
    assert tol["precision"] == "fp32" and tol["depth"] == 1 and tol["longest_reduction"] == 16  # 16 rows
    assert grads["tolerance"] == tol["grad_rtol"] and parity["rtol"] == tol["loss_rtol"]
    # the table of the same report (the script's two runs are not made again)
    monkeypatch.setattr(core, "verify", lambda *a, **k: reports[0])
    code, out = verify(project)
    assert code == 0, out
    assert "gradients at step 1: 2 tensors compared, worst lin." in " ".join(out.split())
    assert "tolerances derived: fp32 (unit roundoff 6e-08), longest reduction 16" in " ".join(out.split())


def test_a_parameter_that_stops_getting_a_gradient_fails_by_name(tmp_path: Path) -> None:
    # a learnable scale made a constant: the first loss is the same, its gradient is gone
    model = MODEL.replace(
        "        self.drop = nn.Dropout(0.5)\n",
        "        self.drop = nn.Dropout(0.5)\n        self.scale = nn.Parameter(torch.ones(1))\n",
    ).replace("return self.lin(self.drop(x))", "return self.lin(self.drop(x)) * self.scale")
    project, run_dir = make_project(tmp_path, {"train.py": TRAIN, "model.py": model}, "train.py", [])
    fake_apply(run_dir, project / "model.py", "* self.scale", "* self.scale.detach()")
    code, out = verify(project, "--steps", "1", "--format", "json")
    parity = json.loads(out)["parity"]
    assert code == 1 and parity["steps"][0]["diff"] == 0.0  # the loss alone would pass
    assert parity["message"] == "gradients differ at step 1: scale [1]: no gradient in the rewrite"
    assert parity["first_diverging_step"] == 1 and parity["gradients"]["failing_count"] == 1


def test_wrong_rewrite_of_an_imported_module_is_caught(tmp_path: Path) -> None:
    # The original comes from the backup through the import hook; were it not, both runs would agree.
    project, run_dir = small(tmp_path)
    fake_apply(run_dir, project / "model.py", "self.lin(self.drop(x))", "self.lin(self.drop(x)) * 1.01")
    code, out = verify(project, "--format", "json")
    assert code == 1
    data = json.loads(out)
    assert data["parity"]["first_diverging_step"] == 1 and "step 1" in data["parity"]["message"]


def test_only_a_rewritten_file_the_script_never_imports_is_named(tmp_path: Path) -> None:
    """unused.py is named; the rewritten script and the module it imports are not (one verify for both)."""
    project, run_dir = small(tmp_path)
    (project / "unused.py").write_text("x = 1\n")
    fake_apply(run_dir, project / "unused.py", "x = 1", "x = 2")
    fake_apply(run_dir, project / "model.py", "self.lin(self.drop(x))", "self.lin(self.drop(x))  # same")
    script = project / "train.py"
    text = script.read_text()
    fake_apply(run_dir, script, text.splitlines()[0], text.splitlines()[0] + "  # same")
    code, out = verify(project, "--format", "json")
    assert code == 0, out
    unused = [n for n in json.loads(out)["notes"] if "never imported" in n]
    assert len(unused) == 1 and "unused.py was never imported" in unused[0], out


def test_rewrite_that_crashes_is_exit_1(tmp_path: Path) -> None:
    project, run_dir = small(tmp_path)
    fake_apply(run_dir, project / "model.py", "return self.lin(self.drop(x))", "raise ValueError('boom')")
    code, out = verify(project)
    assert code == 1
    assert "failed at step 1" in out and "ValueError: boom" in out


def test_original_that_fails_is_exit_2(tmp_path: Path) -> None:
    project, run_dir = make_project(tmp_path, {"train.py": "raise SystemExit(3)\n"}, "train.py", [])
    fake_apply(run_dir, project / "train.py", "3", "0")
    code, out = verify(project)
    assert code == 2 and "the original script failed" in out


@pytest.mark.slow
def test_a_slower_rewrite_is_said_per_rule_and_fails_with_fail_slower(tmp_path: Path) -> None:
    project, run_dir = small(tmp_path)
    # two rules: a neutral edit, then one that sleeps 30 ms in every forward (the step takes ~1 ms)
    fake_apply(run_dir, project / "model.py", "import torch\n", "import time\n\nimport torch\n")
    fake_apply(
        run_dir,
        project / "model.py",
        "return self.lin(self.drop(x))",
        "time.sleep(0.03)\n        return self.lin(self.drop(x))",
        rule="gemm_align",
    )
    args = ("--timing", "--warmup", "1", "--repeats", "2", "--fail-slower", "--format", "json")
    code, out = verify(project, *args)
    data = json.loads(out)
    assert code == 1 and data["slower"] is True and data["ok"] is False and data["parity"]["ok"] is True
    timing = data["timing"]
    assert timing["repeats"] == 2 and timing["before"]["steps"] == 6 and timing["after"]["steps"] == 6
    assert len(timing["before"]["run_medians_ms"]) == 2 and timing["confidence"] == 0.95
    assert timing["verdict"] == "slower" and timing["saved_high_ms"] < 0 < 1 - timing["speedup_high"]
    assert timing["speedup_low"] <= timing["speedup"] <= timing["speedup_high"]
    first, second = timing["rules"]  # the program with fused_softmax only, then with both
    assert (first["rule"], second["rule"]) == ("fused_softmax", "gemm_align")
    assert second["verdict"] == "slower" and second["saved_ms"] < -20
    assert first["after"]["median_ms"] == second["before"]["median_ms"]  # one measurement, shared
    assert first["saved_ms"] + second["saved_ms"] == pytest.approx(timing["saved_ms"])
    assert timing["rules_note"] is None


def test_bad_options_are_exit_2(tmp_path: Path) -> None:
    project, run_dir = small(tmp_path)
    fake_apply(run_dir, project / "model.py", "self.lin(self.drop(x))", "self.lin(x)")
    assert verify(project, "--steps", "0")[0] == 2
    assert verify(project, "no-such-run")[0] == 2


def test_compile_times_both_programs_compiled_and_says_what_it_compiled(tmp_path: Path) -> None:
    """--compile (issue 31): each program's model compiled in place from its second call in the timing
    phase (aot_eager here: no C++ compile), parity eager."""
    project, run_dir = small(tmp_path)
    fake_apply(run_dir, project / "model.py", "self.lin(self.drop(x))", "self.lin(x)")
    args = ("--timing", "--warmup", "2", "--repeats", "1", "--no-per-rule", "--format", "json")
    code, out = verify(project, *args, "--compile", "--compile-backend", "aot_eager")
    data = json.loads(out)
    assert code == 0 and data["parity"]["ok"], out
    compiled = data["timing"]["compiled"]
    assert compiled == {p: {"module": "Net", "backend": "aot_eager"} for p in ("original", "rewrite")}
    assert "--compile: the rewrite ran Net compiled (torch.compile, backend aot_eager)" in " ".join(
        data["notes"]
    )


def test_the_harness_compiles_the_first_trained_module_once_and_leaves_a_compiled_one() -> None:
    import torch
    from torch import nn

    from opadvisor.verify.harness import install_compile

    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = len(hooks)
    result: dict = {}
    install_compile("eager", result)
    net, aug = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.ReLU()
    aug(torch.randn(2, 4))  # no trainable parameters: not the model
    net(torch.randn(2, 4))
    assert result == {"compiled": {"module": "Sequential", "backend": "eager"}}
    assert net._compiled_call_impl is not None and len(hooks) == before  # the hook removed itself

    result = {}
    install_compile("eager", result)
    torch.compile(nn.Linear(4, 4), backend="eager")(torch.randn(2, 4))
    assert result == {"compiled": {"skipped": "the script compiles its model itself"}}
    assert len(hooks) == before
