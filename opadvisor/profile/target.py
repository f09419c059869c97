"""What `opadvisor profile` runs: a script file, or a module as `python -m` runs it.

- `script_target(path)`: `python path.py` — the script's folder first on sys.path. A script inside a
  package (its folder has `__init__.py`) that imports relatively (`from . import x`) cannot run that way
  ("attempted relative import with no known parent package"); Python runs it as `python -m pkg.train`
  from the folder above the package, and so does opadvisor: the target then carries that module name.
- `module_target(name)`: `python -m name` — the current folder first on sys.path, the package imported
  first, the module (or a package's `__main__`) run as `__main__` with its package context.

Both check what they can without importing torch, so a missing file, a misspelt module or a syntax
error is a one-line UserError at once. Finding a dotted module imports its parent packages, as `python
-m` does.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from opadvisor.errors import UserError


@dataclass(frozen=True)
class Target:
    path: Path  # the file that runs as __main__, resolved (what the profile names as its script)
    filename: str  # its name as Python runs it (sys.argv[0], the code's file name): as given, or found
    module: str | None  # the dotted name it runs as, with its package context; None for a plain script
    import_root: Path  # sys.path[0] while it runs
    shown: str  # how messages name it: the script as given, or "module name"


def known_target(filename: str, module: str | None = None, import_root: Path | None = None) -> Target:
    """A target checked before (by a rank's launcher): rebuilt from the parts passed along."""
    path = Path(filename).resolve()
    if module is None:
        return Target(path, filename, None, path.parent, filename)
    return Target(path, filename, module, import_root or path.parent, f"module {module}")


def check_source(script: Path) -> str:
    """Read and compile a script; UserError for a missing, non-Python or syntactically broken file."""
    if not script.exists():
        raise UserError(f"{script}: no such file")
    if script.is_dir():
        raise UserError(f"{script} is a directory, not a Python script")
    if script.suffix not in (".py", ".pyw"):
        raise UserError(f"{script} is not a Python script (expected a .py file)")
    try:
        source = script.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{script} is not a Python script (not UTF-8 text)") from None
    except OSError as exc:
        raise UserError(f"cannot read {script}: {exc.strerror}") from None
    try:
        compile(source, str(script), "exec")
    except SyntaxError as exc:
        raise UserError(f"{script}:{exc.lineno}: syntax error: {exc.msg}") from None
    except ValueError as exc:  # null bytes
        raise UserError(f"{script} is not a Python script ({exc})") from None
    return source


def script_target(script: Path) -> Target:
    """The target for `opadvisor profile SCRIPT` (see the module docstring)."""
    source = check_source(script)
    path = script.resolve()
    packages = _enclosing_packages(path.parent)
    if packages and _imports_relatively(source):
        module = ".".join([*packages, path.stem])
        return Target(path, str(path), module, path.parents[len(packages)], str(script))
    return Target(path, str(script), None, path.parent, str(script))


def module_target(name: str, cwd: Path | None = None) -> Target:
    """The target for `opadvisor profile -m NAME`: found as `python -m` finds it, from `cwd` first."""
    if name.endswith(".py") or "/" in name:
        raise UserError(f"-m takes a module name such as package.train, not a file ({name!r}): drop -m")
    if not all(part.isidentifier() for part in name.split(".")):
        raise UserError(f"{name!r} is not a module name (dotted identifiers, such as package.train)")
    root = (cwd or Path.cwd()).resolve()
    spec = _find(name, root)
    if spec.submodule_search_locations is not None:  # a package runs its __main__, as `python -m` does
        spec = _find(f"{name}.__main__", root, package=name)
    if not spec.origin or not spec.origin.endswith(".py"):
        raise UserError(
            f"module {name!r} is not Python source ({spec.origin or 'no file'}): cannot profile it"
        )
    check_source(Path(spec.origin))
    return Target(Path(spec.origin).resolve(), spec.origin, spec.name, root, f"module {name}")


def _find(name: str, root: Path, package: str | None = None) -> importlib.machinery.ModuleSpec:
    """importlib's spec of `name` with `root` first on sys.path; one-line UserErrors otherwise."""
    saved = sys.path[:]
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as exc:  # a parent package is missing
        raise UserError(f"no module named {exc.name!r} (looked in {root} and on sys.path)") from None
    except Exception as exc:  # noqa: BLE001 - a parent package's own code failed while importing
        parent = name.rpartition(".")[0]
        raise UserError(f"importing {parent!r} failed: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path[:] = saved
    if spec is None and package is not None:
        raise UserError(
            f"{package!r} is a package without a __main__.py: name the module to run, e.g. -m {package}.train"
        )
    if spec is None:
        raise UserError(f"no module named {name!r} (looked in {root} and on sys.path)")
    return spec


def _enclosing_packages(folder: Path) -> list[str]:
    """The package names from the outermost package down to `folder` (empty when it is no package)."""
    names: list[str] = []
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        names.insert(0, folder.name)
        folder = folder.parent
    return names


def _imports_relatively(source: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.level > 0 for n in ast.walk(ast.parse(source)))
