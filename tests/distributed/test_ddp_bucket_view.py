"""`ddp_bucket_view` on a real two-rank gloo run of examples/ddp_gpt_train.py (built without
gradient_as_bucket_view): the reducer's copies from the buckets back into .grad are counted and timed, the
finding sits at the DDP line on both ranks; `apply` adds the flag, `verify` sees the same losses on both
ranks, and the fixed program, profiled again, makes no copy back and is not found.

Launches (each 10-20 s on a small machine): the example profiled on two ranks, verify (two programs on
two ranks), the fixed example profiled on two ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_testlib import copy_project, opadvisor_here
from parallel_testlib import profile_ranks, suggest, verify_parity

from opadvisor.profile.runs import load_run
from opadvisor.rules.distributed.ddp_bucket_view import COPY_BACK

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_gpt_train.py"
ARGS = ["--size", "tiny", "--device", "cpu", "--steps", "5", "--accum", "2"]


def profile(project: Path) -> None:
    profile_ranks(project, EXAMPLE.name, *ARGS, warmup=2)


def found(project: Path) -> list[dict]:
    return [f for f in suggest(project)["findings"] if f["rule"] == "ddp_bucket_view"]


def copies_per_step(project: Path) -> list[float]:
    _, profiles = load_run(None, project)
    return [
        sum(1 for op in p.ops if op.name == COPY_BACK and op.step is not None) / len(p.steps)
        for p in profiles
    ]


@pytest.fixture(scope="module")
def ddp_project(made_once) -> Path:
    def make(folder: Path) -> None:
        (folder / "project").mkdir()
        shutil.copy(EXAMPLE, folder / "project" / EXAMPLE.name)
        profile(folder / "project")

    return made_once("ddp-gpt-two-ranks", make) / "project"


@pytest.fixture(scope="module")
def applied(ddp_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = copy_project(ddp_project, tmp_path_factory.mktemp("ddp-bucket-view") / "project")
    done = opadvisor_here(project, "apply", "--rule", "ddp_bucket_view")
    assert done.returncode == 0, done.stderr
    return project


def test_the_copies_back_are_found_at_the_ddp_line(ddp_project: Path) -> None:
    (f,) = found(ddp_project)
    line = next(i for i, t in enumerate(EXAMPLE.read_text().splitlines(), 1) if "model = DDP(model" in t)
    assert f["line"] == line and f["ranks"] == [0, 1] and f["fix"] == "safe" and f["time_basis"] == "cpu"
    _, (prof, _) = load_run(None, ddp_project)
    tensors = next(c for c in prof.constructions if c.kind == "ddp").attrs["param_tensors"]
    # one copy per parameter tensor after each synchronised backward: two micro-steps a step
    assert copies_per_step(ddp_project) == [2 * tensors] * 2
    assert f["details"]["bucket_copies_per_step"] == 2 * tensors
    assert f["time_ms_per_step"] > 0 and f["est_saving_ms_per_step"] == f["time_ms_per_step"]


def test_apply_writes_the_flag(applied: Path) -> None:
    text = (applied / EXAMPLE.name).read_text()
    assert "DDP(model, find_unused_parameters=True, bucket_cap_mb=1, gradient_as_bucket_view=True)" in text


def test_verify_same_losses_on_two_ranks(applied: Path) -> None:
    verify_parity(applied)


def test_the_fixed_program_copies_nothing_back(applied: Path) -> None:
    profile(applied)
    assert copies_per_step(applied) == [0.0, 0.0]
    assert found(applied) == []
