"""The README a stranger reads first: its two commands (the user's install and job, then the tests) are what
`.ci/run` does, the tests' installs leave a user's environment working, and every file of the repository it
points at (the design notes included) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _code_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)


def _installs(steps: list[str]) -> list[str]:
    return [s.replace(" --quiet", "") for s in steps if s.startswith("pip install")]


def _ci_lines() -> list[str]:
    return [ln.strip() for ln in CI.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_starts_with_the_users_setup_then_the_tests_as_ci_runs_them() -> None:
    setup, tests = _code_blocks()[:2]
    steps = [s.strip() for s in setup.split("&&")]
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
    # the user's install first: torch and the package, nothing of the tests'
    assert _installs(steps) == ["pip install torch==2.13.0", "pip install -e ."], steps
    assert steps[-2:] == ["opadvisor profile examples/bert_train.py", "opadvisor suggest"], steps
    test_steps = [s.strip() for s in tests.split("&&")]
    assert test_steps[0] == ". .venv/bin/activate" and _installs(test_steps) == ["pip install -e '.[test]'"]
    ci = _ci_lines()
    # .ci/run: a new venv of its own, the README's installs in the README's order (the user's job run
    # between them, in the user's environment), timm and vit-pytorch (without its torchvision) in CI's
    # environment only, then the test command
    assert 'python3 -m venv "$VENV"' in ci and 'rm -rf "$VENV"' in ci
    assert _installs(ci) == [
        *_installs(steps),
        *_installs(test_steps),
        "pip install 'timm>=1.0,<2'",
        "pip install --no-deps 'vit-pytorch>=1.6,<2'",
    ]
    job = [ci.index(step) for step in steps[-2:]]
    assert (
        ci.index("pip install --quiet -e .") < job[0] < job[1] < ci.index("pip install --quiet -e '.[test]'")
    )
    assert ci[-1] == test_steps[-1]


def test_the_users_and_the_tests_installs_bring_no_torchvision() -> None:
    # timm brings torchvision, whose PyPI wheel breaks `from transformers import ...` beside the CPU torch:
    # no extra the README installs (nor dev) may hold it; CI adds timm to its own environment only
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["test"], *extras["dev"]]
    # nor a package that asks for torchvision itself (vit-pytorch does: CI installs it without dependencies)
    assert not [r for r in wanted if re.match(r"(timm|torchvision|vit-pytorch)\b", r)], wanted
    assert "opadvisor[test]" in extras["dev"]


def test_ci_venv_is_ignored_and_not_the_users() -> None:
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert ".ci-venv/" in ignored and ".venv/" in ignored
    assert "VENV=.ci-venv" in CI


def test_files_the_readme_names_exist() -> None:
    named = set(re.findall(r"`((?:docs|benchmarks|opadvisor|kernels|examples|tests|\.ci)/[\w./-]+)`", README))
    assert "docs/DESIGN.md" in named  # the design pointer points into the repository
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists() and "<" not in p)
    assert not missing, missing
