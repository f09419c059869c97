"""`opadvisor profile -m package.module`, and a script inside a package, run as `python -m` runs them.

The fixture is tests/profile/packages/trainpkg: `train.py` imports `.model` relatively and prints how it
was run (its package, sys.path[0], argv[0]); `__main__.py` runs it for `-m trainpkg`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opadvisor.cli import app
from opadvisor.profile.model import load_profile

PACKAGES = Path(__file__).parent / "packages"
TRAIN = PACKAGES / "trainpkg" / "train.py"
WINDOW = ["--steps", "2", "--warmup", "1"]


@pytest.fixture(autouse=True)
def fresh_package():
    """Each test imports trainpkg anew (runpy keeps the package in sys.modules, as Python does)."""
    yield
    for name in [m for m in sys.modules if m == "trainpkg" or m.startswith("trainpkg.")]:
        del sys.modules[name]


def profile_in(cwd: Path, *args: str):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(app, ["profile", *args])
    finally:
        os.chdir(old)


def test_profile_m_runs_the_module_as_python_m_does(tmp_path: Path) -> None:
    result = profile_in(
        PACKAGES, "-m", "trainpkg.train", *WINDOW, "--out", str(tmp_path / "run"), "--", "--steps", "6"
    )
    assert result.exit_code == 0, result.output
    # the package context, the folder -m was given in first on sys.path, argv[0] the module's file
    assert (
        f"package=trainpkg spec=trainpkg.train path0={PACKAGES.resolve()} argv0={TRAIN.resolve()}"
        in result.output
    )
    prof = load_profile(tmp_path / "run" / "profile.json")
    assert (prof.script, prof.module, prof.import_root) == (
        str(TRAIN.resolve()),
        "trainpkg.train",
        str(PACKAGES.resolve()),
    )
    assert prof.argv == [str(TRAIN.resolve()), "--steps", "6"] and len(prof.steps) == 2
    # ops are placed on the package's own lines: the model's forward in model.py
    model_py = str((PACKAGES / "trainpkg" / "model.py").resolve())
    assert any(o.name == "aten::linear" and o.file == model_py for o in prof.ops)


def test_profile_m_package_runs_its_main(tmp_path: Path) -> None:
    result = profile_in(PACKAGES, "-m", "trainpkg", *WINDOW, "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert load_profile(tmp_path / "run" / "profile.json").module == "trainpkg.__main__"


def test_script_inside_a_package_runs_as_its_module(tmp_path: Path) -> None:
    # `python trainpkg/train.py` fails on its relative import; opadvisor runs it as `python -m` would
    result = profile_in(tmp_path, str(TRAIN), *WINDOW, "--out", str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "running it as `python -m trainpkg.train`" in result.stderr
    assert f"package=trainpkg spec=trainpkg.train path0={PACKAGES.resolve()}" in result.output
    assert load_profile(tmp_path / "run" / "profile.json").module == "trainpkg.train"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "trainpkg.nope"], "no module named 'trainpkg.nope'"),
        (["-m", "nosuchpkg.train"], "no module named 'nosuchpkg'"),
        (["-m", "trainpkg/train.py"], "-m takes a module name"),
        (["-m", "2bad"], "is not a module name"),
        ([], "name the script to profile"),
    ],
)
def test_bad_module_is_one_line(args: list[str], message: str) -> None:
    result = profile_in(PACKAGES, *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr, (
        result.stderr
    )


@pytest.mark.parametrize("args", [["missing.py"], ["-m", "nosuchpkg"], ["-m", "nosuchpkg.train"]])
def test_missing_target_is_reported_before_torch_is_imported(tmp_path: Path, args: list[str]) -> None:
    code = (
        "import sys\n"
        "from opadvisor.cli import main\n"
        f"sys.argv = ['opadvisor', 'profile', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code == 2, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("opadvisor: error: ")
