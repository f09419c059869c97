"""fused_cross_entropy on real GPU profiles (tests/data, recorded on an H200): the examples' LM-head losses
are found at their lines with their measured cost; a 10-class loss and a CPU profile are not."""

from __future__ import annotations

import pytest
from rules_testlib import REPO, gpu_fixture

from opadvisor.profile.model import Profile
from opadvisor.rules.engine import analyse
from opadvisor.rules.loss import fused_cross_entropy


@pytest.mark.parametrize(("example", "classes"), [("bert_train", 30522), ("gpt_train", 50257)])
def test_lm_head_loss_of_the_examples_is_found(example: str, classes: int) -> None:
    profile = gpu_fixture(example)
    (f,) = fused_cross_entropy.detect(profile)
    path = REPO / "examples" / f"{example}.py"
    assert f.path == str(path)
    assert "F.cross_entropy(" in path.read_text().splitlines()[f.line - 1]
    assert f.fix == "safe"
    assert f.details["classes"] == classes and f.details["dtype"] == "bfloat16"
    assert f.details["autocast_copy"] is True  # bf16 autocast casts the logits to float32
    assert f.evidence.time_basis == "gpu"
    assert 0 < f.est_saving_ms_per_step < f.time_ms_per_step
    assert f"{classes} classes" in f.message


def test_ten_classes_are_not_reported() -> None:
    """fast_loader's classifier computes F.cross_entropy over [4096, 10]: nothing to fuse there."""
    profile = gpu_fixture("fast_loader")
    assert any(op.name == fused_cross_entropy.LOSS_OP for op in profile.ops)
    assert fused_cross_entropy.detect(profile) == []


def test_a_cpu_profile_gets_a_note_not_a_finding() -> None:
    report = analyse([Profile()], select=["fused_cross_entropy"])
    assert report.findings == []
    assert len(report.notes) == 1 and "needs a CUDA profile" in report.notes[0].message


def test_class_weights_and_label_smoothing_are_left_alone() -> None:
    profile = gpu_fixture("bert_train")
    for op in profile.ops:
        if op.name == fused_cross_entropy.LOSS_OP:
            op.scalars = [*op.scalars[:5], 0.1]  # label_smoothing=0.1
    assert fused_cross_entropy.detect(profile) == []


def test_threshold_is_the_kernels_dispatch_size() -> None:
    import importlib

    kernel = importlib.import_module("opadvisor.kernels.cross_entropy")  # the package exports the function
    assert fused_cross_entropy.MIN_CLASSES == kernel.SMALL_CLASSES
