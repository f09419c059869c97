"""Targets restrict the four codemods to the lines a profile names, and the finding's details steer them."""

from __future__ import annotations

import textwrap

import pytest
from remaining_helpers import run

from opadvisor.rewrite.base import Target
from opadvisor.rules.data.dataloader_stall import CopySite, DataLoaderFacts
from opadvisor.rules.optimizer.fused_optimizer import FusedOptimizerFacts

OPTIMIZERS = textwrap.dedent(
    """\
    import torch

    model = torch.nn.Linear(4, 4)
    first = torch.optim.AdamW(model.parameters(), lr=1e-3)
    second = torch.optim.SGD(
        model.parameters(),
        lr=0.1,
    )
    """
)


def test_fused_optimizer_only_targeted_construction() -> None:
    out, cm = run("fused_optimizer", OPTIMIZERS, [Target(5, 8, FusedOptimizerFacts(param_devices=["cuda"]))])
    assert "first = torch.optim.AdamW(model.parameters(), lr=1e-3)\n" in out
    assert "    lr=0.1,\n    fused=True,\n)" in out
    assert [n.line for n in cm.changes] == [5]
    assert "on cuda" in cm.changes[0].message


def test_fused_optimizer_no_targets_in_file_changes_nothing() -> None:
    out, cm = run("fused_optimizer", OPTIMIZERS, [])
    assert out == OPTIMIZERS and not cm.changes


@pytest.mark.parametrize(
    ("details", "reason"),
    [
        ({"param_devices": ["meta"]}, "parameters on meta"),
        ({"param_devices": ["cuda"], "param_dtypes": ["torch.float32", "torch.int64"]}, "dtype int64"),
        ({"param_devices": ["cuda"], "param_dtypes": ["complex64"]}, "dtype complex64"),
    ],
)
def test_fused_optimizer_refuses_what_the_profile_rules_out(details: dict, reason: str) -> None:
    out, cm = run("fused_optimizer", OPTIMIZERS, [Target(4, 4, FusedOptimizerFacts(**details))])
    assert out == OPTIMIZERS
    assert len(cm.skipped) == 1 and reason in cm.skipped[0].message


CUDA_FLOATS = {"param_devices": ["cuda:0"], "param_dtypes": ["torch.float32", "torch.bfloat16"]}


def test_fused_optimizer_writes_opadvisors_adamw_for_cuda_parameters() -> None:
    out, cm = run("fused_optimizer", OPTIMIZERS, [Target(4, 8, FusedOptimizerFacts(**CUDA_FLOATS))])
    assert "from opadvisor.kernels import AdamW\n" in out
    assert "first = AdamW(model.parameters(), lr=1e-3)\n" in out  # same arguments, another class
    assert "    lr=0.1,\n    fused=True,\n)" in out  # SGD: fused=True
    assert len(cm.changes) == 2
    again, cm2 = run("fused_optimizer", out, [Target(5, 9, FusedOptimizerFacts(**CUDA_FLOATS))])
    assert again == out and not cm2.changes  # idempotent: opadvisor's AdamW is not torch's to rewrite


@pytest.mark.parametrize(
    ("call", "details"),
    [
        ("torch.optim.AdamW(model.parameters(), amsgrad=True)", CUDA_FLOATS),  # the kernel leaves it to torch
        ("torch.optim.AdamW(model.parameters())", {**CUDA_FLOATS, "param_dtypes": ["torch.float64"]}),
        ("torch.optim.AdamW(model.parameters())", {"param_devices": ["cpu", "cuda"]}),
        ("torch.optim.AdamW(model.parameters())", {}),  # no profile: the device is not known
        ("torch.optim.Adam(model.parameters())", CUDA_FLOATS),
    ],
)
def test_fused_optimizer_writes_fused_where_the_kernel_would_not_run(call: str, details: dict) -> None:
    source = f"import torch\n\nmodel = torch.nn.Linear(4, 4)\nopt = {call}\n"
    facts = FusedOptimizerFacts(**details) if details else None
    out, cm = run("fused_optimizer", source, [Target(4, 4, facts)])
    assert out == source.replace(")\n", ", fused=True)\n").replace("(4, 4, fused=True)", "(4, 4)"), out
    assert len(cm.changes) == 1


def test_fused_optimizer_spells_the_kernel_dotted_where_adamw_is_taken() -> None:
    source = (
        "import torch\nfrom torch.optim import AdamW\n\nopt = AdamW(torch.nn.Linear(2, 2).parameters())\n"
    )
    out, _ = run("fused_optimizer", source, [Target(4, 4, FusedOptimizerFacts(**CUDA_FLOATS))])
    assert "import opadvisor.kernels\n" in out
    assert "opt = opadvisor.kernels.AdamW(torch.nn.Linear(2, 2).parameters())\n" in out


def test_fused_optimizer_knows_what_the_kernel_covers() -> None:
    """The codemod (which must not import torch: `apply` stays light) writes the kernel exactly where
    kernels.AdamW takes the step: the same options left to torch, the same storage dtypes."""
    torch = pytest.importorskip("torch")
    from opadvisor.kernels import _backend
    from opadvisor.kernels import adamw as kernel

    from opadvisor.rules.optimizer import fused_optimizer_fix as fix

    assert fix.KERNEL_LACKS == kernel._UNSUPPORTED_OPTIONS
    names = {str(d).removeprefix("torch.") for d in _backend.KERNEL_DTYPES}
    assert names <= fix.KERNEL_DTYPES
    assert {n for n in fix.KERNEL_DTYPES if getattr(torch, n) not in _backend.KERNEL_DTYPES} == set()


