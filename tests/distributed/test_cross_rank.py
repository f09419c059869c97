"""cross_rank.analyse on hand-built profiles: every number checked against arithmetic done by hand."""

from __future__ import annotations

import json

from rich.console import Console

from opadvisor.profile.model import Annotation, Environment, Kernel, Op, Profile, Step
from opadvisor.ranks import cross_rank


def gpu_profile(
    rank: int, steps: list[tuple[list[tuple[float, float]], list[tuple[float, float]]]]
) -> Profile:
    """Steps of 10 ms: (compute kernels, NCCL kernels) as (start_ms, end_ms) within the step."""
    prof = Profile(rank=rank, world_size=2, environment=Environment(device="cuda", gpu_name="Test GPU"))
    for i, (compute, comm) in enumerate(steps):
        base = i * 10_000.0
        prof.steps.append(Step(i, base, base + 10_000.0, 10.0, gpu_span_ms=10.0))
        mm = Op(len(prof.ops), "aten::mm", i, base, 100.0)
        mm.kernels = [Kernel("sm90_gemm", base + a * 1000, (b - a) * 1000) for a, b in compute]
        prof.ops.append(mm)
        ar = Op(len(prof.ops), "c10d::allreduce_", i, base + 50, 20.0, is_backward=True)
        ar.kernels = [
            Kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", base + a * 1000, (b - a) * 1000)
            for a, b in comm
        ]
        prof.ops.append(ar)
    return prof


def test_gpu_overlap_exposed_and_straggler() -> None:
    # rank 0 computes 0-5 ms, then waits in the all-reduce 4-10 ms: 1 ms overlapped, 5 ms exposed
    # rank 1 computes 0-8 ms (the straggler), all-reduce 7-10 ms: 1 ms overlapped, 2 ms exposed
    fast = gpu_profile(0, [([(0, 5)], [(4, 10)])] * 3)
    slow = gpu_profile(1, [([(0, 8)], [(7, 10)])] * 3)
    report = cross_rank.analyse([slow, fast])  # any order
    assert report.basis == "gpu" and "NCCL" in report.basis_detail
    r0, r1 = report.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    assert r0.comm_ms == 6.0 and r0.exposed_comm_ms == 5.0 and r0.work_ms == 5.0
    assert r1.comm_ms == 3.0 and r1.exposed_comm_ms == 2.0 and r1.work_ms == 8.0
    assert abs(r0.overlap - 1 / 6) < 1e-9 and abs(r1.overlap - 1 / 3) < 1e-9
    assert r0.collectives == {"all_reduce": 6.0} and r0.calls_per_step == {"all_reduce": 1.0}
    # the cost of communication is read on the rank that waits least (rank 1); rank 0's extra is waiting
    assert report.comm_ms == 3.0 and report.exposed_comm_ms == 2.0 and report.wait_ms == 3.0
    assert abs(report.overlap - 1 / 3) < 1e-9
    s = report.straggler
    assert s is not None and s.rank == 1
    assert s.extra_ms == 3.0 and s.share == 0.3 and s.slowest_steps == 3 and s.others_wait_ms == 3.0
    assert s.differing[0] == ("aten::mm", 3.0)  # its GEMM kernels run 3 ms longer per step
    assert [a.id for a in report.advice][0] == "straggler"


def test_no_straggler_when_the_slowest_rank_changes() -> None:
    a = gpu_profile(
        0, [([(0, 8)], [(7, 10)]), ([(0, 5)], [(4, 10)]), ([(0, 8)], [(7, 10)]), ([(0, 5)], [(4, 10)])]
    )
    b = gpu_profile(
        1, [([(0, 5)], [(4, 10)]), ([(0, 8)], [(7, 10)]), ([(0, 5)], [(4, 10)]), ([(0, 8)], [(7, 10)])]
    )
    report = cross_rank.analyse([a, b])
    assert report.straggler is None
    assert not [x for x in report.advice if x.id == "straggler"]


def test_small_difference_is_not_a_straggler() -> None:
    a = gpu_profile(0, [([(0, 5.0)], [(4, 10)])] * 3)
    b = gpu_profile(1, [([(0, 5.2)], [(5.1, 10)])] * 3)  # slowest every step, but by 0.1 ms (1%)
    assert cross_rank.analyse([a, b]).straggler is None


