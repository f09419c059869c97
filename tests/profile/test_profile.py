"""`opadvisor profile` on real scripts: what it records, and every bad input it must refuse cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

import opadvisor
from opadvisor import kernels
from opadvisor.cli import app
from opadvisor.profile.model import load_profile
from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA

ROOT = Path(__file__).resolve().parents[2]
# opadvisor's own code (the kernels live apart in a checkout), wherever the checkout is
OPADVISOR_DIRS = [str(Path(m.__file__).resolve().parent) for m in (opadvisor, kernels)]
SCRIPTS = Path(__file__).parent / "scripts"
runner = CliRunner()


def profile_cli(tmp_path: Path, *args: str):
    """Run `opadvisor profile ...` in-process from tmp_path; return the CliRunner result."""
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        return runner.invoke(app, ["profile", *args])
    finally:
        os.chdir(old)


def only_run(tmp_path: Path) -> Path:
    runs = [p for p in (tmp_path / ".opadvisor" / "runs").iterdir()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def bert_run(script_run) -> Path:
    """The BERT-like example profiled for 2 steps on CPU, as a user would run it (a subprocess; once per
    test run: tests/conftest.py's script_run, which the rule tests read too)."""
    return script_run(ROOT / "examples" / "bert_train.py")


def test_kinetos_usdt_lines_are_filtered_out(bert_run: Path) -> None:
    # torch 2.13's Kineto prints `USDT: ... profiler_start` / `profiler_stop` on stderr: filtered out
    printed = bert_run.with_name("run.stderr.txt").read_text()
    assert "profiler_start" not in printed and "profiler_stop" not in printed, printed


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text)


def test_example_profile_names_exact_lines_and_shapes(bert_run: Path) -> None:
    prof = load_profile(bert_run / "profile.json")
    example = str((ROOT / "examples" / "bert_train.py").resolve())
    fill_line = _line_of(ROOT / "examples" / "bert_train.py", "scores = scores.masked_fill(~mask")
    softmax_line = _line_of(ROOT / "examples" / "bert_train.py", "probs = F.softmax(scores")
    fills = [
        o for o in prof.ops if o.name == "aten::masked_fill" and o.file == example and o.line == fill_line
    ]
    softmaxes = [
        o for o in prof.ops if o.name == "aten::softmax" and o.file == example and o.line == softmax_line
    ]
    assert fills and softmaxes
    assert all(o.line_exact for o in fills + softmaxes)
    scores_shape = fills[0].input_shapes[0]
    assert len(scores_shape) == 4 and scores_shape[-1] == scores_shape[-2]  # [B, H, S, S]
    assert softmaxes[0].input_shapes[0] == scores_shape
    assert fills[0].module and fills[0].module.endswith("attention")
    # the backward of the softmax is attributed to the same line
    assert any(o.is_backward and o.line == softmax_line and "Softmax" in o.name for o in prof.ops)
    assert len(prof.steps) == 2 and prof.complete and prof.step_detection == "optimizer_hook"
    assert prof.sources[example]
    kinds = {c.kind for c in prof.constructions}
    assert kinds == {"module", "optimizer", "dataloader", "model"}
    (model,) = [c for c in prof.constructions if c.kind == "model"]  # the user's own model: its own line
    build_line = _line_of(ROOT / "examples" / "bert_train.py", "model = BertForMaskedLM(")
    assert (model.file, model.line, model.attrs["how"]) == (example, build_line, "constructor")
    assert model.cls.endswith(".BertForMaskedLM") and model.attrs["package"] is None
    assert not any(o.lib_file for o in prof.ops) and prof.libraries == {}  # all user code
    head = [c for c in prof.constructions if c.module == "lm_head"]
    assert head and head[0].attrs["out_features"] == 30522
    assert (bert_run / "trace.json.gz").stat().st_size > 0


def test_trace_is_a_chrome_trace(bert_run: Path) -> None:
    import gzip

    with gzip.open(bert_run / "trace.json.gz", "rt") as fh:
        trace = json.load(fh)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])


def test_explicit_steps(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "explicit_steps.py"), "--steps", "2", "--warmup", "1")
    assert result.exit_code == 0, result.output
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert prof.step_detection == "explicit" and len(prof.steps) == 2
    # the loop stopped at the end of its third step (warm-up 1 + 2 recorded), inside opadvisor.step(),
    # before that step's print: not after 20
    assert "step 1 loss" in result.output and "step 2 loss" not in result.output


