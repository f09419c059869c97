"""fuse_region on real profiles: the scripts under scripts/ profiled on the CPU (the op chains are the same
as on a GPU), the GPU fixtures under tests/data, and the pieces it is built of on synthetic ops."""

from __future__ import annotations

import dataclasses

import pytest
from rules_testlib import SCRIPTS, expected_lines, gpu_fixture

from opadvisor.profile.model import Op, load_profile
from opadvisor.rules._regions import Site, bytes_moved, chain_of, merge_same_fix
from opadvisor.rules.engine import analyse
from opadvisor.rules.regions import fuse_region


def _findings(rules_profile, name: str):
    run = rules_profile(name)
    return {f.details["chain"]: f for f in fuse_region.detect(load_profile(run / "profile.json"))}


def test_hand_written_activations_on_a_cpu_profile(rules_profile) -> None:
    found = _findings(rules_profile, "hand_gelu_mlp")
    assert set(found) == {"gelu_tanh", "gelu_erf", "silu", "sigmoid_gate"}
    script = SCRIPTS / "hand_gelu_mlp.py"
    for chain, f in found.items():
        assert (f.line, f.end_line) == expected_lines(script, f"fuse_region {chain}")
        assert f.path == str(script) and f.fix == "safe"
        assert f.evidence.time_basis == "cpu" and f.est_saving_ms_per_step is None
    tanh = found["gelu_tanh"]
    assert tanh.function == "new_gelu" and tanh.details["def_line"] == 12
    assert tanh.message.startswith("tanh GELU written by hand: 8 ops forward, ")
    assert tanh.details["kernels_forward"] == 8 and tanh.details["kernels_backward"] >= 6
    assert 'gelu(x, approximate="tanh")' in tanh.advice
    assert found["gelu_erf"].function == "ErfGELU.forward"
    assert found["silu"].details["kernels_forward"] == 2
    assert "quick_gelu" in found["sigmoid_gate"].advice


def test_hand_written_dropout_function_and_inline(rules_profile) -> None:
    findings = fuse_region.detect(load_profile(rules_profile("dropout_by_hand") / "profile.json"))
    script = SCRIPTS / "dropout_by_hand.py"
    by_lines = {(f.line, f.end_line): f for f in findings}
    assert set(by_lines) == {
        expected_lines(script, "fuse_region function"),
        expected_lines(script, "fuse_region inline"),
    }
    function = by_lines[expected_lines(script, "fuse_region function")]
    assert function.details["chain"] == "dropout" and function.function == "XDropout.forward"
    assert function.evidence.ops[:2] == ["aten::bernoulli_", "aten::rsub"]
    assert "distribution" in " ".join(function.evidence.notes)
    assert "opadvisor.kernels.dropout" in function.advice


def test_relative_position_gather_is_one_finding_around_the_products(rules_profile) -> None:
    findings = fuse_region.detect(load_profile(rules_profile("relpos_gather") / "profile.json"))
    assert len(findings) == 1
    f = findings[0]
    assert f.details["chain"] == "relpos_gather" and f.function == "RelativeBias.bias"
    assert (f.line, f.end_line) == expected_lines(SCRIPTS / "relpos_gather.py", "fuse_region relpos")
    assert "aten::bmm" not in f.evidence.ops and f.evidence.ops.count("aten::gather") == 2


def test_the_softmax_after_it_stays_with_fused_softmax(rules_profile) -> None:
    report = analyse([load_profile(rules_profile("relpos_gather") / "profile.json")])
    rules = sorted(f.rule for f in report.findings)
    assert rules == ["fuse_region", "fused_softmax"]


def test_already_fused_model_has_no_region(rules_profile) -> None:
    assert fuse_region.detect(load_profile(rules_profile("already_fused") / "profile.json")) == []


# ---- GPU profiles (tests/data) ---------------------------------------------------------------------------------


