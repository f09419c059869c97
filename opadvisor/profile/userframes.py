"""Which source files are the user's, and which belong to an installed library.

User code is everything but torch, opadvisor, the standard library and site-packages. *Library code* is
a file of an installed package (site-packages / dist-packages) other than torch and opadvisor, plus the
few places where torch itself writes a model rather than an operator (`TORCH_MODEL_CODE`:
nn.MultiheadAttention's forward and `F.multi_head_attention_forward`, nn.Transformer*'s layers). Torch's
operator layer (`F.softmax`, `nn.Linear.forward`, ...) is neither: an op reached through it belongs to the
frame that called it, as in the user's case.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import site
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# opadvisor/ (this file is opadvisor/profile/userframes.py)
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def _kernels_dirs() -> frozenset[str]:
    """The folder(s) of `opadvisor.kernels` (its own folder: `kernels/` in a source checkout installed with
    `pip install -e`), found without importing it (and triton)."""
    spec = importlib.util.find_spec("opadvisor.kernels")
    locations = (spec.submodule_search_locations or []) if spec else []
    return frozenset(str(Path(location).resolve()) for location in locations)


@lru_cache(maxsize=1)
def opadvisor_dirs() -> tuple[str, ...]:
    """opadvisor's own folders, `opadvisor.kernels`' included (looked up, not assumed to be inside
    `opadvisor/`): the fused ops' reference paths must never read as the user's code, nor as a library's."""
    return tuple(sorted({str(_PACKAGE_DIR), *_kernels_dirs()}))


# Modules of opadvisor.kernels that run the caller's own code (a patched module's forward, a CUDA-graphed
# model, a compiled region): ops issued below them are the model's, not a fused op's.
_KERNEL_WRAPPERS = frozenset({"patch", "graphs", "region", "__init__"})


@lru_cache(maxsize=4096)
def fused_op_module(file_name: str) -> str | None:
    """The opadvisor.kernels module (`dropout_add`, `softmax`, ...) that `file_name` is, when it is one of the
    fused ops' own files (not a wrapper that calls back into model code); else None. Ops issued inside such
    a file are the fused op's implementation (its plain chain below its size threshold, its reference)."""
    if not file_name or file_name.startswith("<"):
        return None
    path = _locate(file_name)
    if path is None:
        return None
    resolved = path.resolve()
    if str(resolved.parent) not in _kernels_dirs() or resolved.stem in _KERNEL_WRAPPERS:
        return None
    return resolved.stem


def _roots() -> tuple[str, ...]:
    roots = set(opadvisor_dirs())
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(str(Path(path).resolve()))
    try:
        import torch

        roots.add(str(Path(torch.__file__).resolve().parent))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    roots.add(str(Path(sys.prefix).resolve()))
    roots.add(str(Path(sys.base_prefix).resolve()))
    return tuple(sorted(roots))


_ROOTS: tuple[str, ...] | None = None


@dataclass
class _SearchState:
    """Where the profiler's file names are looked up.

    torch's Python tracer shortens a file name by the sys.path entry (or site folder) it lies under, as
    sys.path is when the profiler stops: inside the script, after whatever the script did to sys.path
    and the current folder. So the folders are those of sys.path before the script ran and as the script
    left it (each made absolute against the current folder of that moment), plus the source file of every
    module loaded; `user_roots` are the script's folder and the folder it was started from.
    """

    dirs: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()  # absolute source files of the modules in sys.modules
    user_roots: tuple[str, ...] = ()


_STATE = _SearchState()


def _clear_caches() -> None:
    global _PACKAGE_ROOTS
    _PACKAGE_ROOTS = None  # a site-packages folder the script put on sys.path is one too
    resolve_user_file.cache_clear()
    library_file.cache_clear()
    library_site.cache_clear()
    fused_op_module.cache_clear()
    _loaded_by_suffix.cache_clear()


def _absolute_dirs(dirs: list[str]) -> list[str]:
    """sys.path entries made absolute as the import system reads them now ('' is the current folder)."""
    return [os.path.abspath(d or os.curdir) for d in dirs if isinstance(d, str)]


def set_search_path(dirs: list[str], user_roots: list[str] | None = None) -> None:
    """Start over: resolve file names against `dirs` (the profiled process's sys.path before the script
    runs) and the current folder; `user_roots`, folders whose files are the user's (the script's folder;
    the current folder is always one)."""
    global _STATE
    roots = [os.getcwd(), *(user_roots or [])]
    _STATE = _SearchState(
        dirs=tuple(dict.fromkeys([*_absolute_dirs(dirs), os.getcwd()])),
        user_roots=tuple(dict.fromkeys(str(Path(r).resolve()) for r in roots)),
    )
    _clear_caches()


