"""manual_layernorm on real CPU profiles (it reads op names and shapes, so it works without a GPU)."""

from __future__ import annotations

import pytest

from opadvisor.rules.engine import analyse
from opadvisor.rules.layernorm import manual_layernorm

from .conftest import lines, script_path


def test_two_hand_written_layer_norms_one_safe_one_not(cpu_profile) -> None:
    found = sorted(manual_layernorm.detect(cpu_profile("manual_ln")), key=lambda f: f.line)
    assert len(found) == 2, [f.message for f in found]
    safe, unsafe = found
    assert safe.path == unsafe.path == str(script_path("manual_ln"))

    assert (safe.line, safe.end_line) == lines("manual_ln", "manual_layernorm safe")
    assert safe.fix == "safe" and safe.function == "forward"
    assert safe.details["equivalent"] is True
    assert safe.details["normalized_shape"] == [64] and safe.details["reduce_dims"] == [-1]
    assert safe.details["weight"] and safe.details["bias"]
    assert safe.details["eps"] == "inside_sqrt" and safe.details["variance"] == "var"
    assert safe.evidence.time_basis == "cpu"
    assert safe.evidence.ops[0] == "aten::mean" and "aten::sqrt" in safe.evidence.ops

    assert (unsafe.line, unsafe.end_line) == lines("manual_ln", "manual_layernorm unsafe")
    assert unsafe.fix == "unsafe"
    assert unsafe.details["variance"] == "std_unbiased" and unsafe.details["eps"] == "outside_sqrt"
    reasons = " ".join(unsafe.details["not_equivalent_because"])
    assert "unbiased" in reasons and "outside the square root" in reasons
    assert "not the same function" in unsafe.advice


@pytest.mark.parametrize(
    ("function", "label", "fix", "shape"),
    [
        ("norm_rsqrt", "rsqrt", "safe", [32]),
        ("norm_var_mean", "var_mean", "safe", [32]),
        ("norm_channels", "channels", "unsafe", None),
        ("norm_two_dims", "two dims", "safe", [8, 32]),
    ],
)
def test_other_spellings(cpu_profile, function: str, label: str, fix: str, shape) -> None:
    found = {f.function: f for f in manual_layernorm.detect(cpu_profile("ln_variants"))}
    assert set(found) == {"norm_rsqrt", "norm_var_mean", "norm_channels", "norm_two_dims"}
    f = found[function]
    assert (f.line, f.end_line) == lines("ln_variants", label)
    assert f.fix == fix
    assert f.details["normalized_shape"] == shape
    if function == "norm_channels":
        assert f.details["reduce_dims"] == [-2]
        assert "not the last" in " ".join(f.details["not_equivalent_because"])


def test_layer_norm_module_rms_norm_and_standardisation_are_not_reported(cpu_profile) -> None:
    assert manual_layernorm.detect(cpu_profile("builtin_ln")) == []


@pytest.mark.parametrize("example", ["example:bert_train", "example:gpt_train"])
def test_examples_use_nn_layernorm(cpu_profile, example: str) -> None:
    report = analyse([cpu_profile(example)], select=["manual_layernorm"])
    assert report.findings == [] and report.notes == []


def test_a_variance_taken_before_the_mean(cpu_profile) -> None:
    (f,) = manual_layernorm.detect(cpu_profile("ln_variance_first"))
    assert (f.line, f.end_line) == lines("ln_variance_first", "variance first")
    assert f.fix == "safe" and f.details["normalized_shape"] == [32] and f.details["rsqrt"]
