"""Small file helpers shared by everything that keeps or watches a file on local disk."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

Signature = tuple[int, int, int] | None


def file_signature(path: str | os.PathLike[str]) -> Signature:
    """(mtime ns, size, inode) of ``path``, following symlinks (a Kubernetes Secret volume swaps a
    symlink), or None when it can not be read: a change of any of them means "read it again"."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` all at once: a temporary file beside it (``mode``), fsync,
    rename, fsync of the directory. A crash leaves the old file or the new one, never half of one;
    a failure removes the temporary file and raises."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
