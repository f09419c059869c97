"""Which opadvisor.kernels op each applied fix should make run (KERNEL_OP), so verify can say it never did."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import opadvisor.kernels
import pytest
from verify_helpers import fake_apply, make_project

from opadvisor.rewrite.registry import LIBRARY_CODEMODS, fixable_rules, get_codemod
from opadvisor.verify.applied import load_applied
from opadvisor.verify.implementations import fused_calls, kernel_ops


def _dispatch_ops() -> set[str]:
    """Every op name the kernels record in `dispatch_counts()` (each kernel module's OP)."""
    ops = set()
    for info in pkgutil.iter_modules(opadvisor.kernels.__path__):
        op = getattr(importlib.import_module(f"opadvisor.kernels.{info.name}"), "OP", None)
        if isinstance(op, str):
            ops.add(op)
    return ops


@pytest.mark.parametrize("fix", [*fixable_rules(), *LIBRARY_CODEMODS])
def test_every_fix_names_its_kernel_ops_or_says_why_not(fix: str) -> None:
    codemod = get_codemod(fix)
    declared = codemod.KERNEL_OP
    named = (declared,) if isinstance(declared, str) else declared or ()
    assert bool(named) != bool(codemod.NO_KERNEL_OP.strip()), (
        f"{fix}: name the opadvisor.kernels op(s) its rewrite calls (KERNEL_OP) or say why none (NO_KERNEL_OP)"
    )
    assert set(named) <= _dispatch_ops(), f"{fix}: {named} are not all ops the kernels record"


def test_fuse_region_expects_the_ops_its_rewrite_added() -> None:
    assert kernel_ops(["fuse_region"]) == {op: ["fuse_region"] for op in get_codemod("fuse_region").KERNEL_OP}
    added = {"quick_gelu", "opadvisor", "kernels"}
    assert kernel_ops(["fuse_region", "rnn_cell_loop"], lambda rule: added) == {
        "quick_gelu": ["fuse_region"],
        "cell_sequence": ["rnn_cell_loop"],
    }


def test_names_added_reads_each_rules_own_step(tmp_path: Path) -> None:
    source = "import torch\ny = x * torch.sigmoid(1.702 * x)\nz = dropout(y)\n"
    project, run_dir = make_project(tmp_path, {"train.py": source}, "train.py", [])
    script = project / "train.py"
    fake_apply(
        run_dir, script, "x * torch.sigmoid(1.702 * x)", "opadvisor.kernels.quick_gelu(x)", rule="fuse_region"
    )
    fake_apply(
        run_dir, script, "import torch\n", "import torch\nimport opadvisor.kernels\n", rule="gemm_align"
    )
    applied = load_applied(run_dir)
    assert applied.names_added("fuse_region") == {"opadvisor", "kernels", "quick_gelu"}
    assert applied.names_added("gemm_align") == {"import", "opadvisor", "kernels"}
    # the dropout already in the file is not fuse_region's: only its quick_gelu is expected to run
    record = {"imported": True, "record": True, "counts": {"quick_gelu": {"reference": 2}}}
    _, warnings = fused_calls(["fuse_region"], record, "parity", applied.names_added)
    assert (
        len(warnings) == 1
        and "opadvisor.kernels.quick_gelu (fuse_region's fix) never ran its kernel" in warnings[0]
    )


@pytest.mark.parametrize(
    ("added", "expected"),
    [({"opadvisor", "kernels", "AdamW"}, {"adamw": ["fused_optimizer"]}), ({"fused", "True"}, {})],
    ids=["kernel-adamw", "fused-true"],
)
def test_fused_optimizer_expects_the_adamw_kernel_only_where_it_wrote_adamw(added, expected) -> None:
    assert kernel_ops(["fused_optimizer"], lambda rule: added) == expected


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("opt = torch.optim.AdamW(ps)\n", "opt = opadvisor.kernels.AdamW(ps)\n"),
        (
            "from torch.optim import AdamW\nopt = AdamW(ps)\n",
            "from torch.optim import AdamW\nimport opadvisor.kernels\nopt = opadvisor.kernels.AdamW(ps)\n",
        ),
        ("opt = torch.optim.AdamW(ps)\n", "from opadvisor.kernels import AdamW\nopt = AdamW(ps)\n"),
    ],
    ids=["dotted", "dotted-name-taken", "imported"],
)
def test_a_kernel_class_put_in_place_of_torchs_counts_as_added(
    tmp_path: Path, before: str, after: str
) -> None:
    source = f"import torch\nps = []\n{before}"
    project, run_dir = make_project(tmp_path, {"train.py": source}, "train.py", [])
    fake_apply(run_dir, project / "train.py", before, after, rule="fused_optimizer")
    applied = load_applied(run_dir)
    assert "AdamW" in applied.names_added("fused_optimizer")
    assert kernel_ops(["fused_optimizer"], applied.names_added) == {"adamw": ["fused_optimizer"]}
