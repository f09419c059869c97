"""Edge cases of the five rules on small hand-built profiles (the real-profile tests are beside this one)."""

from __future__ import annotations

import pytest

from opadvisor.profile.model import (
    Annotation,
    Construction,
    Environment,
    Gap,
    Kernel,
    Memcpy,
    Op,
    Profile,
    Step,
    SyncEvent,
)
from opadvisor.rules.data import dataloader_stall
from opadvisor.rules.engine import NotApplicable
from opadvisor.rules.gemm import fp32_gemm
from opadvisor.rules.launch import host_sync
from opadvisor.rules.layernorm import manual_layernorm
from opadvisor.rules.optimizer import fused_optimizer

USER = "/nonexistent/train.py"  # not on disk: the rules fall back to the profile's lines


def gpu_env(capability=(9, 0)) -> Environment:
    return Environment(
        device="cuda", gpu_name="NVIDIA H200", sm_count=132, capability=list(capability), cpu_count=16
    )


def make_profile(ops=(), *, gpu=True, steps=((0.0, 1000.0, ()),), **kw) -> Profile:
    """steps: (start_us, end_us, [(gap_start, gap_duration), ...]) per step."""
    prof = Profile(environment=gpu_env() if gpu else Environment(), script=USER, **kw)
    prof.steps = [
        Step(index=i, start_us=a, end_us=b, wall_ms=(b - a) / 1000, idle_gaps=[Gap(s, d) for s, d in gaps])
        for i, (a, b, gaps) in enumerate(steps)
    ]
    prof.ops = list(ops)
    for i, op in enumerate(prof.ops):
        op.id = i
    return prof


def op(
    name, start, *, shapes=(), dtypes=None, scalars=None, line=10, parent=None, kernels=(), step=0, **kw
) -> Op:
    shapes = [list(s) if s is not None else None for s in shapes]
    o = Op(
        id=-1,
        name=name,
        step=step,
        start_us=start,
        duration_us=1.0,
        input_shapes=shapes,
        input_dtypes=list(dtypes)
        if dtypes is not None
        else ["float32" if s is not None else None for s in shapes],
        scalars=list(scalars) if scalars is not None else [None] * len(shapes),
        file=USER,
        line=line,
        function="forward",
        parent=parent,
        depth=0 if parent is None else 1,
        **kw,
    )
    o.kernels = [Kernel(k, start + 5, dur) for k, dur in kernels]
    o.gpu_time_us = sum(d for _, d in kernels)
    return o


# ---- host_sync -------------------------------------------------------------------------------------------


def test_host_sync_cpu_profile_is_not_applicable() -> None:
    prof = make_profile([op("aten::item", 10, shapes=[[]], line=7)], gpu=False)
    with pytest.raises(NotApplicable, match="train.py:7"):
        host_sync.detect(prof)


