"""`fsdp_reshard`: on hand-built GPU profiles (two per-block units gathered again in backward, judged
against the memory the profile measured), and on a real two-rank gloo run of scripts/fsdp_blocks.py (one
unit per block): there the rule says it cannot judge the memory; with the GPU memory facts written into
the recorded run it finds the per-block call; `apply` writes reshard_after_forward=False, `verify` sees
the same losses on both ranks, and the fixed program gathers each block once a step (no finding).

Launches (each 10-20 s on a small machine): the script profiled on two ranks, verify (two programs on two
ranks), the fixed script profiled on two ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_testlib import copy_project, opadvisor_here
from parallel_testlib import profile_ranks, suggest, verify_parity

from opadvisor.profile.model import Annotation, Construction, Environment, Kernel, Op, Profile, Step
from opadvisor.profile.runs import load_run
from opadvisor.rules._units import backward_gathers, late_forward_gathers, unit_comm
from opadvisor.rules.distributed import fsdp_reshard
from opadvisor.rules.engine import NeedsGpuProfile

SCRIPT = Path(__file__).parent / "scripts" / "fsdp_blocks.py"

GIB = 2**30
NCCL = "ncclDevKernel_AllGather_RING_LL"
PARAMS = 64 * 2**20  # parameters per block: 256 MiB in float32


def _range(prof: Profile, name: str, start: float, length: float) -> None:
    prof.annotations.append(Annotation(name, start, length, step=0, thread=1))


def _gather(prof: Profile, unit: str, start: float, kernel: tuple[float, float]) -> None:
    """FSDP2's all-gather of `unit` at `start` (its range, the c10d op, its NCCL kernel)."""
    _range(prof, f"FSDP::all_gather ({unit})", start, 50.0)
    op = Op(len(prof.ops), "c10d::_allgather_base_", 0, start + 5, 20.0, thread=1)
    op.input_shapes, op.input_dtypes = [[PARAMS], [PARAMS // 2]], ["float32", "float32"]
    op.kernels = [Kernel(NCCL, kernel[0], kernel[1] - kernel[0])]
    prof.ops.append(op)


def _unit(module: str, line: int, **attrs) -> Construction:
    base = {"own_params": PARAMS, "param_dtypes": ["float32"], "mp_param_dtype": None, "root": False}
    base["reshard_after_forward"] = None
    return Construction(
        "fsdp", "torch.distributed.fsdp.fully_shard", "train.py", line, "main", module, {**base, **attrs}
    )


def profile(gpu_memory: int | None = 80 * GIB, peak: int | None = 20 * GIB, **block_attrs) -> Profile:
    """Two blocks (line 10, a loop) and the root (line 11); each block gathered in forward (1.0 ms, under a
    GEMM for 0.5 ms) and again in backward (1.0 ms, nothing beside it: all of it exposed)."""
    env = Environment(device="cuda", gpu_name="Test GPU", gpu_memory_bytes=gpu_memory)
    prof = Profile(environment=env)
    prof.steps.append(Step(0, 0.0, 20_000.0, 20.0, gpu_span_ms=20.0, peak_allocated_bytes=peak))
    prof.constructions += [_unit("blocks.0", 10, **block_attrs), _unit("blocks.1", 10, **block_attrs)]
    prof.constructions.append(_unit("", 11, own_params=1000, root=True))
    gemm = Op(0, "aten::mm", 0, 900.0, 10.0, thread=1, kernels=[Kernel("sm90_gemm", 1000.0, 1500.0)])
    prof.ops.append(gemm)
    for i, unit in enumerate(("blocks.0", "blocks.1")):
        _gather(prof, unit, 100.0 + 1000 * i, (1000.0 + 2000 * i, 2000.0 + 2000 * i))
    _range(prof, "FSDP::pre_backward (blocks.1)", 8000.0, 500.0)
    _gather(prof, "blocks.1", 8100.0, (9000.0, 10_000.0))
    _range(prof, "FSDP::backward_prefetch for blocks.0", 8150.0, 300.0)  # inside blocks.1's pre-backward
    _gather(prof, "blocks.0", 8200.0, (10_000.0, 11_000.0))
    return prof


def test_fires_where_memory_leaves_room_with_the_numbers() -> None:
    (f,) = fsdp_reshard.detect(profile())
    assert (f.path, f.line, f.fix) == ("train.py", 10, "unsafe")
    d = f.details
    assert sorted(d["modules"]) == ["blocks.0", "blocks.1"] and not d["root"]
    # only the two backward gathers count: 2 ms of NCCL time, all of it exposed
    assert d["backward_gathers_per_step"] == 2 and f.time_ms_per_step == 2.0
    assert f.est_saving_ms_per_step == 2.0 and d["backward_gather_exposed_ms"] == 2.0
    assert d["kept_bytes"] == 2 * PARAMS * 4 and d["peak_allocated_bytes"] == 20 * GIB
    assert "peak 20.0 GiB + 512.0 MiB kept gathered = 20.5 GiB of 80.0 GiB (26%; limit 85%)" in f.message
    assert "2 unit(s) of this call" in f.message


def test_kept_bytes_in_the_gathered_dtype() -> None:
    (f,) = fsdp_reshard.detect(profile(mp_param_dtype="bfloat16"))
    assert f.details["kept_bytes"] == 2 * PARAMS * 2


def test_quiet_where_memory_is_short() -> None:
    # 67.6 GiB + 0.5 GiB > 85% of 80 GiB (68 GiB): keeping the parameters could run out of memory
    assert fsdp_reshard.detect(profile(peak=int(67.6 * GIB))) == []
    assert len(fsdp_reshard.detect(profile(peak=int(67.4 * GIB)))) == 1


def test_quiet_where_the_units_keep_their_parameters() -> None:
    assert fsdp_reshard.detect(profile(reshard_after_forward=False)) == []
    assert fsdp_reshard.detect(profile(reshard_after_forward=2)) == []  # a smaller group: its own choice


def test_without_gpu_memory_it_cannot_judge() -> None:
    for prof in (profile(gpu_memory=None), profile(peak=None)):
        with pytest.raises(NeedsGpuProfile, match="room to keep the gathered parameters"):
            fsdp_reshard.detect(prof)


def test_no_backward_gather_no_finding() -> None:
    prof = profile()
    prof.annotations = [a for a in prof.annotations if "backward" not in a.name]
    assert fsdp_reshard.detect(prof) == []  # the gathers all ran in forward: nothing gathered again


# ---- a real two-rank gloo run ----------------------------------------------------------------------------


def profile_blocks(project: Path) -> None:
    profile_ranks(project, SCRIPT.name)


def set_gpu_memory(project: Path, device: int = 80 * GIB, peak: int = GIB) -> None:
    """Write the GPU memory facts a CUDA profile records into every rank's profile of the latest run."""
    run, _ = load_run(None, project)
    for path in run.glob("profile.rank*.json"):
        data = json.loads(path.read_text())
        data["environment"]["gpu_memory_bytes"] = device
        for step in data["steps"]:
            step["peak_allocated_bytes"] = peak
        path.write_text(json.dumps(data))


def line_of(path: Path, text: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if text in t)


@pytest.fixture(scope="module")
def blocks_project(made_once) -> Path:
    def make(folder: Path) -> None:
        (folder / "project").mkdir()
        shutil.copy(SCRIPT, folder / "project" / SCRIPT.name)
        profile_blocks(folder / "project")

    return made_once("fsdp-blocks", make) / "project"


@pytest.fixture(scope="module")
def with_memory(blocks_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = copy_project(blocks_project, tmp_path_factory.mktemp("fsdp-reshard") / "project")
    set_gpu_memory(project)
    return project


def test_a_gloo_run_cannot_judge_the_memory(blocks_project: Path) -> None:
    report = suggest(blocks_project)
    assert not [f for f in report["findings"] if f["rule"] == "fsdp_reshard"]
    (note,) = [n for n in report["notes"] if n["rule"] == "fsdp_reshard"]
    assert "room to keep the gathered parameters" in note["message"] and note["ranks"] == [0, 1]
    assert "3 unit(s) all-gathered their parameters again in backward" in note["message"]
    (prefetch,) = [n for n in report["notes"] if n["rule"] == "fsdp_prefetch"]  # no kernel times on gloo
    # the units' gathers come from FSDP's hooks, not from the training loop
    assert not [a for a in report["cross_rank"]["advice"] if a["id"] == "loop_collective"]
    assert "previous unit's compute" in prefetch["message"] and prefetch["ranks"] == [0, 1]
    _, profiles = load_run(None, blocks_project)
    for prof in profiles:  # forward and backward gather each block: twice a step, once of them in backward
        gathers = {u.unit: u.calls_per_step for u in unit_comm(prof) if u.collective == "all_gather"}
        assert gathers == {"": 1.0, "blocks.0": 2.0, "blocks.1": 2.0, "blocks.2": 2.0}
        assert {u.unit: u.calls_per_step for u in backward_gathers(prof)} == {
            f"blocks.{i}": 1.0 for i in range(3)
        }


def test_with_gpu_memory_facts_the_per_block_call_is_found(with_memory: Path) -> None:
    (f,) = [f for f in suggest(with_memory)["findings"] if f["rule"] == "fsdp_reshard"]
    assert (
        f["line"] == line_of(SCRIPT, "fully_shard(block)") and f["ranks"] == [0, 1] and f["fix"] == "unsafe"
    )
    d = f["details"]
    assert d["modules"] == ["blocks.0", "blocks.1", "blocks.2"] and d["backward_gathers_per_step"] == 3
    assert d["kept_bytes"] == 3 * (64 * 64 + 64) * 4  # three float32 Linear(64, 64) kept gathered
    assert f["time_ms_per_step"] is None  # gloo: no NCCL kernel to time
    assert "memory allows keeping them: peak 1.0 GiB" in f["message"]


@pytest.fixture(scope="module")
def applied(with_memory: Path) -> Path:
    done = opadvisor_here(with_memory, "apply", "--rule", "fsdp_reshard", "--unsafe")
    assert done.returncode == 0, done.stderr
    return with_memory


def test_apply_keeps_the_blocks_gathered(applied: Path) -> None:
    text = (applied / SCRIPT.name).read_text()
    assert "        fully_shard(block, reshard_after_forward=False)\n    fully_shard(model)\n" in text


def test_verify_same_losses_on_two_ranks(applied: Path) -> None:
    verify_parity(applied)


def test_the_fixed_program_gathers_once_and_is_not_found(applied: Path) -> None:
    profile_blocks(applied)
    set_gpu_memory(applied)
    _, profiles = load_run(None, applied)
    for prof in profiles:
        gathers = {u.unit: u.calls_per_step for u in unit_comm(prof) if u.collective == "all_gather"}
        assert gathers == {"": 1.0, "blocks.0": 1.0, "blocks.1": 1.0, "blocks.2": 1.0}
        assert backward_gathers(prof) == []
    report = suggest(applied)
    assert not [f for f in report["findings"] if f["rule"] == "fsdp_reshard"]
    assert not [n for n in report["notes"] if n["rule"] == "fsdp_reshard"]


# ---- on two GPUs (NCCL): `python3 -m pytest -m gpu tests/distributed` on a machine with 2+ GPUs -----------


@pytest.mark.gpu
def test_on_two_gpus_the_backward_gathers_are_timed(tmp_path: Path) -> None:
    """The script on 2 GPUs: real memory facts, so the rule judges; the backward all-gathers' NCCL time
    is the cost; the forward hand-overs are paired for fsdp_prefetch; the fix keeps the same losses."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    shutil.copy(SCRIPT, tmp_path / SCRIPT.name)
    profile_ranks(tmp_path, SCRIPT.name, "--device", "cuda")
    (f,) = [f for f in suggest(tmp_path)["findings"] if f["rule"] == "fsdp_reshard"]
    assert f["time_basis"] == "gpu" and f["time_ms_per_step"] > 0 and f["ranks"] == [0, 1]
    d = f["details"]
    assert d["gpu_memory_bytes"] > d["peak_allocated_bytes"] > 0 and d["backward_gathers_per_step"] == 3
    assert 0 <= d["backward_gather_exposed_ms"] <= d["backward_gather_ms"] + 1e-9
    _, profiles = load_run(None, tmp_path)
    for prof in profiles:  # two hand-overs (blocks.0 -> 1 -> 2) a forward, two steps recorded
        assert late_forward_gathers(prof)[1] == 4
    done = opadvisor_here(tmp_path, "apply", "--rule", "fsdp_reshard", "--unsafe")
    assert done.returncode == 0, done.stderr
    verify_parity(tmp_path)