def note_search_path() -> None:
    """Add sys.path as it is now, the current folder, and the files of every module loaded so far.

    Called when a recording window stops, just before the profiler shortens its file names (the profile
    is built later, with sys.path and the folder restored): a script that put its `src/` on sys.path,
    changed folder or loaded a module by its path has its files found all the same.
    """
    global _STATE
    loaded = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py"):
            loaded.append(_absolute_file(file))
    _STATE = _SearchState(
        dirs=tuple(dict.fromkeys([*_STATE.dirs, *_absolute_dirs(sys.path), os.getcwd()])),
        loaded=tuple(dict.fromkeys([*_STATE.loaded, *loaded])),
        user_roots=_STATE.user_roots,
    )
    _clear_caches()


def _absolute_file(file: str) -> str:
    """A module's `__file__` made absolute: a relative one (a relative sys.path entry, a path given to
    `spec_from_file_location`) was relative to the folder the process started in, if it is there."""
    if os.path.isabs(file):
        return file
    for base in (*_STATE.user_roots[:1], os.getcwd()):
        candidate = os.path.join(base, file)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return os.path.abspath(file)


@lru_cache(maxsize=4096)
def _loaded_by_suffix(file_name: str) -> str | None:
    """The loaded module file whose path ends with `file_name` (a name the profiler shortened by a folder
    no longer on sys.path); the first one loaded when several do."""
    suffix = os.sep + os.path.normpath(file_name)
    return next((f for f in _STATE.loaded if f.endswith(suffix) and os.path.isfile(f)), None)


def _locate(file_name: str) -> Path | None:
    path = Path(file_name)
    if path.is_absolute():
        return path if path.is_file() else None
    for base in (*_STATE.dirs, os.getcwd()):
        candidate = Path(base) / path
        if candidate.is_file():
            return candidate
    found = _loaded_by_suffix(file_name)
    return Path(found) if found else None


@lru_cache(maxsize=4096)
def resolve_user_file(file_name: str) -> str | None:
    """The absolute path of `file_name` if it is user code, else None.

    The profiler reports paths as the interpreter saw them (relative for a script given as a relative
    path, or trimmed to `torch/...` for torch's own files), so anything that does not exist is not ours.
    """
    global _ROOTS
    if not file_name or file_name.startswith("<"):
        return None
    if _ROOTS is None:
        _ROOTS = _roots()
    path = _locate(file_name)
    if path is None:
        return None
    resolved = str(path.resolve())
    # The deepest folder holding the file decides: the user's folder wins over an installation root above
    # it (a project in /usr/src under the prefix /usr), torch or a venv inside the user's folder win over it.
    user_root = _deepest_holding(resolved, _STATE.user_roots)
    excluded = _deepest_holding(resolved, _ROOTS)
    if excluded is not None and (user_root is None or len(excluded) >= len(user_root)):
        # The venv/prefix root contains everything installed, and maybe the user's project too: only its
        # lib/ (the standard library, site-packages) is excluded.
        if excluded not in (str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())):
            return None
        if "lib" in Path(resolved[len(excluded) :]).parts or _installed_below(resolved, excluded):
            return None
    return None if _installed_below(resolved, user_root or "") else resolved


def _deepest_holding(resolved: str, folders: tuple[str, ...]) -> str | None:
    """The longest of `folders` that `resolved` lies under."""
    holding = [f for f in folders if resolved.startswith(f.rstrip(os.sep) + os.sep)]
    return max(holding, key=len, default=None)


_INSTALLED = frozenset({"site-packages", "dist-packages"})


def _installed_below(resolved: str, folder: str) -> bool:
    """Whether the file lies in a site-packages/dist-packages folder below `folder` (a folder of that name
    above it, such as a checkout cloned into one, says nothing about the file)."""
    return not _INSTALLED.isdisjoint(Path(resolved[len(folder) :]).parts)


