"""activation_checkpointing, rnn_cell_loop and cudnn_rnn: on real profiled scripts (CPU here, GPU where
marked) and on hand-built profiles for what only a GPU profile can show."""

from __future__ import annotations

from pathlib import Path

import pytest
from rules_testlib import REPO, SCRIPTS, expected_lines

from opadvisor.profile.model import Environment, Kernel, ModuleCall, Op, Profile, Step, load_profile
from opadvisor.rules.engine import analyse

BLOCKS = REPO / "tests" / "profile" / "scripts" / "blocks_train.py"
GIB = 1 << 30


def _line(path: Path, needle: str) -> int:
    (line,) = [i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text]
    return line


@pytest.fixture(scope="module")
def blocks(rules_profile) -> Profile:
    return load_profile(rules_profile("blocks_train", BLOCKS) / "profile.json")


@pytest.fixture(scope="module")
def cells(rules_profile) -> Profile:
    return load_profile(rules_profile("lstm_cell_loop") / "profile.json")


# ---- activation_checkpointing ---------------------------------------------------------------------------


def test_memory_rule_waits_to_be_asked_on_a_cpu_profile(blocks: Profile):
    report = analyse([blocks], select=["activation_checkpointing"])
    assert report.findings == []
    (note,) = report.notes
    assert "--memory" in note.message


def test_memory_rule_names_the_blocks_and_their_call_when_asked(blocks: Profile):
    (f,) = analyse(
        [blocks], select=["activation_checkpointing"], requested=["activation_checkpointing"]
    ).findings
    call = _line(BLOCKS, "x = block(x)")
    assert (f.path, f.line, f.end_line, f.fix) == (str(BLOCKS), call, call, "safe")
    assert f.details["modules"] == [f"blocks.{i}" for i in range(4)]
    x = 4 * 8 * 32 * 4  # one [batch, seq, d] float32 activation
    per_block = 10 * x + 2 * 4 * 8 * 4
    assert f.details["activation_bytes"] == 4 * per_block
    assert f.details["est_memory_saving_bytes"] == 4 * per_block - 4 * x - per_block
    assert f.time_ms_per_step and f.est_saving_ms_per_step == -f.time_ms_per_step
    assert "4 x Block (blocks.0-3)" in f.message and "Checkpointing them frees" in f.message


def test_profile_memory_flag_is_an_ask(blocks: Profile):
    blocks.memory_requested = True
    try:
        assert len(analyse([blocks], select=["activation_checkpointing"]).findings) == 1
    finally:
        blocks.memory_requested = False


def _gpu_memory_profile(blocks: Profile, reserved_share: float) -> Profile:
    """The blocks profile as if it ran on an 80 GiB GPU whose reserved peak was `reserved_share` of it."""
    import copy

    prof = copy.deepcopy(blocks)
    prof.environment = Environment(
        device="cuda", gpu_name="GPU", capability=[9, 0], gpu_memory_bytes=80 * GIB
    )
    for step in prof.steps:
        step.peak_reserved_bytes = int(reserved_share * 80 * GIB)
        step.peak_allocated_bytes = step.peak_reserved_bytes - GIB
    return prof


def test_memory_rule_reports_unasked_when_the_peak_is_high(blocks: Profile):
    (f,) = analyse([_gpu_memory_profile(blocks, 0.9)], select=["activation_checkpointing"]).findings
    assert "the step peaks at 72.0 GiB of 80.0 GiB (90%)" in f.message
    assert f.details["peak_reserved_bytes"] == int(0.9 * 80 * GIB)
    assert analyse([_gpu_memory_profile(blocks, 0.5)], select=["activation_checkpointing"]).findings == []


def test_memory_rule_in_library_code_offers_the_library_switch():
    calls = [
        ModuleCall("", "transformers.models.bert.modeling_bert.BertForMaskedLM", 2, "/p/train.py", 30),
        *(
            ModuleCall(
                f"bert.encoder.layer.{i}",
                "transformers.models.bert.modeling_bert.BertLayer",
                2,
                "/p/train.py",
                30,
                input_bytes=100,
                saved_bytes=1000.0,
                attrs={"caller": "/site-packages/transformers/models/bert/modeling_bert.py:640"},
            )
            for i in range(3)
        ),
    ]
    prof = Profile(
        steps=[Step(0, 0, 1, 1, saved_bytes=3500), Step(1, 1, 2, 1, saved_bytes=3500)], module_calls=calls
    )
    (f,) = analyse(
        [prof], select=["activation_checkpointing"], requested=["activation_checkpointing"]
    ).findings
    assert f.fix == "none" and "gradient_checkpointing_enable" in f.advice


def test_memory_rule_marks_batchnorm_blocks_unsafe(blocks: Profile):
    import copy

    prof = copy.deepcopy(blocks)
    prof.module_calls.append(ModuleCall("blocks.1.bn", "torch.nn.BatchNorm1d", 2, saved_bytes=0.0))
    (f,) = analyse(
        [prof], select=["activation_checkpointing"], requested=["activation_checkpointing"]
    ).findings
    assert f.fix == "unsafe" and f.details["batchnorm"] == ["torch.nn.BatchNorm1d"]


# ---- rnn_cell_loop -------------------------------------------------------------------------------------


