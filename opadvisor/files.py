"""Files on disk, written whole or not at all, and their hashes: one implementation for every package.

`profile` writes run folders and hashes the profiled sources, `rules` compares those hashes with the files
as they are now, `rewrite` replaces the user's files and `cli report` writes its page; they all go through
these functions, so a file opadvisor writes always gets the same mode and is never seen half-written.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "current_umask", "file_sha256"]


def current_umask() -> int:
    """The process's umask (reading it means setting it: it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_sha256(path: str | Path) -> str | None:
    """sha256 hex of a file's bytes, None when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def atomic_write(path: Path, data: bytes, mode_from: Path | None = None) -> None:
    """Replace `path` with `data` through a temporary file in the same folder.

    The new file takes the permission bits (and owner, where allowed) of `mode_from`, by default of the
    file it replaces; a new file gets the mode a plain open() would give.
    """
    source = mode_from or path
    st = source.stat() if source.exists() else None
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".opadvisor-tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except (PermissionError, AttributeError):
                pass
        else:  # mkstemp makes it 0600
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
