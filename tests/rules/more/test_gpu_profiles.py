"""The five rules on real CUDA profiles (H200) of the scripts in scripts/ and of the examples.

The profiles are tests/data/<name>.profile.json, recorded by tests/data/record_gpu_fixtures.py; each test
is skipped while its file is absent. Expected lines come from the scripts' `# expect:` marks, so a script
edited since its fixture was recorded shows up here (its source no longer matches): re-record it.
"""

from __future__ import annotations

import pytest

from opadvisor.rules.data import dataloader_stall
from opadvisor.rules.engine import analyse
from opadvisor.rules.gemm import fp32_gemm
from opadvisor.rules.launch import host_sync
from opadvisor.rules.layernorm import manual_layernorm
from opadvisor.rules.optimizer import fused_optimizer

from .conftest import line_of, lines, script_path

# ---- host_sync ---------------------------------------------------------------------------------------


def test_item_every_step_is_one_sync_per_step_with_its_idle_time(gpu_profile) -> None:
    (f,) = host_sync.detect(gpu_profile("sync_item"))
    assert f.path == str(script_path("sync_item"))
    assert (f.line, f.end_line) == lines("sync_item", "host_sync")
    assert f.fix == "none"
    assert f.details["syncs_per_step"] == pytest.approx(1.0)
    assert ".item()" in f.message
    assert f.evidence.time_basis == "gpu"
    assert f.time_ms_per_step is not None and f.time_ms_per_step > 0  # the GPU idles after every sync
    assert f.est_saving_ms_per_step == f.time_ms_per_step


def test_metrics_kept_on_the_device_do_not_sync(gpu_profile) -> None:
    assert host_sync.detect(gpu_profile("sync_free")) == []


def test_bert_example_item_line_is_reported_and_batch_copies_are_not(gpu_profile) -> None:
    found = host_sync.detect(gpu_profile("bert_train"))
    at = {f.line for f in found if f.path == str(script_path("example:bert_train"))}
    assert line_of("example:bert_train", "{loss.item():") in at
    # pageable host-to-device copies of the batch block too, but they are dataloader_stall's
    assert line_of("example:bert_train", "input_ids = input_ids.to(device)") not in at


# ---- dataloader_stall ----------------------------------------------------------------------------------


def test_slow_single_process_loader_is_reported_at_its_construction(gpu_profile) -> None:
    (f,) = dataloader_stall.detect(gpu_profile("slow_loader"))
    assert f.path == str(script_path("slow_loader"))
    assert (f.line, f.end_line) == lines("slow_loader", "dataloader_stall")
    assert f.fix == "unsafe"
    assert f.details["num_workers"] == 0 and f.details["pin_memory"] is False
    assert f.details["iterator"] == "single-process"
    assert f.evidence.share_of_step is not None and f.evidence.share_of_step > 0.2
    copy_line = lines("slow_loader", "batch copy")[0]
    copies = [c for c in f.details["copies"] if c["line"] == copy_line]
    assert copies and copies[0]["pageable"] is True and copies[0]["non_blocking"] is False
    assert any(c.startswith("num_workers=") for c in f.details["suggested"])
    assert "pin_memory=True" in f.details["suggested"]
    assert "pickle" in f.advice


def test_workers_pinned_memory_and_busy_gpu_are_not_reported(gpu_profile) -> None:
    assert dataloader_stall.detect(gpu_profile("fast_loader")) == []


# ---- fp32_gemm -------------------------------------------------------------------------------------------


def test_float32_gemms_point_at_the_torch_import(gpu_profile) -> None:
    prof = gpu_profile("fp32_mm")
    assert tuple(prof.environment.capability) >= (8, 0)
    (f,) = fp32_gemm.detect(prof)
    assert f.path == str(script_path("fp32_mm"))
    assert (f.line, f.end_line) == lines("fp32_mm", "fp32_gemm")
    assert f.fix == "unsafe"
    assert f.details["insert_after_line"] == f.end_line and f.details["imports_torch"] is True
    assert lines("fp32_mm", "gemm site")[0] in {s["line"] for s in f.details["sites"]}
    assert f.evidence.share_of_step is not None and f.evidence.share_of_step > 0.3
    assert 0 < f.est_saving_ms_per_step < f.time_ms_per_step


def test_tf32_gemms_are_not_reported(gpu_profile) -> None:
    assert fp32_gemm.detect(gpu_profile("tf32_mm")) == []


@pytest.mark.parametrize("name", ["bert_train", "gpt_train", "sync_item", "adamw_fused"])
def test_bf16_autocast_and_tiny_float32_gemms_are_not_reported(gpu_profile, name: str) -> None:
    """The examples run under bf16 autocast; the small scripts' float32 GEMMs are latency-bound."""
    assert fp32_gemm.detect(gpu_profile(name)) == []


# ---- fused_optimizer ---------------------------------------------------------------------------------------


def test_foreach_adamw_is_reported_at_its_construction(gpu_profile) -> None:
    (f,) = fused_optimizer.detect(gpu_profile("adamw_unfused"))
    assert f.path == str(script_path("adamw_unfused"))
    assert (f.line, f.end_line) == lines("adamw_unfused", "fused_optimizer")
    assert f.fix == "safe"
    assert f.details["path"] == "foreach"
    assert f.details["param_devices"] == ["cuda"] and f.details["param_dtypes"] == ["float32"]
    assert f.details["param_count"] == 48
    assert f.evidence.kernel_count and f.evidence.kernel_count > 2
    assert 0 < f.est_saving_ms_per_step <= f.time_ms_per_step


@pytest.mark.parametrize("name", ["adamw_fused", "sync_item", "fast_loader"])
def test_fused_or_single_pass_optimizers_are_not_reported(gpu_profile, name: str) -> None:
    """fused=True; SGD without momentum (one foreach pass: fusing saves nothing)."""
    assert fused_optimizer.detect(gpu_profile(name)) == []


@pytest.mark.parametrize("example", ["bert_train", "gpt_train"])
def test_examples_adamw_is_reported(gpu_profile, example: str) -> None:
    (f,) = fused_optimizer.detect(gpu_profile(example))
    assert f.path == str(script_path(f"example:{example}"))
    assert f.line == line_of(f"example:{example}", "optimizer = torch.optim.AdamW(")


# ---- manual_layernorm on the GPU: the same lines as on the CPU, with kernel times ------------------------


def test_manual_layernorm_on_gpu_has_kernel_times_and_a_saving(gpu_profile) -> None:
    found = sorted(manual_layernorm.detect(gpu_profile("manual_ln")), key=lambda f: f.line)
    assert [(f.line, f.end_line, f.fix) for f in found] == [
        (*lines("manual_ln", "manual_layernorm safe"), "safe"),
        (*lines("manual_ln", "manual_layernorm unsafe"), "unsafe"),
    ]
    for f in found:
        assert f.evidence.time_basis == "gpu" and f.evidence.kernel_count and f.evidence.kernel_count > 5
        assert f.est_saving_ms_per_step is not None and 0 < f.est_saving_ms_per_step < f.time_ms_per_step


@pytest.mark.parametrize("example", ["bert_train", "gpt_train"])
def test_no_manual_layernorm_in_the_examples_on_gpu(gpu_profile, example: str) -> None:
    assert analyse([gpu_profile(example)], select=["manual_layernorm"]).findings == []
