"""DDP and FSDP2 on CPU (gloo), issue 34: what the profile records at the wrapper's line, the rules on
the naive examples (and quiet on fixed ones), `apply` on the examples, and the parity of the accumulation
rewrite on two ranks.

Launches are few (each starts Python, torch and the profiler: 10-20 s on a small CI machine): the FSDP
example on two ranks and the DDP example in one process, each profiled once a test run and shared; the
FSDP example once more after `apply` (one process); the parity script once on two ranks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import copy_project, opadvisor_here
from parallel_testlib import verify_parity

from opadvisor.profile.runs import load_run

ROOT = Path(__file__).resolve().parents[2]
FSDP_EXAMPLE = ROOT / "examples" / "fsdp_train.py"
DDP_EXAMPLE = ROOT / "examples" / "ddp_gpt_train.py"
PARITY = Path(__file__).parent / "scripts" / "accum_parity.py"
TIMEOUT_S = 240
SCRIPT_ARGS = ["--", "--size", "tiny", "--device", "cpu", "--steps", "5", "--accum", "2"]
FSDP_RULES = {"fsdp_root_only", "fsdp_fp32_gather", "grad_accum_sync"}
DDP_RULES = {"ddp_find_unused", "ddp_small_bucket", "ddp_bucket_view", "grad_accum_sync"}


def line_of(path: Path, text: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if text in t)


def profile(project: Path, script: str, *launch: str, warmup: int = 2) -> None:
    cmd = [
        sys.executable,
        "-m",
        "opadvisor",
        "profile",
        *launch,
        "--steps",
        "2",
        "--warmup",
        str(warmup),
        script,
    ]
    proc = subprocess.run(cmd + SCRIPT_ARGS, cwd=project, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]


def project_with(made_once, key: str, example: Path, *launch: str) -> Path:
    def make(folder: Path) -> None:
        (folder / "project").mkdir()
        shutil.copy(example, folder / "project" / example.name)
        profile(folder / "project", example.name, *launch)

    return made_once(key, make) / "project"


@pytest.fixture(scope="module")
def fsdp_project(made_once) -> Path:
    """examples/fsdp_train.py (naive: one unit, float32 gathers, syncing micro-steps) on two gloo ranks."""
    return project_with(made_once, "fsdp-example", FSDP_EXAMPLE, "--nproc-per-node", "2")


@pytest.fixture(scope="module")
def ddp_project(made_once) -> Path:
    """examples/ddp_gpt_train.py (find_unused_parameters=True, 1 MB buckets, syncing micro-steps, no bucket
    views), one process."""
    return project_with(made_once, "ddp-gpt-example", DDP_EXAMPLE)


def findings(project: Path) -> list[dict]:
    done = opadvisor_here(project, "suggest", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["findings"]


# ---- recording ------------------------------------------------------------------------------------------


def test_fsdp_construction_recorded_on_every_rank(fsdp_project: Path) -> None:
    _, profiles = load_run(None, fsdp_project)
    script = fsdp_project / FSDP_EXAMPLE.name
    assert [p.rank for p in profiles] == [0, 1]
    for prof in profiles:
        (unit,) = [c for c in prof.constructions if c.kind == "fsdp"]
        a = unit.attrs
        assert unit.line == line_of(script, "fully_shard(model)") and unit.module == "" and a["root"]
        assert a["own_params"] == a["module_params"] > 0 and a["units_inside"] == 0
        assert a["param_dtypes"] == ["float32"] and a["mp_param_dtype"] is None
        assert (a["world_size"], a["backend"]) == (2, "gloo")
        assert (
            a["blocks"]["cls"] == "Block"
            and a["blocks"]["count"] == 4
            and a["blocks"]["containers"] == ["blocks"]
        )
        assert a["autocast"] == "bfloat16"
        assert a["forward_at"][1] == line_of(script, "logits = model(x)")
        assert a["step_at"][1] == line_of(script, "optimizer.step()")
        # two micro-batches per optimizer step, both reduce-scattered (warm-up steps included)
        assert (
            a["grad_sync"]["per_step"] == [[2, 2]] * a["grad_sync"]["steps"] and a["grad_sync"]["steps"] >= 4
        )
        (model,) = [c for c in prof.constructions if c.kind == "model"]
        assert model.cls == "__main__.GPT" and prof.modules[""] == "__main__.GPT"  # not FSDP's FSDPGPT
        names = {x.name for x in prof.annotations}
        assert {"FSDP::all_gather", "FSDP::post_backward_reduce"} <= names  # FSDP2's ranges, one unit


def test_ddp_construction_recorded(ddp_project: Path) -> None:
    _, (prof,) = load_run(None, ddp_project)
    (ddp,) = [c for c in prof.constructions if c.kind == "ddp"]
    a = ddp.attrs
    assert ddp.cls == "torch.nn.parallel.DistributedDataParallel"
    assert ddp.line == line_of(DDP_EXAMPLE, "model = DDP(model")
    assert a["find_unused_parameters"] and a["bucket_cap_mb"] == 1.0 and not a["static_graph"]
    assert a["given"] == ["bucket_cap_mb", "find_unused_parameters"]
    assert a["unused_params"] == 0 and a["unused_checked_steps"] >= 4 and a["post_forward_ms"] > 0
    assert a["grad_bytes"] > 3 * 2**20  # several 1 MB buckets' worth
    assert a["grad_sync"]["per_step"][0] == [2, 2]


# ---- rules ----------------------------------------------------------------------------------------------


def test_fsdp_rules_find_the_naive_example(fsdp_project: Path) -> None:
    found = findings(fsdp_project)
    ours = {f["rule"]: f for f in found if f["rule"] in FSDP_RULES | DDP_RULES}
    assert set(ours) == FSDP_RULES
    line = line_of(FSDP_EXAMPLE, "fully_shard(model)")
    for f in ours.values():
        assert f["line"] == line and f["ranks"] == [0, 1] and f["path"].endswith("fsdp_train.py")
        assert f["time_ms_per_step"] > 0 and f["time_basis"] == "cpu" and not f.get("fix_blocked")
        if f["rule"] != "fsdp_root_only":
            assert f["est_saving_ms_per_step"] < f["time_ms_per_step"]
    # one unit per block measured 2.5x slower on 2 H200s: advice, applied only when asked by name
    assert ours["fsdp_fp32_gather"]["fix"] == "unsafe" and ours["fsdp_root_only"]["fix"] == "none"
    assert ours["fsdp_root_only"]["est_saving_ms_per_step"] is None
    assert "4 Block blocks" in ours["fsdp_root_only"]["message"]
    assert ours["grad_accum_sync"]["details"]["wrapper"] == "fsdp"
    assert "bfloat16 autocast" in ours["fsdp_fp32_gather"]["message"]
    units = {(u["unit"], u["collective"]): u for u in ours["fsdp_root_only"]["details"]["units"]}
    assert set(units) == {("", "all_gather"), ("", "reduce_scatter")}  # the one root unit
    params = ours["fsdp_root_only"]["details"]["own_params"]
    for u in units.values():  # two micro-steps: gathered and reduced twice a step, the whole model each
        assert u["calls_per_step"] == 2 and u["dtype"] == "float32"
        assert abs(u["mib_per_call"] - params * 4 / 2**20) < 0.01 and u["ms_per_step"] is None  # CPU: sizes


def test_ddp_rules_find_the_naive_example(ddp_project: Path) -> None:
    found = findings(ddp_project)
    ours = {f["rule"]: f for f in found if f["rule"] in FSDP_RULES | DDP_RULES}
    assert set(ours) == DDP_RULES
    line = line_of(DDP_EXAMPLE, "model = DDP(model")
    assert {f["line"] for f in ours.values()} == {line}
    assert ours["ddp_find_unused"]["time_ms_per_step"] > 0  # DDP's measured traversal
    assert "4 all-reduces per backward" in ours["ddp_small_bucket"]["message"]
    assert ours["grad_accum_sync"]["details"]["wrapper"] == "ddp"


# ---- apply ----------------------------------------------------------------------------------------------


def test_apply_on_the_ddp_example(ddp_project: Path, tmp_path: Path) -> None:
    project = copy_project(ddp_project, tmp_path / "project")
    done = opadvisor_here(project, "apply", "--rule", "all")
    assert done.returncode == 0, done.stderr
    text = (project / DDP_EXAMPLE.name).read_text()
    assert "model = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)" in text
    assert "with contextlib.nullcontext() if _micro_step == args.accum - 1 else model.no_sync():" in text
    assert "import contextlib" in text
    compile(text, DDP_EXAMPLE.name, "exec")


@pytest.fixture(scope="module")
def fsdp_applied(fsdp_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the FSDP project after `apply --rule all --unsafe`, then `apply --rule fsdp_root_only` (advice
    in --rule all: applied only when named; the profiled run keeps the backups)."""
    project = copy_project(fsdp_project, tmp_path_factory.mktemp("fsdp-applied") / "project")
    done = opadvisor_here(project, "apply", "--rule", "all", "--unsafe")
    assert done.returncode == 0, done.stderr
    assert "for block_ in model.blocks:" not in (project / FSDP_EXAMPLE.name).read_text()
    assert "fsdp_root_only: note: no automatic fix for this one" in done.stdout + done.stderr
    done = opadvisor_here(project, "apply", "--rule", "fsdp_root_only")
    assert done.returncode == 0, done.stderr
    return project


