"""FSDP2's collectives per unit (rules/_units.py) on a hand-built GPU profile: attribution by FSDP's
ranges, bytes per call, NCCL time and its exposed part, checked against arithmetic done by hand."""

from __future__ import annotations

from opadvisor.profile.model import Annotation, Environment, Kernel, Op, Profile, Step
from opadvisor.rules._units import unit_comm, words


def _op(prof: Profile, name: str, start: float, kernels: list[tuple[str, float, float]], shapes=None) -> None:
    op = Op(
        len(prof.ops), name, 0, start, 20.0, thread=1, input_shapes=shapes or [], input_dtypes=["float32"] * 2
    )
    op.kernels = [Kernel(k, a, b - a) for k, a, b in kernels]
    prof.ops.append(op)


def test_collectives_attributed_to_units_with_their_exposed_time() -> None:
    prof = Profile(environment=Environment(device="cuda", gpu_name="Test GPU"))
    prof.steps.append(Step(0, 0.0, 10_000.0, 10.0, gpu_span_ms=10.0))
    for name, start in (
        ("FSDP::all_gather (blocks.0)", 100.0),
        ("FSDP::all_gather (blocks.1)", 3000.0),
        ("FSDP::post_backward_reduce (blocks.1)", 6000.0),
        ("FSDP::pre_forward (blocks.1)", 2900.0),  # not a collective's range: never the unit's owner
    ):
        prof.annotations.append(
            Annotation(name, start, 300.0 if "pre_forward" in name else 100.0, step=0, thread=1)
        )
    nccl = "ncclDevKernel_AllGather_RING_LL"
    # blocks.0's all-gather runs 1000-2000 us with nothing beside it: 1 ms exposed
    _op(prof, "c10d::_allgather_base_", 150.0, [(nccl, 1000.0, 2000.0)], [[1024, 256], [512, 256]])
    # blocks.1's: 4000-5000 us, a GEMM 3500-4800 beside it: 0.2 ms exposed
    _op(prof, "c10d::_allgather_base_", 3050.0, [(nccl, 4000.0, 5000.0)], [[2048], [1024]])
    _op(prof, "aten::mm", 3400.0, [("sm90_gemm", 3500.0, 4800.0), ("sm90_gemm", 6900.0, 7600.0)])
    # blocks.1's reduce-scatter 7000-7500 us, all of it under the second GEMM: nothing exposed
    _op(
        prof,
        "c10d::_reduce_scatter_base_",
        6050.0,
        [("ncclDevKernel_ReduceScatter", 7000.0, 7500.0)],
        [[1024], [2048]],
    )
    units = unit_comm(prof)
    got = [
        (u.unit, u.collective, u.calls_per_step, u.ms_per_step, round(u.exposed_ms_per_step, 6))
        for u in units
    ]
    assert got == [
        ("blocks.0", "all_gather", 1.0, 1.0, 1.0),
        ("blocks.1", "all_gather", 1.0, 1.0, 0.2),
        ("blocks.1", "reduce_scatter", 1.0, 0.5, 0.0),
    ]
    assert units[0].mib_per_call == 1.0 and units[0].dtype == "float32"  # 1024 x 256 float32
    assert words(units, top=1) == "blocks.0 all_gather 1x 1.0 MiB float32, 1.00 ms/step, 1.00 exposed"


def test_no_fsdp_ranges_no_units() -> None:
    prof = Profile(environment=Environment(device="cpu"))
    prof.steps.append(Step(0, 0.0, 1000.0, 1.0))
    _op(prof, "c10d::allreduce_", 10.0, [], [[4096]])  # DDP's bucket: no FSDP unit
    assert unit_comm(prof) == []


def test_nccl_kernels_launched_by_an_op_inside_the_collective_count_for_its_unit() -> None:
    """On a GPU the NCCL kernel sits on the innermost op that launched it (ProcessGroupNCCL's
    `record_param_comms` inside `c10d::_allgather_base_`): its time is the unit's all the same; a kernel
    outside every unit range is no unit's."""
    prof = Profile(environment=Environment(device="cuda", gpu_name="Test GPU"))
    prof.steps.append(Step(0, 0.0, 10_000.0, 10.0, gpu_span_ms=10.0))
    prof.annotations.append(Annotation("FSDP::all_gather", 100.0, 200.0, step=0, thread=1))
    _op(prof, "c10d::_allgather_base_", 150.0, [], [[1024, 256], [512, 256]])
    _op(prof, "record_param_comms", 160.0, [("ncclDevKernel_AllGather_RING_LL", 1000.0, 3000.0)])
    _op(prof, "record_param_comms", 5000.0, [("ncclDevKernel_AllGather_RING_LL", 6000.0, 7000.0)])
    (unit,) = unit_comm(prof)
    assert (unit.unit, unit.collective, unit.calls_per_step) == ("", "all_gather", 1.0)
    assert unit.ms_per_step == 2.0 and unit.exposed_ms_per_step == 2.0
