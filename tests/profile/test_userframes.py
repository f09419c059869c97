"""Which files count as the user's code: opadvisor's own files never do, wherever they are installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import opadvisor
from opadvisor.profile.userframes import fused_op_module, resolve_user_file


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
