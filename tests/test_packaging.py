"""The wheel holds every package of the source tree: setuptools' `packages` list in pyproject.toml is written by
hand (`kernels/` ships as `opadvisor.kernels`), and a package missing from it imports in an editable install
and in the tests but not where the wheel is installed (it happened: `opadvisor.ranks`, four rules crashed). A new rule family (opadvisor/rules/<family>/) adds its
line there once."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _source_packages() -> set[str]:
    found = set()
    for init in (ROOT / "opadvisor").rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        if "kernels" not in parts:  # a helper's symlink to kernels/; kernels is mapped below
            found.add(".".join(parts))
    found.update(
        ".".join(("opadvisor", *init.parent.relative_to(ROOT).parts))
        for init in (ROOT / "kernels").rglob("__init__.py")
    )
    return found


def test_every_source_package_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert len(setuptools["packages"]) == len(set(setuptools["packages"])), "a package listed twice"
    listed = set(setuptools["packages"])
    assert _source_packages() - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - _source_packages() == set(), "packages listed in pyproject.toml that do not exist"