def _sync_profile(extra_memcpy: bool = False, in_loader: bool = False) -> Profile:
    ops = [
        op("aten::item", 100, shapes=[[]], line=20),
        op("aten::_local_scalar_dense", 101, shapes=[[]], line=20, parent=0),
        op("aten::item", 400, shapes=[[]], line=20),
        op("aten::_local_scalar_dense", 401, shapes=[[]], line=20, parent=2),
    ]
    prof = make_profile(ops, steps=[(0.0, 1000.0, [(150.0, 200.0), (460.0, 20.0)])])
    prof.syncs = [
        SyncEvent("cudaStreamSynchronize", 102, 40.0, step=0, op=1),  # ends at 142: opens the gap at 150
        SyncEvent("cudaStreamSynchronize", 402, 50.0, step=0, op=3),  # ends at 452: opens the gap at 460
    ]
    if extra_memcpy:
        prof.memcpys = [Memcpy("Memcpy HtoD (Pageable -> Device)", 103, 5.0, step=0, op=1)]
    if in_loader:
        prof.annotations = [
            Annotation("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 90, 100, step=0)
        ]
    return prof


def test_host_sync_counts_syncs_and_the_idle_gaps_they_open() -> None:
    (f,) = host_sync.detect(_sync_profile())
    assert (f.path, f.line, f.end_line) == (USER, 20, 20)
    assert f.details["syncs_per_step"] == 2
    assert f.time_ms_per_step == pytest.approx((200.0 + 20.0) / 1000)
    assert f.evidence.share_of_step == pytest.approx(0.22)
    assert f.fix == "none"


def test_host_sync_leaves_host_to_device_copies_and_loader_waits_to_dataloader_stall() -> None:
    (f,) = host_sync.detect(_sync_profile(extra_memcpy=True))
    assert f.details["syncs_per_step"] == 1  # the op of the first sync also made a HtoD copy
    assert host_sync.detect(_sync_profile(in_loader=True))[0].details["syncs_per_step"] == 1


def test_an_idle_gap_is_charged_to_one_sync_only() -> None:
    prof = _sync_profile()
    prof.syncs[1] = SyncEvent("cudaStreamSynchronize", 143, 2.0, step=0, op=3)  # also ends before the gap
    (f,) = host_sync.detect(prof)
    assert f.time_ms_per_step == pytest.approx(0.2)


# ---- dataloader_stall ------------------------------------------------------------------------------------


def _loader_profile(idle_us: float, construction: bool = True) -> Profile:
    ops = [
        op("aten::to", 600, shapes=[[8, 512], None, None, None, None], line=30),
        op(
            "aten::copy_",
            601,
            shapes=[[8, 512], [8, 512], None],
            scalars=[None, None, False],
            line=30,
            parent=0,
        ),
    ]
    prof = make_profile(ops, steps=[(0.0, 1000.0, [(0.0, idle_us)])])
    prof.annotations = [
        Annotation(
            "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
            0.0,
            500.0,
            step=0,
            file=USER,
            line=28,
        )
    ]
    prof.memcpys = [Memcpy("Memcpy HtoD (Pageable -> Device)", 610, 10.0, step=0, op=1)]
    if construction:
        prof.constructions = [
            Construction(
                "dataloader",
                "torch.utils.data.DataLoader",
                USER,
                25,
                "main",
                attrs={
                    "batch_size": 8,
                    "num_workers": 0,
                    "pin_memory": False,
                    "persistent_workers": False,
                    "dataset": "SlowDataset",
                    "dataset_len": 4096,
                },
            )
        ]
    return prof


def test_dataloader_stall_reports_the_construction_with_settings_and_copies() -> None:
    (f,) = dataloader_stall.detect(_loader_profile(400.0))
    assert (f.line, f.fix) == (25, "unsafe")
    assert f.time_ms_per_step == pytest.approx(0.4)
    assert f.details["num_workers"] == 0 and f.details["copies"][0]["line"] == 30
    assert f.details["copies"][0]["non_blocking"] is False and f.details["copies"][0]["pageable"] is True


def test_dataloader_stall_is_quiet_below_two_percent() -> None:
    assert dataloader_stall.detect(_loader_profile(10.0)) == []


def test_dataloader_stall_without_a_recorded_construction_points_at_the_copy() -> None:
    (f,) = dataloader_stall.detect(_loader_profile(400.0, construction=False))
    assert (f.line, f.fix) == (30, "none")


def test_dataloader_stall_cpu_profile_is_not_applicable() -> None:
    with pytest.raises(NotApplicable):
        dataloader_stall.detect(make_profile(gpu=False))


# ---- fp32_gemm -------------------------------------------------------------------------------------------


SGEMM = "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x64x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel"
TF32 = "sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x256x32_warpgroupsize2x1x1_execute_segment_k_off_kernel"
CUTLASS_TF32 = "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x64_32x6_nn_align4>(...)"


def _gemm_profile(kernel: str, dtype: str = "float32", capability=(9, 0)) -> Profile:
    mm = op(
        "aten::mm", 10, shapes=[[4096, 4096], [4096, 4096]], dtypes=[dtype, dtype], kernels=[(kernel, 2677.0)]
    )
    prof = make_profile([mm], steps=[(0.0, 4000.0, ())])
    prof.environment = gpu_env(capability)
    return prof


def test_fp32_gemm_estimates_a_large_saving_for_a_compute_bound_gemm() -> None:
    (f,) = fp32_gemm.detect(_gemm_profile(SGEMM))
    assert f.path == USER and f.line == 1  # the script cannot be read: line 1
    assert f.time_ms_per_step == pytest.approx(2.677)
    assert f.est_saving_ms_per_step == pytest.approx(2.677 * 0.75, rel=0.05)
    assert f.details["sites"][0]["line"] == 10


@pytest.mark.parametrize("kernel", [TF32, CUTLASS_TF32])
def test_fp32_gemm_already_on_tensor_cores_is_not_reported(kernel: str) -> None:
    assert fp32_gemm.detect(_gemm_profile(kernel)) == []


def test_fp32_gemm_bf16_and_old_gpus_are_not_reported() -> None:
    assert (
        fp32_gemm.detect(_gemm_profile("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", dtype="bfloat16"))
        == []
    )
    assert fp32_gemm.detect(_gemm_profile(SGEMM, capability=(7, 0))) == []


def test_fp32_gemm_small_latency_bound_gemms_are_not_reported() -> None:
    """256x768x768 in float32 ran 20 us on an H200 with or without TF32: nothing to gain."""
    prof = make_profile(
        [op("aten::mm", 10, shapes=[[256, 768], [768, 768]], kernels=[(SGEMM, 20.0)])],
        steps=[(0.0, 100.0, ())],
    )
    assert fp32_gemm.detect(prof) == []


def test_fp32_gemm_cpu_profile_is_not_applicable() -> None:
    with pytest.raises(NotApplicable):
        fp32_gemm.detect(make_profile(gpu=False))


def test_fp32_gemm_fix_line_is_the_torch_import(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text('"""doc"""\nimport os\nimport torch\nimport torch.nn as nn\n')
    prof = _gemm_profile(SGEMM)
    prof.script = str(script)
    (f,) = fp32_gemm.detect(prof)
    assert (f.path, f.line, f.end_line) == (str(script), 3, 3)


# ---- fused_optimizer ----------------------------------------------------------------------------------------


def _optimizer_profile(**attrs) -> Profile:
    ops = [
        # launch-bound: the GPU waits for each launch (the kernels run 10 us of a 400 us span)
        op("aten::_foreach_lerp_", 510, kernels=[("multi_tensor_apply_kernel", 10.0)], line=40),
        op("aten::_foreach_mul_", 700, kernels=[("multi_tensor_apply_kernel", 10.0)], line=40),
        op("aten::_foreach_addcdiv_", 900, kernels=[("multi_tensor_apply_kernel", 10.0)], line=40),
    ]
    prof = make_profile(ops, steps=[(0.0, 1000.0, ())])
    # the last step's range is recorded cut short (the window closes inside the step hook)
    prof.annotations = [Annotation("Optimizer.step#AdamW.step", 500.0, 5.0, step=0)]
    base = {
        "fused": None,
        "foreach": None,
        "lr": 1e-3,
        "param_count": 3,
        "param_devices": ["cuda"],
        "param_dtypes": ["float32"],
    }
    prof.constructions = [
        Construction("optimizer", "torch.optim.AdamW", USER, 12, "main", attrs={**base, **attrs})
    ]
    return prof


def test_fused_optimizer_reports_foreach_adamw_with_the_ops_of_the_cut_short_range() -> None:
    (f,) = fused_optimizer.detect(_optimizer_profile())
    assert (f.line, f.fix) == (12, "safe")
    assert f.details["path"] == "foreach" and f.evidence.kernel_count == 3
    assert f.time_ms_per_step == pytest.approx(0.4)  # the span the step occupied on the GPU
    assert f.est_saving_ms_per_step == pytest.approx(0.4 - 0.03 * 2.8 / 3)
    assert f.details["param_devices"] == ["cuda"] and f.details["param_dtypes"] == ["float32"]


@pytest.mark.parametrize(
    "attrs",
    [
        {"fused": True},
        {"param_devices": ["cpu", "cuda"]},
        {"param_devices": ["cpu"]},
        {"param_dtypes": ["int64"]},
    ],
)
def test_fused_optimizer_not_offered(attrs) -> None:
    assert fused_optimizer.detect(_optimizer_profile(**attrs)) == []


def test_fused_optimizer_cpu_profile_is_not_applicable() -> None:
    with pytest.raises(NotApplicable):
        fused_optimizer.detect(make_profile(gpu=False))


# ---- manual_layernorm ------------------------------------------------------------------------------------------


def _ln_ops(*, var_op=None, eps=True, sub_shape=(4, 8, 1)) -> list[Op]:
    s, r = (4, 8, 32), sub_shape
    ops = [op("aten::mean", 0, shapes=[s, None, None, None], scalars=[None, None, True, None], line=1)]
    ops.append(op("aten::sub", 1, shapes=[s, r, None], line=1, line_exact=False))
    if var_op is None:
        ops += [
            op("aten::pow", 2, shapes=[s, None], scalars=[None, 2], line=2),
            op("aten::mean", 3, shapes=[s, None, None, None], scalars=[None, None, True, None], line=2),
        ]
    else:
        ops.append(var_op)
    if eps:
        ops.append(op("aten::add", 4, shapes=[r, [], None], dtypes=["float32", "float64", None], line=3))
    ops += [
        op("aten::sqrt", 5, shapes=[r], line=3),
        op("aten::div", 6, shapes=[s, r], line=3, line_exact=False),
    ]
    return ops


def test_manual_layernorm_minimal_chain_on_cpu() -> None:
    (f,) = manual_layernorm.detect(make_profile(_ln_ops(), gpu=False))
    assert (f.line, f.end_line, f.fix) == (1, 3, "safe")
    assert f.est_saving_ms_per_step is None  # no kernel times on a CPU profile


def test_manual_layernorm_without_eps_is_still_layer_norm_with_eps_zero() -> None:
    (f,) = manual_layernorm.detect(make_profile(_ln_ops(eps=False), gpu=False))
    assert f.fix == "safe" and f.details["eps"] == "none"


def test_manual_layernorm_unbiased_var_is_unsafe() -> None:
    var = op("aten::var", 2, shapes=[(4, 8, 32), None, None, None], scalars=[None, None, True, True], line=2)
    (f,) = manual_layernorm.detect(make_profile(_ln_ops(var_op=var), gpu=False))
    assert f.fix == "unsafe" and f.details["variance"] == "var_unbiased"


def test_manual_layernorm_needs_the_mean_subtracted() -> None:
    ops = [o for o in _ln_ops() if o.name != "aten::sub"]  # x / sqrt(mean(x^2)): an RMS norm
    assert manual_layernorm.detect(make_profile(ops, gpu=False)) == []


def test_manual_layernorm_full_reduction_is_not_reported() -> None:
    ops = _ln_ops(sub_shape=())
    ops[0] = op("aten::mean", 0, shapes=[(4, 8, 32), None], line=1)  # x.mean(): no dim argument
    assert manual_layernorm.detect(make_profile(ops, gpu=False)) == []


def test_fused_optimizer_sgd_single_pass_saves_nothing() -> None:
    prof = _optimizer_profile()
    prof.constructions[0].cls = "torch.optim.SGD"
    prof.annotations[0].name = "Optimizer.step#SGD.step"
    prof.ops = prof.ops[:1]  # one _foreach_add_ pass over the parameters, its kernels back to back
    prof.ops[0].kernels = [Kernel("multi_tensor_apply_kernel", 515 + 10 * i, 10.0) for i in range(5)]
    assert fused_optimizer.detect(prof) == []
