"""The layout is the architecture: a private module (`_x.py`) is imported only inside its own package.

Every import in opadvisor/, kernels/ (installed as opadvisor.kernels), benchmarks/ and examples/ is read with
ast and resolved to the module it names (relative imports and `from pkg import _mod` included); one that
names a private module of another package fails here. A package's subpackages are its own. The tests are
not held to this: they may test a package's private modules directly.

Two more rules of the house (issue 32): no import cycles among these modules (imports inside functions
count), and no function of opadvisor/ outside the kernels longer than MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder in the repository -> the dotted package it is imported as
TREES = {
    "opadvisor": "opadvisor",
    "kernels": "opadvisor.kernels",
    "benchmarks": "benchmarks",
    "examples": "examples",
}


def _module_of(path: Path) -> str:
    """The dotted name `path` is imported as (a package's __init__.py is the package)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [*TREES[rel.parts[0]].split("."), *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    """Every module of the trees, by dotted name."""
    found = {}
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            found[_module_of(path)] = path
    return found


SOURCES = _sources()


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement can load: the module, and for `from M import a` also M.a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: `from .x` is package.x, each further dot one package up
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        module = ".".join([*base, *([node.module] if node.module else [])])
    else:
        module = node.module or ""
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def _private_owner(name: str) -> str | None:
    """The package owning the first private module along `name` (one of ours), None if none is private."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        if part.startswith("_") and not part.startswith("__") and prefix in SOURCES:
            return ".".join(parts[:i])
    return None


def _violations(source: str, module: str, path: Path) -> list[str]:
    package = _package_of(module, path)
    found = []
    for node in ast.walk(ast.parse(source)):
        for name in _imported(node, package):
            owner = _private_owner(name)
            if owner is not None and package != owner and not package.startswith(owner + "."):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name} (private to {owner})")
                break
    return found


def test_no_private_module_is_imported_across_packages() -> None:
    problems = [v for module, path in SOURCES.items() for v in _violations(path.read_text(), module, path)]
    assert not problems, "use the package's public surface instead:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "line",
    [
        "from opadvisor.rules._findings import fmt_ms",
        "from opadvisor.rules import _findings",
        "import opadvisor.rules._index",
        "from ..rules._source import load_source",
        "from opadvisor.kernels import _rng",
    ],
)
def test_the_check_sees_each_form_of_import(line: str) -> None:
    # as if written in opadvisor/cli/suggest.py: every form names a private module of another package
    path = ROOT / "opadvisor" / "cli" / "suggest.py"
    assert _violations(line, "opadvisor.cli.suggest", path)


def test_the_check_allows_a_package_its_own_private_modules() -> None:
    path = ROOT / "opadvisor" / "rules" / "engine.py"
    source = (
        "from opadvisor.rules._index import index_of\nfrom ._findings import fmt_ms\nimport torch._dynamo"
    )
    assert not _violations(source, "opadvisor.rules.engine", path)


# ---- no import cycles -------------------------------------------------------------------------------------------------
# A module that imports another which imports it back (directly or round a longer circle) is one concern in
# two files, or a shared piece kept by the wrong owner: move the piece to the module that owns it. Imports
# inside functions count (deferring an import hides a circle, it does not break it).


def _loaded(node: ast.AST, package: str) -> list[str]:
    """The modules an import statement loads, its packages' __init__ aside (Python loads those for any
    import below them): `import a.b` loads a.b; `from a import b` loads a.b when that is a module, else a."""
    names = _imported(node, package)
    if not isinstance(node, ast.ImportFrom):
        return names
    submodules = [name for name in names[1:] if name in SOURCES]
    return submodules if len(submodules) == len(names) - 1 else [names[0], *submodules]


def _imports_of(module: str, path: Path) -> set[str]:
    """The modules of ours that `module` imports, anywhere in it (inside functions too)."""
    package = _package_of(module, path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        found.update(name for name in _loaded(node, package) if name in SOURCES and name != module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = {module: _imports_of(module, path) for module, path in SOURCES.items()}
    cycles = _cycles(graph)
    words = [
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles
    ]
    assert not cycles, "import cycles (move the shared piece to its owner):\n" + "\n".join(words)


def test_the_cycle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# ---- short functions ---------------------------------------------------------------------------------------------------
# A function of opadvisor (outside the kernels, whose Triton bodies are one launch each) fits on a screen: at most
# MAX_FUNCTION_LINES lines, decorators aside, docstring included. Split a longer one into functions whose names say
# what each part does.
MAX_FUNCTION_LINES = 60


def _long_functions() -> dict[str, int]:
    """`path::name` -> lines, for every function of opadvisor/ (outside kernels) over MAX_FUNCTION_LINES."""
    found = {}
    for path in sorted((ROOT / "opadvisor").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if "kernels" in rel.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{rel.as_posix()}::{node.name}"] = lines
    return found


def test_no_function_is_longer_than_a_screen() -> None:
    found = _long_functions()
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them): {found}"
