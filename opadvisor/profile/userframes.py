"""Which source files are the user's: everything but torch, opadvisor, the standard library and site-packages."""

from __future__ import annotations

import os
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

import opadvisor


def _roots() -> tuple[str, ...]:
    roots = {str(Path(opadvisor.__file__).resolve().parent)}
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
_SEARCH: tuple[str, ...] = ()


def set_search_path(dirs: list[str]) -> None:
    """Folders to resolve relative file names against, in order (the profiled process's sys.path).

    torch's Python tracer shortens file names by the sys.path entry they were found under, so a script
    run from another folder appears as `train.py` and torch's own files as `torch/nn/...`.
    """
    global _SEARCH
    _SEARCH = tuple(dict.fromkeys(d or "." for d in dirs))
    resolve_user_file.cache_clear()


def _locate(file_name: str) -> Path | None:
    path = Path(file_name)
    if path.is_absolute():
        return path if path.is_file() else None
    for base in (*_SEARCH, str(Path.cwd())):
        candidate = Path(base) / path
        if candidate.is_file():
            return candidate
    return None


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
    # The venv/prefix root contains everything installed; the user's project may live under it too
    # (e.g. /usr/src), so only exclude the prefix when the file is in a lib/ or site-packages folder.
    for root in _ROOTS:
        if resolved.startswith(root + os.sep):
            if root in (str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())):
                if f"{os.sep}lib{os.sep}" in resolved[len(root) :] or "site-packages" in resolved:
                    return None
                continue
            return None
    if "site-packages" in resolved or "dist-packages" in resolved:
        return None
    return resolved


def innermost_user_frame(skip: int = 1) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of user code on the current stack."""
    frame = sys._getframe(skip)
    while frame is not None:
        user = resolve_user_file(frame.f_code.co_filename)
        if user is not None:
            return user, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None