def test_apply_on_the_fsdp_example(fsdp_applied: Path) -> None:
    text = (fsdp_applied / FSDP_EXAMPLE.name).read_text()
    assert "for block_ in model.blocks:" in text
    assert "model.set_requires_gradient_sync((i + 1) % args.accum == 0)" in text
    # the root unit keeps its gathered parameters between micro-steps; the blocks reshard as before
    assert "model.set_reshard_after_backward((i + 1) % args.accum == 0, recurse=False)" in text
    policy = "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
    assert text.count(policy) == 2 and "from torch.distributed.fsdp import MixedPrecisionPolicy" in text


def test_verify_runs_both_programs_on_two_ranks(fsdp_applied: Path) -> None:
    """`verify --quick` of the 2-rank run: both programs on 2 gloo ranks, every rank's losses compared."""
    report = verify_parity(fsdp_applied)
    assert any("verify runs both programs on 2 ranks" in n for n in report["notes"])


def test_the_rules_are_quiet_on_the_fixed_fsdp_example(fsdp_applied: Path) -> None:
    """The rewritten script profiled (one process): five units, one sync per optimizer step, 16-bit
    gathers, and none of the three findings."""
    project = fsdp_applied
    profile(project, FSDP_EXAMPLE.name, warmup=1)
    _, (prof,) = load_run(None, project)
    units = {c.module: c.attrs for c in prof.constructions if c.kind == "fsdp"}
    assert set(units) == {"", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}  # the unit map
    assert units[""]["units_inside"] == 4 and units[""]["own_params"] < units[""]["module_params"] / 2
    assert units[""]["grad_sync"]["per_step"][0] == [2, 1]  # the last micro-step alone reduce-scatters
    assert all(u["mp_param_dtype"] == "bfloat16" for u in units.values())
    assert any(a.name == "FSDP::pre_forward (blocks.1)" for a in prof.annotations)  # per-unit ranges
    quiet = {f["rule"] for f in findings(project)} & FSDP_RULES
    assert not quiet


