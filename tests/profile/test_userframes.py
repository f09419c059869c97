"""Which files count as the user's code: opadvisor's own files never do, wherever they are installed; the
user's folder does whatever its name, and a name the profiler shortened is found where the script looked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import opadvisor
from opadvisor.profile.userframes import fused_op_module, note_search_path, resolve_user_file, set_search_path


def test_the_fused_ops_files_are_not_user_code():
    # In a source checkout installed with `pip install -e`, opadvisor.kernels is the top-level kernels/
    # folder, outside opadvisor/: its reference paths (the eager chain on a CPU) must not be read as the
    # user's code, or a profile of a rewritten script finds the pattern inside the fused op itself.
    spec = importlib.util.find_spec("opadvisor.kernels")
    assert spec is not None and spec.submodule_search_locations
    kernels_dir = Path(next(iter(spec.submodule_search_locations)))
    kernel_file = kernels_dir / "dropout_add.py"
    assert kernel_file.is_file()
    assert resolve_user_file(str(kernel_file)) is None
    assert resolve_user_file(opadvisor.__file__) is None


def test_a_script_outside_the_package_is_user_code(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("x = 1\n", encoding="utf-8")
    assert resolve_user_file(str(script)) == str(script.resolve())


def test_the_fused_ops_files_are_named_and_the_wrappers_are_not(tmp_path: Path):
    # ops issued in a fused op's own file are that op's work; the wrappers (a patched module's forward, a
    # graphed model, a compiled region) call back into the model, whose ops stay the model's
    spec = importlib.util.find_spec("opadvisor.kernels")
    kernels_dir = Path(next(iter(spec.submodule_search_locations)))
    assert fused_op_module(str(kernels_dir / "dropout_add.py")) == "dropout_add"
    assert fused_op_module(str(kernels_dir / "softmax.py")) == "softmax"
    for wrapper in ("patch.py", "graphs.py", "region.py", "__init__.py"):
        assert fused_op_module(str(kernels_dir / wrapper)) is None
    script = tmp_path / "dropout_add.py"  # a user's file of the same name is not opadvisor's
    script.write_text("x = 1\n", encoding="utf-8")
    assert fused_op_module(str(script)) is None
    assert fused_op_module(opadvisor.__file__) is None


@pytest.fixture
def search_path():
    """set_search_path as a test leaves it: the test process's own sys.path again afterwards."""
    yield set_search_path
    set_search_path(sys.path)


def test_a_project_cloned_into_a_folder_named_site_packages_is_user_code(tmp_path: Path, search_path):
    # a folder of that name above the user's folder says nothing; one below it (a venv inside) does
    project = tmp_path / "site-packages" / "my dist-packages clone"
    (project / "venv" / "lib" / "site-packages" / "lib").mkdir(parents=True)
    script, installed = project / "train.py", project / "venv" / "lib" / "site-packages" / "lib" / "m.py"
    script.write_text("x = 1\n", encoding="utf-8")
    installed.write_text("x = 1\n", encoding="utf-8")
    search_path([], [str(project)])
    assert resolve_user_file(str(script)) == str(script.resolve())
    assert resolve_user_file(str(installed)) is None


def test_a_name_shortened_by_a_folder_the_script_put_on_sys_path(tmp_path: Path, search_path, monkeypatch):
    # torch shortens file names by sys.path as it is when the profiler stops, inside the script
    model = tmp_path / "src" / "mymodel" / "model.py"
    model.parent.mkdir(parents=True)
    model.write_text("x = 1\n", encoding="utf-8")
    search_path([], [str(tmp_path)])
    assert resolve_user_file("mymodel/model.py") is None
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    note_search_path()
    assert resolve_user_file("mymodel/model.py") == str(model.resolve())