def innermost_user_frame(skip: int = 1) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of user code on the current stack."""
    frame = sys._getframe(skip)
    while frame is not None:
        user = resolve_user_file(frame.f_code.co_filename)
        if user is not None:
            return user, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


# ---- library code ---------------------------------------------------------------------------------------

# Files of torch that hold model code (attention written out op by op), not operators: a frame there is a
# library frame. None: every function of the file; else the qualified-name prefixes that count.
TORCH_MODEL_CODE: dict[str, tuple[str, ...] | None] = {
    "torch/nn/modules/transformer.py": None,
    "torch/nn/modules/activation.py": ("MultiheadAttention.",),
    "torch/nn/functional.py": ("multi_head_attention_forward", "_in_projection_packed", "_in_projection"),
}


@dataclass(frozen=True)
class LibraryFile:
    """A source file of an installed package."""

    package: str  # the top-level import name: "transformers"
    rel: str  # the path within site-packages: "transformers/models/bert/modeling_bert.py"
    path: str  # absolute


@dataclass(frozen=True)
class LibrarySite:
    file: LibraryFile
    function: str | None  # qualified name of the function holding the line: "BertSelfOutput.forward"


def _package_roots() -> tuple[str, ...]:
    """Folders installed packages live in (longest first, so the most specific one wins)."""
    roots: set[str] = set()
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    try:
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    except AttributeError:  # pragma: no cover - virtualenv's old site module
        pass
    roots.update(
        p for p in (*sys.path, *_STATE.dirs) if p.rstrip(os.sep).endswith(("site-packages", "dist-packages"))
    )
    try:
        import torch

        roots.add(str(Path(torch.__file__).resolve().parent.parent))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    resolved = {str(Path(r).resolve()) for r in roots if r}
    return tuple(sorted(resolved, key=len, reverse=True))


_PACKAGE_ROOTS: tuple[str, ...] | None = None


@lru_cache(maxsize=4096)
def library_file(file_name: str) -> LibraryFile | None:
    """The installed package file `file_name` names (as the profiler or a code object gives it), or None for
    user code, the standard library, opadvisor and files that do not exist. torch's files are included
    here; `library_site` decides which of their functions count."""
    global _PACKAGE_ROOTS
    if not file_name or file_name.startswith("<"):
        return None
    path = _locate(file_name)
    if path is None:
        return None
    resolved = str(path.resolve())
    if _PACKAGE_ROOTS is None:
        _PACKAGE_ROOTS = _package_roots()
    if any(resolved.startswith(own + os.sep) for own in opadvisor_dirs()):
        return None
    for root in _PACKAGE_ROOTS:
        if resolved.startswith(root + os.sep):
            rel = Path(resolved[len(root) + 1 :]).as_posix()
            package = rel.split("/", 1)[0].removesuffix(".py")
            if package.endswith((".dist-info", ".egg-info")) or package == "__pycache__":
                return None
            return LibraryFile(package, rel, resolved)
    return None


@lru_cache(maxsize=64)
def _function_spans(path: str) -> tuple[tuple[int, int, str], ...]:
    """(first line, last line, qualified name) of every function in a file; decorators included."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return ()
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = (*scope, child.name)
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    spans.append((first, child.end_lineno or child.lineno, ".".join(name)))
                visit(child, name)
            else:
                visit(child, scope)

    visit(tree, ())
    return tuple(spans)


@lru_cache(maxsize=8192)
def function_qualname(path: str, line: int) -> str | None:
    """The qualified name of the innermost function of `path` holding `line` ("Cls.method", "f.<locals>"
    is not added: nested functions read "outer.inner"), None when the line is outside any function."""
    best: tuple[int, int, str] | None = None
    for span in _function_spans(path):
        if span[0] <= line <= span[1] and (best is None or span[0] >= best[0]):
            best = span
    return best[2] if best else None


@lru_cache(maxsize=16384)
def library_site(file_name: str, line: int) -> LibrarySite | None:
    """The library site of a frame at `file_name`:`line`, or None when the frame is not library code."""
    lib = library_file(file_name)
    if lib is None or lib.package == "torch" and lib.rel not in TORCH_MODEL_CODE:
        return None
    function = function_qualname(lib.path, line)
    prefixes = TORCH_MODEL_CODE.get(lib.rel) if lib.package == "torch" else None
    if prefixes is not None and not (function or "").startswith(prefixes):
        return None
    return LibrarySite(lib, function)


def innermost_library_frame(skip: int = 1) -> tuple[LibrarySite, int] | None:
    """(site, line) of the innermost library frame on the current stack that is inside the innermost user
    frame (a library that the user's code called); None when user code comes first or there is none."""
    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename
        if resolve_user_file(name) is not None:
            return None
        found = library_site(name, frame.f_lineno)
        if found is not None:
            return found, frame.f_lineno
        frame = frame.f_back
    return None


def construction_frame(obj: object, skip: int = 1) -> tuple[tuple[str, int, str], list[str]] | None:
    """Where the user's code built `obj`: (file, line, function) of the innermost user frame outside
    `obj`'s own `__init__` methods (a user's model class builds itself in its `__init__`; the line that
    matters is the one that called it), and the names of the library functions between (innermost first:
    `from_pretrained` tells a checkpoint load). None when no user frame is on the stack."""
    frame = sys._getframe(skip)
    libraries: list[str] = []
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_varnames and frame.f_locals.get(code.co_varnames[0]) is obj:
            frame = frame.f_back
            continue
        user = resolve_user_file(code.co_filename)
        if user is not None:
            return (user, frame.f_lineno, code.co_name), libraries
        if library_file(code.co_filename) is not None:
            libraries.append(code.co_name)
        frame = frame.f_back
    return None