def test_exposed_communication_in_one_bucket_advises_bucket_size_and_accumulation() -> None:
    # all-reduce only after the whole backward: 0% overlap, 4 ms of 10 exposed
    profs = [gpu_profile(r, [([(0, 6)], [(6, 10)])] * 2) for r in (0, 1)]
    report = cross_rank.analyse(profs)
    assert report.overlap == 0.0 and report.exposed_comm_ms == 4.0 and report.step_ms == 10.0
    ids = [a.id for a in report.advice]
    assert "bucket_size" in ids and "grad_accumulation" in ids
    assert "bucket_cap_mb" in next(a for a in report.advice if a.id == "bucket_size").message
    assert "no_sync" in next(a for a in report.advice if a.id == "grad_accumulation").message


def test_well_overlapped_communication_gets_no_overlap_advice() -> None:
    profs = [gpu_profile(r, [([(0, 9)], [(2, 8)])] * 2) for r in (0, 1)]
    report = cross_rank.analyse(profs)
    assert report.exposed_comm_ms == 0.0 and report.overlap == 1.0
    assert {a.id for a in report.advice} <= {"grad_accumulation"}


def cpu_profile(rank: int, *, sleep_ms: float) -> Profile:
    """gloo: a 2 ms all-reduce on gloo's thread (2) after 4 ms of ops on the training thread (1).

    The rank that sleeps `sleep_ms` in Python before its ops makes the other wait as long in the
    all-reduce; then both all-reduce a logged value from the loop at 9.5 ms; every step lasts 10 ms.
    """
    prof = Profile(rank=rank, world_size=2, environment=Environment(device="cpu"))
    for i in range(3):
        base = i * 10_000.0
        prof.steps.append(Step(i, base, base + 10_000.0, 10.0))
        start = base + sleep_ms * 1000
        prof.ops.append(Op(len(prof.ops), "aten::addmm", i, start, 4_000.0, thread=1, file="/t.py", line=3))
        prof.ops.append(
            Op(len(prof.ops), "c10d::allreduce_", i, start + 4_000, 10.0, thread=1, is_backward=True)
        )
        wait = 3_000.0 - sleep_ms * 1000
        prof.annotations.append(Annotation("gloo:all_reduce", start + 4_000, wait + 2_000, step=i, thread=2))
        loop = Op(len(prof.ops), "c10d::allreduce_", i, base + 9_500, 5.0, thread=1, file="/t.py", line=9)
        prof.ops.append(loop)
    return prof


def test_cpu_basis_from_gloo_ranges_and_c10d_ops() -> None:
    report = cross_rank.analyse([cpu_profile(0, sleep_ms=0.0), cpu_profile(1, sleep_ms=3.0)])
    assert report.basis == "cpu" and "gloo" in report.basis_detail
    r0, r1 = report.ranks
    # rank 0: all-reduce 4-9 ms (5 ms, waiting 3 of them) + the loop's 5 us one; nothing computes beside it
    assert abs(r0.comm_ms - 5.005) < 1e-9 and abs(r0.exposed_comm_ms - 5.005) < 1e-9 and r0.overlap == 0.0
    assert abs(r1.comm_ms - 2.005) < 1e-9
    assert r0.calls_per_step == {"all_reduce": 1.0}  # counted from gloo's ranges: one per step
    s = report.straggler
    assert (
        s is not None and s.rank == 1 and abs(s.extra_ms - 3.0) < 1e-9 and abs(s.others_wait_ms - 3.0) < 1e-9
    )
    # the sleep is in no op: that is what the report points at
    assert s.differing[0][0].startswith("time in no torch op") and abs(s.differing[0][1] - 3.0) < 1e-9
    loop = [a for a in report.advice if a.id == "loop_collective"]
    assert [(a.path, a.line) for a in loop] == [("/t.py", 9)]  # the backward one is DDP's, not flagged
    assert any("waiting for the slowest rank" in n for n in report.notes)


