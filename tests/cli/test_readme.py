"""The README a stranger reads first: its two commands are what `.ci/run` does, and every file of the
repository it points at (the design notes included) exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _code_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def test_readme_starts_with_setup_and_test_commands_that_ci_runs() -> None:
    setup, tests = _code_blocks()[:2]
    steps = [s.strip() for s in setup.split("&&")]
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
    installs = [s for s in steps if s.startswith("pip install")]
    assert installs == ["pip install torch==2.13.0", "pip install -e '.[dev]'"], steps
    assert steps[-2:] == ["opadvisor profile examples/bert_train.py", "opadvisor suggest"], steps
    test_command = tests.split("&&")[-1].strip()
    ci_lines = [ln.strip() for ln in CI.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    # .ci/run: a new venv of its own, the README's installs in the README's order, then its test command
    assert 'python3 -m venv "$VENV"' in ci_lines and 'rm -rf "$VENV"' in ci_lines
    ci_installs = [ln.replace(" --quiet", "") for ln in ci_lines if ln.startswith("pip install")]
    assert ci_installs == installs
    assert ci_lines[-1] == test_command


def test_ci_venv_is_ignored_and_not_the_users() -> None:
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert ".ci-venv/" in ignored and ".venv/" in ignored
    assert "VENV=.ci-venv" in CI


def test_files_the_readme_names_exist() -> None:
    named = set(re.findall(r"`((?:docs|benchmarks|opadvisor|kernels|examples|tests|\.ci)/[\w./-]+)`", README))
    assert "docs/DESIGN.md" in named  # the design pointer points into the repository
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists() and "<" not in p)
    assert not missing, missing