def test_second_optimizer_does_not_split_steps(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "two_optimizers.py"), "--steps", "2", "--warmup", "1")
    assert result.exit_code == 0, result.output
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert len(prof.steps) == 2
    for step in prof.steps:  # each recorded step holds a forward of both models
        linears = [o for o in prof.ops if o.step == step.index and o.name == "aten::linear"]
        assert len(linears) == 2


def test_time_window_when_no_step(tmp_path: Path) -> None:
    result = profile_cli(
        tmp_path, str(SCRIPTS / "inference_loop.py"), "--window-after", "0.5", "--window", "0.5"
    )
    assert result.exit_code == 0, result.output
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert prof.step_detection == "time_window" and len(prof.steps) == 1
    assert any(o.name == "aten::linear" for o in prof.ops)


def test_run_to_end(tmp_path: Path) -> None:
    result = profile_cli(
        tmp_path, str(SCRIPTS / "explicit_steps.py"), "--steps", "2", "--warmup", "1", "--run-to-end"
    )
    assert result.exit_code == 0, result.output
    assert "step 19 loss" in result.output


def test_script_ends_before_window_keeps_recorded_steps(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "short.py"), "--steps", "5", "--warmup", "1")
    assert_user_error(result, "before the window was complete: recorded 2 of 5", "marked incomplete")
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert len(prof.steps) == 2 and not prof.complete
    # suggest says so in each of its formats
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        table, doc, sarif = (
            runner.invoke(app, ["suggest", "--format", f]) for f in ("table", "json", "sarif")
        )
    finally:
        os.chdir(old)
    assert "Incomplete run: the script ended after 3 step(s), before the window was complete (2 of 5" in (
        table.stdout
    )
    jsonschema.validate(json.loads(doc.stdout), SUGGEST_SCHEMA)
    recording = json.loads(doc.stdout)["recording"]
    assert recording == {
        "complete": False,
        "steps_recorded": 2,
        "steps_requested": 5,
        "stopped": "ended_early",
        "steps_seen": 3,
        "warmup_steps": 1,
    }
    (notice, *_) = json.loads(sarif.stdout)["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert notice["level"] == "warning" and notice["message"]["text"].startswith("incomplete run")


# ---- bad input: one line on stderr, exit 2, nothing half-written ------------------------------------


def assert_user_error(result, *fragments: str, script_traceback: bool = False) -> None:
    assert result.exit_code == 2, result.output
    # only the user's own script's traceback may be shown, never one of opadvisor's
    assert ("Traceback" in result.output) == script_traceback, result.output
    # no frame of opadvisor's own code (a test of "opadvisor/" would fail in a clone named opadvisor)
    shown = result.output.split("opadvisor: error:")[0]
    assert not any(d in shown for d in OPADVISOR_DIRS), shown
    error_lines = [ln for ln in result.output.splitlines() if ln.startswith("opadvisor: error:")]
    assert len(error_lines) == 1, result.output
    for fragment in fragments:
        assert fragment in error_lines[0], error_lines[0]


def test_missing_script(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, "nope.py")
    assert_user_error(result, "nope.py: no such file")
    assert not (tmp_path / ".opadvisor").exists()


def test_not_python(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert_user_error(profile_cli(tmp_path, "notes.txt"), "not a Python script")
    (tmp_path / "binary.py").write_bytes(b"\x00\xff\xfe")
    assert_user_error(profile_cli(tmp_path, "binary.py"), "not a Python script")


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\n\ndef f(:\n    pass\n")
    result = profile_cli(tmp_path, "broken.py")
    assert_user_error(result, "broken.py:3: syntax error")
    assert "Traceback" not in result.output


def test_script_raising_keeps_recorded_steps_and_shows_its_traceback(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "raises.py"), "--steps", "5", "--warmup", "1")
    assert_user_error(
        result, "raised an exception after 4 step(s)", "3 recorded step(s) were kept", script_traceback=True
    )
    assert "ValueError: the user's own bug at step 3" in result.output
    assert "broken_step" in result.output  # the user's frames ...
    assert "runpy" not in result.output  # ... not ours
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert len(prof.steps) == 3 and not prof.complete


def suggest_formats(cwd: Path) -> tuple[str, dict, dict]:
    """`opadvisor suggest` of the latest run in cwd: (table, JSON, SARIF), each exiting 0."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        results = [runner.invoke(app, ["suggest", "--format", f]) for f in ("table", "json", "sarif")]
    finally:
        os.chdir(old)
    for result in results:
        assert result.exit_code == 0, result.output
    doc = json.loads(results[1].stdout)
    jsonschema.validate(doc, SUGGEST_SCHEMA)
    return " ".join(results[0].stdout.split()), doc, json.loads(results[2].stdout)  # rich folds lines


def test_failure_in_warmup_keeps_a_partial_run_that_suggest_reads(tmp_path: Path) -> None:
    # issue 30: raised in its third step, inside the default 3-step warm-up: nothing profiled, yet the run
    # is kept (incomplete, no steps) and the error says what --warmup records the steps it did run
    result = profile_cli(tmp_path, str(SCRIPTS / "warmup_raises.py"))
    assert_user_error(
        result,
        "raised an exception after 2 step(s), in the warm-up (--warmup 3): no step was recorded",
        "profile again with --warmup 1 to record 1 step(s)",
        script_traceback=True,
    )
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert not prof.complete and prof.steps == [] and prof.stopped == "script_error"
    assert prof.steps_seen == 2 and prof.calibration is not None  # the timed warm-up step is kept
    assert any(c.kind == "optimizer" for c in prof.constructions)
    table, doc, sarif = suggest_formats(tmp_path)
    assert "Incomplete run: the script raised an exception after 2 step(s), in the warm-up" in table
    assert "profile again with --warmup 1" in table
    assert doc["recording"]["steps_recorded"] == 0 and doc["recording"]["stopped"] == "script_error"
    assert doc["findings"] == []
    (notice, *_) = sarif["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert "in the warm-up" in notice["message"]["text"]
    # with the --warmup it names, the same script records a step
    (tmp_path / "again").mkdir()
    rerun = profile_cli(tmp_path / "again", str(SCRIPTS / "warmup_raises.py"), "--warmup", "1")
    assert "recorded 1 of 5" in rerun.output


def test_keyboard_interrupt_raised_by_the_script_keeps_recorded_steps(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "interrupted.py"), "--warmup", "1")
    assert_user_error(
        result, "was interrupted (Ctrl-C) after 3 step(s)", "recorded 2 of 5", "marked incomplete"
    )
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert len(prof.steps) == 2 and not prof.complete and prof.stopped == "interrupted"
    table, doc, _ = suggest_formats(tmp_path)
    assert "the script was interrupted (Ctrl-C) after 3 step(s)" in table
    assert doc["recording"]["steps_recorded"] == 2 and doc["breakdown"]["parts"]


def test_sigint_keeps_recorded_steps(tmp_path: Path) -> None:
    # a real SIGINT to the profiling process (what Ctrl-C in a terminal sends)
    cmd = [sys.executable, "-m", "opadvisor", "profile", str(SCRIPTS / "interrupted.py"), "--warmup", "1"]
    proc = subprocess.run([*cmd, "--", "signal"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "was interrupted (Ctrl-C) after 3 step(s)" in proc.stderr and "Traceback" not in proc.stderr
    prof = load_profile(only_run(tmp_path) / "profile.json")
    assert len(prof.steps) == 2 and prof.stopped == "interrupted"
    table, _, _ = suggest_formats(tmp_path)
    assert "2 of 5 steps recorded" in table


def test_script_calling_sys_exit(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "exits.py"), "--steps", "5", "--warmup", "1")
    assert_user_error(result, "called sys.exit(3) after 2 step(s)")


def test_no_steps_detected(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "no_steps.py"))
    assert_user_error(result, "no steps detected")
    assert not (tmp_path / ".opadvisor" / "runs").exists() or not any(
        (tmp_path / ".opadvisor" / "runs").iterdir()
    )


def test_output_folder_not_writable(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits: make the parent a file instead
        (tmp_path / "blocker").write_text("")
        out = tmp_path / "blocker" / "run"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out = locked / "run"
    result = profile_cli(tmp_path, str(SCRIPTS / "short.py"), "--out", str(out))
    assert_user_error(result, "cannot write the run")


def test_out_folder_must_be_new_or_empty(tmp_path: Path) -> None:
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = profile_cli(tmp_path, str(SCRIPTS / "short.py"), "--out", str(out))
    assert_user_error(result, "is not an empty folder")
    assert (out / "keep.txt").read_text() == "mine"


def test_steps_zero_is_refused(tmp_path: Path) -> None:
    result = profile_cli(tmp_path, str(SCRIPTS / "short.py"), "--steps", "0")
    assert result.exit_code == 2
    assert "--steps" in result.output


def test_help_does_not_import_torch() -> None:
    code = "import sys; from opadvisor.cli import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    proc = subprocess.run(
        [sys.executable, "-m", "opadvisor", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "profile" in proc.stdout