def test_missing_rank_incomplete_profile_and_unequal_steps_are_noted() -> None:
    a = gpu_profile(0, [([(0, 5)], [(4, 10)])] * 3)
    b = gpu_profile(2, [([(0, 5)], [(4, 10)])] * 2)
    b.world_size = a.world_size = 3
    b.complete = False
    report = cross_rank.analyse([a, b])
    assert report.missing_ranks == [1] and report.world_size == 3
    notes = " | ".join(report.notes)
    assert "rank(s) 1 of 3" in notes and "rank(s) 2 did not record the whole window" in notes
    assert "compared the first 2" in notes
    assert all(r.steps == 2 for r in report.ranks)


def test_single_rank_and_no_communication() -> None:
    prof = Profile(environment=Environment(device="cpu"))
    prof.steps = [Step(0, 0.0, 1000.0, 1.0)]
    prof.ops = [Op(0, "aten::mm", 0, 0.0, 500.0)]
    report = cross_rank.analyse([prof])
    assert report.basis == "none" and report.comm_ms is None and report.straggler is None
    assert report.advice == []


def test_render_and_json() -> None:
    report = cross_rank.analyse(
        [gpu_profile(0, [([(0, 5)], [(4, 10)])] * 3), gpu_profile(1, [([(0, 8)], [(7, 10)])] * 3)]
    )
    console = Console(width=200, record=True)
    console.print(cross_rank.render(report))
    text = console.export_text()
    assert "2 of 2 rank(s) on Test GPU" in text and "1 (slow)" in text and "[straggler] rank 1" in text
    assert "Communication measured from: NCCL kernels" in text
    data = json.loads(json.dumps(cross_rank.to_json(report)))
    assert data["schema"] == 1 and data["basis"] == "gpu" and data["straggler"]["rank"] == 1
    assert data["straggler"]["differing"][0] == {"name": "aten::mm", "extra_ms": 3.0}
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    brief = Console(width=200, record=True)
    brief.print(cross_rank.render(report, brief=True))
    assert "bucket" not in brief.export_text()  # brief: only the straggler's advice


def test_collective_names() -> None:
    assert cross_rank._nccl_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert cross_rank._nccl_collective("ncclKernel_AllGather_RING_LL_Sum_int8_t") == "all_gather"
    assert cross_rank._nccl_collective("ncclDevKernel_SendRecv") == "send_recv"
    assert cross_rank._nccl_collective("void at::native::elementwise") is None
    assert cross_rank._c10d_collective("c10d::allreduce_") == "all_reduce"
    assert cross_rank._c10d_collective("c10d::_allgather_base_") == "all_gather"
    assert cross_rank._c10d_collective("c10d::broadcast_") == "broadcast"
    assert cross_rank._c10d_collective("aten::mm") is None


def test_gpu_profile_without_nccl_kernels_does_not_guess() -> None:
    """c10d ops on a GPU only say when work was queued: no CPU-time stand-in for NCCL kernels."""
    prof = gpu_profile(0, [([(0, 5)], [])] * 2)
    report = cross_rank.analyse([prof])
    assert report.basis == "none" and report.comm_ms is None
    assert any("no NCCL kernel was recorded" in n for n in report.notes)


def test_fsdp_unit_gathers_are_not_loop_collectives() -> None:
    # FSDP2 gathers each unit's parameters from the module's forward hook: the op's Python line is the
    # model call in the training loop, but it runs inside FSDP's own range, so it is not the loop's
    prof = cpu_profile(0, sleep_ms=0.0)
    for i in range(3):
        base = i * 10_000.0
        prof.annotations.append(Annotation("FSDP::all_gather (blocks.0)", base + 100, 50.0, step=i, thread=1))
        gather = Op(
            len(prof.ops), "c10d::_allgather_base_", i, base + 110, 20.0, thread=1, file="/t.py", line=5
        )
        prof.ops.append(gather)
    report = cross_rank.analyse([prof, cpu_profile(1, sleep_ms=0.0)])
    loop = [(a.path, a.line) for a in report.advice if a.id == "loop_collective"]
    assert loop == [("/t.py", 9)]  # the logged all-reduce only; the unit's gathers are FSDP's