def test_fused_optimizer_accepts_cpu_and_cuda_floats() -> None:
    details = {"param_devices": ["cpu", "cuda:0"], "param_dtypes": ["torch.bfloat16", "torch.float32"]}
    out, cm = run("fused_optimizer", OPTIMIZERS, [Target(4, 4, FusedOptimizerFacts(**details))])
    assert "lr=1e-3, fused=True)" in out and len(cm.changes) == 1


LOADERS = textwrap.dedent(
    """\
    import torch
    from torch.utils.data import DataLoader

    train = DataLoader(train_set, batch_size=8)
    val = DataLoader(val_set, batch_size=8)
    for x in train:
        x = x.to("cuda")
    for x in val:
        x = x.to("cuda")
    """
)


@pytest.mark.parametrize(
    ("target", "changed_lines"),
    [
        (Target(4, 4), [4, 7]),  # the construction: it and the copies of its loop
        (Target(8, 8), [5, 9]),  # the for line: that loop's copies and its loader
        (Target(9, 9), [5, 9]),  # a copy line
    ],
)
def test_dataloader_targets(target: Target, changed_lines: list[int]) -> None:
    out, cm = run("dataloader_stall", LOADERS, [target])
    assert sorted(n.line for n in cm.changes) == changed_lines
    assert out.count("non_blocking=True") == 1
    assert out.count("pin_memory=True") == 1


LAYERNORMS = textwrap.dedent(
    """\
    import torch


    def two(a, b):
        mean = a.mean(-1, keepdim=True)
        var = a.var(-1, keepdim=True, unbiased=False)
        a = (a - mean) / torch.sqrt(var + 1e-5)
        mu = b.mean(-1, keepdim=True)
        sigma2 = b.var(-1, keepdim=True, unbiased=False)
        b = (b - mu) / torch.sqrt(sigma2 + 1e-5)
        return a + b
    """
)


@pytest.mark.parametrize(("target", "rewritten"), [(Target(6, 6), "a"), (Target(10, 10), "b")])
def test_manual_layernorm_targets(target: Target, rewritten: str) -> None:
    out, cm = run("manual_layernorm", LAYERNORMS, [target])
    assert len(cm.changes) == 1
    assert f"{rewritten} = torch.nn.functional.layer_norm({rewritten}, " in out
    other = "b" if rewritten == "a" else "a"
    assert f"{other} = torch.nn.functional.layer_norm" not in out


def test_manual_layernorm_static_rewrites_both() -> None:
    out, cm = run("manual_layernorm", LAYERNORMS, None)
    assert len(cm.changes) == 2 and out.count("layer_norm(") == 2


def test_fp32_gemm_tf32_needs_a_target_in_the_file() -> None:
    source = "import torch\n\ny = torch.randn(2, 2) @ torch.randn(2, 2)\n"
    assert run("fp32_gemm", source, [])[0] == source
    out, cm = run("fp32_gemm", source, [Target(3, 3)])
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in out and len(cm.changes) == 1


def test_fp32_gemm_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        run("fp32_gemm", "import torch\n", None, mode="fp16")


def test_dataloader_num_workers_override() -> None:
    out, _ = run("dataloader_stall", LOADERS, None, num_workers=4)
    assert "num_workers=4, pin_memory=True, persistent_workers=True" in out
    assert "import os" not in out
    with pytest.raises(ValueError):
        run("dataloader_stall", LOADERS, None, num_workers=0)


def test_safety_labels() -> None:
    from opadvisor.rewrite.registry import get_codemod

    assert get_codemod("fused_optimizer").SAFETY == "safe"
    assert get_codemod("manual_layernorm").SAFETY == "safe"
    assert get_codemod("dataloader_stall").SAFETY == "unsafe"
    assert get_codemod("fp32_gemm").SAFETY == "unsafe"


def test_dataloader_copies_the_profile_measured(tmp_path) -> None:
    """The facts' `copies` name copy lines of this file: they get non_blocking even with no loader in sight."""
    import libcst as cst
    from libcst.codemod import CodemodContext

    from opadvisor.rules.data.dataloader_stall_fix import DataLoaderCodemod

    source = textwrap.dedent(
        """\
        def train(model, batches, device):
            for x, y in batches:
                x, y = x.to(device), y.to(device)
                model(x).to("cpu")
        """
    )
    path = tmp_path / "train.py"
    path.write_text(source)
    elsewhere = {"path": str(tmp_path / "other.py"), "line": 4, "end_line": 4}
    copies = [{"path": str(path), "line": 3, "end_line": 3}, {"path": str(path), "line": 4, "end_line": 4}]
    target = Target(1, 1, DataLoaderFacts(copies=[CopySite(**c) for c in [*copies, elsewhere]]))

    codemod = DataLoaderCodemod(CodemodContext(filename=str(path)), [target])
    out = codemod.transform_module(cst.parse_module(source)).code
    assert "x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)\n" in out
    assert 'model(x).to("cpu")\n' in out  # a device-to-host copy stays blocking
    assert len(codemod.changes) == 2
    # without the file's name the profile's lines cannot be matched: `batches` is no loader by its name
    assert run("dataloader_stall", source, [target])[0] == source
