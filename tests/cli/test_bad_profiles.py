"""Every unreadable or malformed profile.json: one line on stderr and exit 2 in suggest, apply and verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.model import Kernel, Op, Profile, Step, save_profile


def _valid(script: Path) -> dict:
    prof = Profile(
        run_id="r1",
        script=str(script),
        argv=[script.name],
        cwd=str(script.parent),
        steps=[Step(0, 0.0, 10.0, 0.01)],
        ops=[Op(0, "aten::add", 0, 1.0, 2.0, kernels=[Kernel("add_kernel", 1.0, 1.0)])],
    )
    path = script.parent / "valid.json"
    save_profile(prof, path)
    return json.loads(path.read_text())


def _without(data: dict, key: str) -> dict:
    return {k: v for k, v in data.items() if k != key}


def _with(data: dict, **changes) -> dict:
    return {**data, **changes}


def _op_with(data: dict, **changes) -> dict:
    return _with(data, ops=[{**data["ops"][0], **changes}])


# name -> (how the file is damaged, what the one line says)
DAMAGE = {
    "not UTF-8": (lambda d: b'{"schema": 1, "script": "\xff\xfe"}', "not UTF-8 text"),
    "truncated": (lambda d: json.dumps(d).encode()[:50], "corrupt or truncated"),
    "a list": (lambda d: b"[1, 2]", "does not hold a JSON object"),
    "nested too deep": (lambda d: b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    "no script": (lambda d: _without(d, "script"), "it has no 'script'"),
    "empty script": (lambda d: _with(d, script=""), "'script' is empty"),
    "script not a string": (lambda d: _with(d, script=7), "script is 7, not str"),
    "steps not a list": (lambda d: _with(d, steps=5), "steps is 5, not list"),
    "step not an object": (lambda d: _with(d, steps=["x"]), 'steps[0] is "x", not an object'),
    "op time a string": (lambda d: _op_with(d, duration_us="x"), 'ops[0].duration_us is "x"'),
    "op without a name": (lambda d: _with(d, ops=[_without(d["ops"][0], "name")]), "ops[0] has no 'name'"),
    "op shapes wrong": (lambda d: _op_with(d, input_shapes=[["a"]]), "ops[0].input_shapes"),
    "bad kernel index": (
        lambda d: _op_with(d, kernels=[{**d["ops"][0]["kernels"][0], "name": 9}]),
        "not an index into kernel_names",
    ),
    "environment a string": (lambda d: _with(d, environment="cpu"), "environment is"),
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hello')\n")
    run = tmp_path / ".opadvisor" / "runs" / "r1"
    run.mkdir(parents=True)
    (tmp_path / ".opadvisor" / "latest").write_text("r1\n")
    return tmp_path


def _write(project: Path, damage) -> None:
    data = damage(_valid(project / "train.py"))
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    (project / ".opadvisor" / "runs" / "r1" / "profile.json").write_bytes(raw)


def _assert_one_line(result, fragment: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opadvisor: error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", DAMAGE)
@pytest.mark.parametrize("command", [["suggest"], ["apply", "--rule", "all"], ["verify"]])
def test_damaged_profile_is_one_line_and_exit_2(project: Path, case: str, command: list[str]) -> None:
    damage, fragment = DAMAGE[case]
    _write(project, damage)
    _assert_one_line(CliRunner().invoke(app, command), fragment)


def test_the_undamaged_profile_loads(project: Path) -> None:
    _write(project, lambda d: d)
    result = CliRunner().invoke(app, ["suggest", "--format", "json"])
    assert result.exit_code == 0, result.output


def test_oddly_named_rank_files_are_not_ranks(project: Path) -> None:
    run = project / ".opadvisor" / "runs" / "r1"
    (run / "profile.rankX.json").write_text("{}")
    _assert_one_line(CliRunner().invoke(app, ["suggest"]), "has no profile.json")


def test_every_model_field_has_a_json_check() -> None:
    # a field of a type `_json_check` does not know would fail every load: caught here, not by users
    import dataclasses

    from opadvisor.profile import model

    for cls in vars(model).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == model.__name__:
            model._checks(cls)