def test_gpu_profile_generic_chain_costed_and_floored() -> None:
    profile = gpu_fixture("bf16_gemm")
    assert fuse_region.detect(profile)[0].est_saving_ms_per_step is None  # no bandwidth measured then
    profile = dataclasses.replace(
        profile, environment=dataclasses.replace(profile.environment, copy_bandwidth_gbps=4000.0)
    )
    (f,) = fuse_region.detect(profile)
    assert f.details["chain"] is None and f.function == "Model.forward"
    assert f.details["kernels_forward"] >= 3 and f.evidence.time_basis == "gpu"
    floor = f.details["bytes_per_run"] * f.details["runs_per_step"] / 4e12 * 1e3
    assert f.details["floor_ms_per_step"] == pytest.approx(floor)
    assert f.est_saving_ms_per_step == pytest.approx(max(0.0, f.time_ms_per_step - floor))
    assert "at the measured 4000 GB/s" in f.message
    assert "compile_region on Model.forward" in f.advice


def test_gpu_profile_loop_of_tanh_is_not_called_a_gelu() -> None:
    (f,) = fuse_region.detect(gpu_fixture("tiny_kernels"))
    assert f.details["chain"] is None and f.function == "activation"
    assert f.details["kernels_forward"] == 150  # one call's 50 x (mul, add, tanh)


@pytest.mark.parametrize("name", ["gpt_train", "manual_ln", "sync_item"])
def test_gpu_profiles_whose_chains_other_rules_own(name: str) -> None:
    assert fuse_region.detect(gpu_fixture(name)) == []


# ---- the pieces ------------------------------------------------------------------------------------------------


def _op(i: int, name: str, shapes, dtypes=None) -> Op:
    return Op(
        i,
        f"aten::{name}",
        0,
        float(i),
        1.0,
        input_shapes=shapes,
        input_dtypes=dtypes or ["float"] * len(shapes),
    )


def test_chain_names() -> None:
    x = [8, 16]
    gelu = [
        _op(i, n, [x, []]) for i, n in enumerate(["mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"])
    ]
    assert chain_of(gelu) == "gelu_tanh"
    assert chain_of(gelu * 3) is None  # three tanh: a loop, not one GELU
    assert chain_of([_op(0, "sigmoid", [x]), _op(1, "mul", [x, x])]) == "silu"
    assert chain_of([_op(0, "mul", [x, []]), _op(1, "sigmoid", [x]), _op(2, "mul", [x, x])]) == "sigmoid_gate"
    assert (
        chain_of([_op(0, "bernoulli_", [x]), _op(1, "masked_fill", [x, x]), _op(2, "mul", [x, []])])
        == "dropout"
    )
    assert chain_of([_op(0, "add", [x, x]), _op(1, "mul", [x, x])]) is None


def test_bytes_moved_counts_each_input_once_and_the_output() -> None:
    x = [1024, 1024]
    ops = [_op(0, "mul", [x, []]), _op(1, "pow", [x, None]), _op(2, "add", [x, x]), _op(3, "tanh", [x])]
    assert bytes_moved(ops) == (4 * 2**20, 4 * 2**20)  # read x once, write y once (float32)
    bf16 = [_op(0, "add", [x, x], ["c10::BFloat16"] * 2), _op(1, "mul", [x, [1024]], ["c10::BFloat16"] * 2)]
    assert bytes_moved(bf16) == (2 * 2 * 2**20, 2 * 2**20)  # two inputs read; the [1024] bias is negligible


def test_merge_same_fix_joins_the_relative_position_terms() -> None:
    a = Site("f.py", "A.bias", 10, 12, 14, [[_op(0, "gather", [[1]])]], "relpos_gather")
    b = Site("f.py", "A.bias", 10, 16, 18, [[_op(1, "gather", [[1]])]], "relpos_gather")
    c = Site("f.py", "A.other", 20, 22, 23, [[_op(2, "mul", [[1]])]], None)
    merged = merge_same_fix([a, b, c])
    assert len(merged) == 2 and (merged[0].line, merged[0].end_line) == (12, 18)
    assert [o.id for o in merged[0].occurrences[0]] == [0, 1]