# ---- parity ---------------------------------------------------------------------------------------------


def test_accumulation_rewrites_keep_the_weights_on_two_ranks() -> None:
    """The grad_accum_sync fixtures (DDP no_sync, FSDP2 set_requires_gradient_sync) before and after the
    rewrite: the same weights after two accumulation steps, with a third of the gradient collectives."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(PARITY)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if "max_weight_diff=" in ln}
    assert set(lines) == {"ddp_range_form", "fsdp_if_form"}
    assert "syncs_before=6 syncs_after=2" in lines["ddp_range_form"]
    assert "syncs_before=18 syncs_after=6" in lines["fsdp_if_form"]


# ---- on two GPUs (NCCL): `python3 -m pytest -m gpu tests/distributed` on a machine with 2+ GPUs -----------


@pytest.mark.gpu
def test_fsdp_on_two_gpus_times_each_unit(tmp_path: Path) -> None:
    """The FSDP example on 2 GPUs, the fixes applied first where they change the units: the findings'
    costs come from NCCL kernels, and every unit's collectives carry their GPU time and exposed part."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    shutil.copy(FSDP_EXAMPLE, tmp_path / FSDP_EXAMPLE.name)
    cmd = [
        sys.executable,
        "-m",
        "opadvisor",
        "profile",
        "--nproc-per-node",
        "2",
        "--steps",
        "3",
        "--warmup",
        "3",
    ]
    cmd += [FSDP_EXAMPLE.name, "--", "--size", "tiny", "--device", "cuda", "--steps", "10", "--accum", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = {f["rule"]: f for f in findings(tmp_path) if f["rule"] in FSDP_RULES}
    assert set(ours) == FSDP_RULES
    costs = {rule: (f["time_basis"], f["time_ms_per_step"]) for rule, f in ours.items()}
    assert all(basis == "gpu" and (ms or 0) > 0 for basis, ms in costs.values()), costs
    units = ours["fsdp_root_only"]["details"]["units"]
    assert {u["collective"] for u in units} == {"all_gather", "reduce_scatter"}
    assert all(
        u["ms_per_step"] > 0 and 0 <= u["exposed_ms_per_step"] <= u["ms_per_step"] + 1e-9 for u in units
    )
    done = opadvisor_here(tmp_path, "apply", "--rule", "all", "--unsafe")
    assert done.returncode == 0, done.stderr
    done = opadvisor_here(tmp_path, "verify", "--quick", "--steps", "3", "--format", "json")
    assert done.returncode == 0 and json.loads(done.stdout)["parity"]["ok"], done.stdout[-3000:]
