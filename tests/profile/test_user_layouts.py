"""Findings land in the user's model file however the script found it (issue 29 item 2).

The fixture project is tests/profile/layouts/src_on_path: `src/mymodel/model.py` holds a hand-written
masked softmax attention (lines 29-33, the softmax chain 30-32) and a tanh GELU written out (line 11);
the scripts reach it in the ways public training code does: `train.py` puts `src/` on sys.path at run time,
`tools/train.py` does the same run as `-m tools.train`, `launch.py` runs train.py through runpy,
`train_chdir.py` changes into `src/` and imports from '' on sys.path, and `scripts/train_by_path.py` loads
the model file by its relative path with importlib, then changes folder. Each is profiled on the CPU through
the CLI, as a user runs it; the findings must name model.py at the pattern's lines, never the script's
`model(ids, mask)` line. A model inside a site-packages folder stays library code.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_testlib import opadvisor

LAYOUT = Path(__file__).parent / "layouts" / "src_on_path"
MODEL = "src/mymodel/model.py"
WINDOW = ["--steps", "2", "--warmup", "1"]
# rule -> the first line of the pattern in src/mymodel/model.py
EXPECTED = {"sdpa_attention": 29, "fused_softmax": 30, "fuse_region": 11}

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    shutil.copytree(LAYOUT, root)
    return root


def profile(cwd: Path, *target: str) -> dict:
    """Profile `target` from `cwd`; the latest run's profile.json."""
    done = opadvisor(cwd, "profile", *target, *WINDOW)
    assert done.returncode == 0, done.stderr[-3000:]
    run = cwd / ".opadvisor" / "runs" / (cwd / ".opadvisor" / "latest").read_text().strip()
    return json.loads((run / "profile.json").read_text())


def findings(cwd: Path) -> dict[str, dict]:
    done = opadvisor(cwd, "suggest", "--format", "json")
    assert done.returncode == 0, done.stderr[-3000:]
    return {f["rule"]: f for f in json.loads(done.stdout)["findings"]}


def assert_found_in_the_model(cwd: Path) -> None:
    found = findings(cwd)
    assert {rule: (f["path"], f["line"]) for rule, f in found.items() if rule in EXPECTED} == {
        rule: (MODEL, line) for rule, line in EXPECTED.items()
    }, found
    assert all(f.get("library") is None for f in found.values())


def losses(cwd: Path) -> list[float]:
    done = subprocess.run(
        [sys.executable, "train.py", "--steps", "3", "--dropout", "0"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    values = [float(v) for v in re.findall(r"loss ([-\d.eE+]+)", done.stdout)]
    assert len(values) == 3, done.stdout
    return values


def test_src_put_on_sys_path_by_the_script_is_found_and_rewritten(project: Path) -> None:
    prof = profile(project, "train.py")
    model_py = str((project / MODEL).resolve())
    assert model_py in prof["sources"]
    assert any(op["file"] == model_py and op["name"] == "aten::_softmax" for op in prof["ops"])
    assert_found_in_the_model(project)
    before, original = losses(project), (project / MODEL).read_text()
    done = opadvisor(project, "apply", "--rule", "all")
    assert done.returncode == 0, done.stderr
    rewritten = (project / MODEL).read_text()
    assert rewritten != original and "scaled_dot_product_attention" in rewritten and "F.gelu(" in rewritten
    assert losses(project) == pytest.approx(before, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("target", [["-m", "tools.train"], ["launch.py"]], ids=["module", "runpy-launcher"])
def test_src_put_on_sys_path_under_a_module_or_a_launcher(project: Path, target: list[str]) -> None:
    profile(project, *target)
    assert_found_in_the_model(project)


def test_a_script_that_changes_folder(project: Path) -> None:
    prof = profile(project, "train_chdir.py")
    assert_found_in_the_model(project)
    # the run is the folder it was started from (verify reruns the script there), not the script's new one
    assert prof["cwd"] == str(project.resolve())


def test_a_model_loaded_by_its_path_from_a_sibling_folder(project: Path) -> None:
    prof = profile(project, "scripts/train_by_path.py")
    assert_found_in_the_model(project)
    assert prof["cwd"] == str(project.resolve())


def test_a_model_in_a_site_packages_folder_stays_library_code(project: Path) -> None:
    # the same model, installed: the script puts a site-packages folder on sys.path at run time
    site = project / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text("")
    shutil.copy(project / MODEL, site / "fakelib" / "model.py")
    train = (project / "train.py").read_text()
    train = train.replace('"src"', '"venv", "lib", "python3.11", "site-packages"')
    (project / "train.py").write_text(train.replace("from mymodel.model", "from fakelib.model"))
    prof = profile(project, "train.py")
    installed = str((site / "fakelib" / "model.py").resolve())
    assert installed not in prof["sources"] and all(op["file"] != installed for op in prof["ops"])
    found = findings(project)
    assert found and all(f["library"]["package"] == "fakelib" for f in found.values()), found
    assert found["fused_softmax"]["library"]["file"] == "fakelib/model.py"
    before = (site / "fakelib" / "model.py").read_bytes()
    opadvisor(project, "apply", "--rule", "all")
    assert (site / "fakelib" / "model.py").read_bytes() == before
