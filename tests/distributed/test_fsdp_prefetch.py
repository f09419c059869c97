"""`fsdp_prefetch` on hand-built GPU profiles: three per-block units in forward order; a unit whose
all-gather kernel starts only after the previous block's last compute kernel is late, one that overlaps
it is not; checked against arithmetic done by hand. A CPU profile cannot judge (the real gloo run's note
is checked in test_fsdp_reshard.py)."""

from __future__ import annotations

import pytest

from opadvisor.profile.model import Annotation, Construction, Environment, Kernel, Op, Profile, Step
from opadvisor.rules._units import late_forward_gathers
from opadvisor.rules.distributed import fsdp_prefetch
from opadvisor.rules.engine import NeedsGpuProfile

NCCL = "ncclDevKernel_AllGather_RING_LL"


def _op(prof: Profile, name: str, start: float, module: str | None, kernel: tuple[str, float, float]) -> None:
    op = Op(len(prof.ops), name, 0, start, 5.0, thread=1, module=module)
    op.kernels = [Kernel(kernel[0], kernel[1], kernel[2] - kernel[1])]
    prof.ops.append(op)


def _block(prof: Profile, i: int, cpu: float, gather: tuple[float, float], gemm: tuple[float, float]) -> None:
    """blocks.i's forward: its pre-forward range at `cpu` us (the all-gather range inside it, the gather's
    NCCL kernel over `gather`), then its GEMM kernel over `gemm`."""
    unit = f"blocks.{i}"
    prof.annotations.append(Annotation(f"FSDP::pre_forward ({unit})", cpu, 40.0, step=0, thread=1))
    prof.annotations.append(Annotation(f"FSDP::all_gather ({unit})", cpu + 5, 20.0, step=0, thread=1))
    _op(prof, "record_param_comms", cpu + 10, None, (NCCL, *gather))
    _op(prof, "aten::mm", cpu + 50, f"{unit}.fc", ("sm90_gemm", *gemm))


def profile(device: str = "cuda") -> Profile:
    """blocks.0 computes 1000-2000 us; blocks.1's gather overlaps it (1500-1900: on time) and blocks.1
    computes 2000-3000; blocks.2's gather starts at 3100, after it (late: 100 us gap, 400 us exposed)."""
    env = Environment(device=device, gpu_name="Test GPU" if device == "cuda" else None)
    prof = Profile(environment=env)
    prof.steps.append(Step(0, 0.0, 10_000.0, 10.0, gpu_span_ms=10.0))
    for i, line in ((0, 10), (1, 10), (2, 10)):
        prof.constructions.append(
            Construction(
                "fsdp",
                "torch.distributed.fsdp.fully_shard",
                "train.py",
                line,
                "main",
                f"blocks.{i}",
                {"root": False},
            )  # fmt: skip
        )
    prof.constructions.append(Construction("fsdp", "fully_shard", "train.py", 11, "main", "", {"root": True}))
    _block(prof, 0, 100.0, (500.0, 900.0), (1000.0, 2000.0))
    _block(prof, 1, 200.0, (1500.0, 1900.0), (2000.0, 3000.0))
    _block(prof, 2, 300.0, (3100.0, 3500.0), (3500.0, 4500.0))
    return prof


def test_a_gather_after_the_previous_units_compute_is_late() -> None:
    late, pairs = late_forward_gathers(profile())
    assert pairs == 2
    assert [(g.unit, g.previous, g.gap_us, g.exposed_us) for g in late] == [
        ("blocks.2", "blocks.1", 100.0, 400.0)
    ]


def test_finding_at_the_per_block_call() -> None:
    (f,) = fsdp_prefetch.detect(profile())
    assert (f.line, f.fix, f.time_ms_per_step) == (10, "none", 0.4)
    assert "1 of 2 forward all-gathers" in f.message and "median 100 us later" in f.message
    assert f.details["late_units"] == ["blocks.2"] and f.details["handovers"] == 2
    assert "set_modules_to_forward_prefetch" in f.advice and "`blocks`" in f.advice


def test_quiet_when_every_gather_overlaps() -> None:
    prof = profile()
    prof.ops[-2].kernels[0] = Kernel(NCCL, 2500.0, 2900.0)  # blocks.2's gather under blocks.1's GEMM
    assert late_forward_gathers(prof) == ([], 2)
    assert fsdp_prefetch.detect(prof) == []


def test_a_cpu_profile_cannot_judge() -> None:
    with pytest.raises(NeedsGpuProfile, match="previous unit's compute"):
        fsdp_prefetch.detect(profile(device="cpu"))