def test_cell_loops_are_found_on_a_cpu_profile(cells: Profile):
    found = {f.details["kind"]: f for f in analyse([cells], select=["rnn_cell_loop"]).findings}
    assert set(found) == {"LSTMCell", "GRUCell"}  # the tagger's loop and the decoder's
    f = found["LSTMCell"]
    start, end = expected_lines(SCRIPTS / "lstm_cell_loop.py", "rnn_cell_loop")
    assert (f.line, f.end_line, f.fix) == (start, end, "safe")
    assert f.details["kind"] == "LSTMCell" and f.details["calls_per_step"] == 12
    assert f.details["input_shape"] == [3, 16] and f.details["hidden_size"] == 24
    assert f.evidence.time_basis == "cpu" and f.time_ms_per_step > 0
    assert "stepped 12x per step in a Python loop" in f.message


def test_the_decoder_cell_loop_is_found_too(cells: Profile):
    loops = [c for c in cells.module_calls if c.attrs.get("kind") == "GRUCell"]
    assert loops and loops[0].calls == 6 * 2
    (f,) = [f for f in analyse([cells], select=["rnn_cell_loop"]).findings if f.details["kind"] == "GRUCell"]
    assert f.details["calls_per_step"] == 6 and f.details["input_shape"] == [3, 5]
    start, end = expected_lines(SCRIPTS / "lstm_cell_loop.py", "gru_feedback")
    assert (f.line, f.end_line) == (start, end)


def test_no_cell_loop_in_a_transformer(blocks: Profile):
    assert analyse([blocks], select=["rnn_cell_loop"]).findings == []


# ---- cudnn_rnn -----------------------------------------------------------------------------------------


def _lstm_profile(*, cudnn: bool, flat: bool, dtype: str = "float32", autocast: str | None = None) -> Profile:
    """A CUDA profile of one nn.LSTM call per step, as the profiler records it."""
    ops = [Op(0, "aten::lstm", 0, 0.0, 100.0, module="lstm", module_class="LSTM", file="/p/m.py", line=7)]
    if cudnn:
        ops.append(
            Op(1, "aten::_cudnn_rnn", 0, 1.0, 90.0, parent=0, depth=1, kernels=[Kernel("rnn", 1, 50.0)])
        )
        if not flat:
            ops.append(Op(2, "aten::copy_", 0, 2.0, 5.0, parent=1, depth=2, kernels=[Kernel("copy", 2, 8.0)]))
    else:
        ops.append(
            Op(
                1,
                "aten::_thnn_fused_lstm_cell",
                0,
                1.0,
                90.0,
                parent=0,
                depth=1,
                kernels=[Kernel("c", 1, 70.0)],
            )
        )
    for op in reversed(ops):
        op.gpu_time_us = sum(k.duration_us for k in op.kernels) + sum(
            o.gpu_time_us or 0.0 for o in ops if o.parent == op.id
        )
    attrs = {
        "kind": "LSTM",
        "device": "cuda",
        "calls_not_flat": 0 if flat else 1,
        "weight_dtype": dtype,
        "autocast": autocast,
        "cudnn_enabled": cudnn,
        "cudnn_tf32": True,
    }
    return Profile(
        environment=Environment(device="cuda", gpu_name="GPU", capability=[9, 0]),
        steps=[Step(0, 0.0, 1000.0, 1.0, gpu_busy_ms=0.5, gpu_span_ms=1.0)],
        ops=ops,
        module_calls=[ModuleCall("lstm", "torch.nn.LSTM", 1, "/p/m.py", 7, attrs=attrs)],
    )


def test_cudnn_rnn_not_flat_gets_flatten_parameters():
    (f,) = analyse(
        [_lstm_profile(cudnn=True, flat=False, autocast="bfloat16")], select=["cudnn_rnn"]
    ).findings
    assert f.details["problems"] == ["not_flat"] and f.fix == "safe"
    assert f.est_saving_ms_per_step == pytest.approx(0.008)
    assert "self.lstm.flatten_parameters()" in f.advice


def test_cudnn_rnn_float32_is_advice_only():
    (f,) = analyse([_lstm_profile(cudnn=True, flat=True)], select=["cudnn_rnn"]).findings
    assert f.details["problems"] == ["float32"] and f.fix == "none"
    assert "torch.autocast" in f.advice and "bfloat16" in f.advice


def test_cudnn_rnn_off_cudnn():
    (f,) = analyse([_lstm_profile(cudnn=False, flat=True, dtype="bfloat16")], select=["cudnn_rnn"]).findings
    assert f.details["problems"] == ["no_cudnn"] and "torch.backends.cudnn.enabled is False" in f.message


def test_cudnn_rnn_clean_layer_and_cpu_profiles():
    assert (
        analyse([_lstm_profile(cudnn=True, flat=True, autocast="bfloat16")], select=["cudnn_rnn"]).findings
        == []
    )
    (note,) = analyse([Profile()], select=["cudnn_rnn"]).notes
    assert "needs a CUDA profile" in note.message


@pytest.mark.gpu
def test_cudnn_rnn_on_a_gpu_profile(rules_profile):
    prof = load_profile(rules_profile("lstm_layers") / "profile.json")
    found = {f.module: f for f in analyse([prof], select=["cudnn_rnn"]).findings}
    script = SCRIPTS / "lstm_layers.py"
    assert found["lstm"].details["problems"][0] == "not_flat"
    assert found["lstm"].line == expected_lines(script, "not_flat")[0] and found["lstm"].fix == "safe"
    assert found["gru"].details["problems"] == ["float32"]
    assert found["gru"].line == expected_lines(script, "float32")[0]


@pytest.mark.gpu
def test_cell_loop_on_a_gpu_profile(cells: Profile):
    (f,) = [f for f in analyse([cells], select=["rnn_cell_loop"]).findings if f.details["kind"] == "LSTMCell"]
    assert f.evidence.time_basis == "gpu" and f.evidence.kernel_count and f.evidence.kernel_count >= 12
