"""`opadvisor verify` of a run profiled as a module (`profile -m pkg.train`): both programs run as
`python -m` ran them, so the package's relative imports resolve and its rewritten files are compared."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner
from verify_helpers import fake_apply

from opadvisor.cli import app
from opadvisor.profile.model import Profile, save_profile

PACKAGE = Path(__file__).parents[1] / "profile" / "packages" / "trainpkg"


def module_project(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of trainpkg and a run that profiled `-m trainpkg.train -- --steps 50` from the project."""
    project = tmp_path / "project"
    shutil.copytree(PACKAGE, project / "trainpkg", ignore=shutil.ignore_patterns("__pycache__"))
    run_dir = project / ".opadvisor" / "runs" / "run1"
    run_dir.mkdir(parents=True)
    train = project / "trainpkg" / "train.py"
    profile = Profile(
        run_id="run1",
        script=str(train),
        module="trainpkg.train",
        import_root=str(project),
        argv=[str(train), "--steps", "50"],
        cwd=str(project),
        steps_requested=2,
        warmup_steps=1,
    )
    save_profile(profile, run_dir / "profile.json")
    (project / ".opadvisor" / "latest").write_text("run1\n", encoding="utf-8")
    return project, run_dir


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
