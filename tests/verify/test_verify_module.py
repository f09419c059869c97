"""`opadvisor verify` of a run profiled as a module (`profile -m pkg.train`): both programs run as
`python -m` ran them, so the package's relative imports resolve and its rewritten files are compared."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner
from verify_helpers import fake_apply, make_project

from opadvisor.cli import app

PACKAGE = Path(__file__).parents[1] / "profile" / "packages" / "trainpkg"


def module_project(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of trainpkg and a run that profiled `-m trainpkg.train -- --steps 50` from the project."""
    files = {f"trainpkg/{p.name}": p.read_text() for p in PACKAGE.glob("*.py")}
    return make_project(tmp_path, files, "trainpkg/train.py", ["--steps", "50"], module="trainpkg.train")


def verify(project: Path, monkeypatch) -> tuple[int, dict]:
    monkeypatch.chdir(project)
    res = CliRunner().invoke(
        app, ["verify", "--steps", "3", "--no-timing", "--no-reprofile", "--format", "json"]
    )
    return res.exit_code, json.loads(res.stdout) if res.stdout.strip().startswith("{") else res.output


def test_module_run_same_function_passes(tmp_path: Path, monkeypatch) -> None:
    project, run_dir = module_project(tmp_path)
    model = project / "trainpkg" / "model.py"
    fake_apply(run_dir, model, "torch.relu(self.fc(x))", "torch.relu(self.fc(x) + 0.0)", rule="fused_softmax")
    code, data = verify(project, monkeypatch)
    assert code == 0, data
    assert data["parity"]["ok"] and not any("never imported" in n for n in data["notes"]), data


def test_module_run_catches_a_wrong_rewrite_of_a_relatively_imported_module(
    tmp_path: Path, monkeypatch
) -> None:
    # the original's model.py comes from the backup through the relative import; were it not, both agree
    project, run_dir = module_project(tmp_path)
    model = project / "trainpkg" / "model.py"
    fake_apply(
        run_dir, model, "torch.relu(self.fc(x))", "(torch.relu(self.fc(x)) * 1.01)", rule="fused_softmax"
    )
    code, data = verify(project, monkeypatch)
    assert code == 1, data
    assert data["parity"]["first_diverging_step"] == 1 and data["parity"]["rewrite_error"] is None, data
