"""Build a project, a run folder and an `apply`-style rewrite in a temporary directory, without apply.

`make_project` copies scripts into a project folder and writes a run whose profile.json names the script, its
argv and working directory (what verify reads). `fake_apply` rewrites a file the way `opadvisor apply` does:
a byte-exact backup under the run's backup/, the file as it left it under snapshots/, and an entry in
applied.json (see opadvisor/verify/applied.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from opadvisor.profile.model import Profile, save_profile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = "--device cpu --hidden 32 --layers 1 --heads 2 --seq 16 --batch 4 --vocab 1003 --steps 50".split()


def make_project(
    tmp_path: Path, files: dict[str, str], script: str, args: list[str], module: str | None = None
) -> tuple[Path, Path]:
    """Write `files` into tmp_path/project and a run for `script` (run as `module` from the project, as
    `profile -m` records it, when given); returns (project, run folder)."""
    project = tmp_path / "project"
    project.mkdir()
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text, encoding="utf-8")
    run_dir = project / ".opadvisor" / "runs" / "run1"
    run_dir.mkdir(parents=True)
    script_path = project / script
    profile = Profile(
        run_id="run1",
        script=str(script_path),
        argv=[script, *args],
        cwd=str(project),
        steps_requested=2,
        warmup_steps=1,
        module=module,
        import_root=str(project) if module else None,
    )
    save_profile(profile, run_dir / "profile.json")
    (project / ".opadvisor" / "latest").write_text("run1\n", encoding="utf-8")
    return project, run_dir


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fake_apply(
    run_dir: Path, path: Path, old: str, new: str, rule: str = "fused_softmax", count: int = 1
) -> None:
    """Replace `old` by `new` in `path` (it must occur `count` times) and record it like apply does."""
    before = path.read_bytes()
    text = before.decode("utf-8")
    assert text.count(old) == count, f"{old!r} occurs {text.count(old)} times in {path}"
    after = text.replace(old, new).encode("utf-8")
    applied_path = run_dir / "applied.json"
    data = json.loads(applied_path.read_text()) if applied_path.exists() else {"schema": 1, "applied": []}
    backup = Path("backup") / f"{len(data['applied'])}" / path.name
    (run_dir / backup).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / backup).write_bytes(before)
    snapshot = Path("snapshots") / f"{len(data['applied'])}" / path.name  # the file as this entry left it
    (run_dir / snapshot).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / snapshot).write_bytes(after)
    line = text[: text.index(old)].count("\n") + 1
    data["applied"].append(
        {
            "rule": rule,
            "path": str(path.resolve()),
            "backup": str(backup),
            "sha256_before": _sha(before),
            "sha256_after": _sha(after),
            "after": str(snapshot),
            "changes": [{"line": line, "message": f"rewrote for {rule}"}],
        }
    )
    applied_path.write_text(json.dumps(data), encoding="utf-8")
    path.write_bytes(after)
