"""Small file helpers shared by everything that keeps or watches a file on local disk.

:class:`FileWatcher` is what the keyring, TSIG keys, gossip TLS, operator token and zone file
watchers share: when to read their files again, why the content on disk is not in use (the
previous content is), the log lines for a refusal and a recovery, and the poll loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Signature = tuple[int, int, int] | None
_T = TypeVar("_T")


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


class FileWatcher:
    """When to read some files again, and what to say when their content is refused.

    The files are read again when their signature (:func:`file_signature` of each) differs from
    the one last read, which a refusal forgets unless told otherwise, so a failed read is tried
    again on the next look. While the content on disk is refused the component keeps the
    previous content and :attr:`problem` says why; the refusal is logged once per distinct
    message (at ``level``), the recovery once, at info.
    """

    def __init__(self, *paths: str | os.PathLike[str], what: str, keeping: str, logger: logging.Logger,
                 errors: type[Exception] | tuple[type[Exception], ...] = ValueError,
                 level: int = logging.WARNING) -> None:
        """``what`` names the files and ``keeping`` what stays in use, for the log and :meth:`problems`
        ("gossip keyring file", "keeping the current keys"); ``errors`` are what :meth:`read_if_due`
        turns into a refusal."""
        self.paths = tuple(Path(path) for path in paths)
        self.what = what
        self.keeping = keeping
        self._logger = logger
        self._errors = errors
        self._level = level
        self._problem: str | None = None
        self._seen: tuple[Signature, ...] | None = None  # None: never read, or read again
        self._wake = asyncio.Event()

    @property
    def problem(self) -> str | None:
        """Why the files' current content is not in use (the previous content is), or None."""
        return self._problem

    def problems(self) -> tuple[str, ...]:
        """The operator's line for :attr:`problem` (see :class:`~region_agent.base.problems.HasProblems`)."""
        return () if self._problem is None else (f"{self.what} refused, {self.keeping}: {self._problem}",)

    def signature(self) -> tuple[Signature, ...]:
        return tuple(file_signature(path) for path in self.paths)

    def due(self) -> bool:
        """Whether a file changed since it was last read, or the last read is to be tried again."""
        return self._seen is None or self.signature() != self._seen

    def mark(self, signature: tuple[Signature, ...] | None = None) -> None:
        """Remember ``signature`` (by default the files' now) as the one read."""
        self._seen = self.signature() if signature is None else signature

    def refuse(self, message: str, *, retry: bool = True, again: bool = False, reason: str | None = None) -> None:
        """The content is not used, because of ``message``. ``retry``: read again on the next look even
        if nothing changed (not the content's fault); ``again``: log even an unchanged message (SIGHUP);
        ``reason``, for the log, is the metric label of a component that counts its refusals."""
        if retry:
            self._seen = None
        level = self._level if again or message != self._problem else logging.DEBUG
        self._problem = message
        self._logger.log(level, "%s refused%s, %s: %s", self.what, f" ({reason})" if reason else "",
                         self.keeping, message)

    def accept(self) -> None:
        """The content is in use (or the one in use is back): clears :attr:`problem`."""
        if self._problem is not None:
            self._logger.info("%s %s usable again", self.what, ", ".join(str(path) for path in self.paths))
        self._problem = None

    def read_now(self, read: Callable[[], _T]) -> _T:
        """``read()`` now and remember the signature; its errors propagate (at start there is nothing to keep)."""
        signature = self.signature()  # before the read: a change during it is read next time
        value = read()
        self._seen = signature
        self.accept()
        return value

    def read_if_due(self, read: Callable[[], _T], *, forced: bool = False) -> _T | None:
        """``read()`` if :meth:`due` (or ``forced``); None when not read, or refused (``errors``)."""
        if not forced and not self.due():
            return None
        try:
            return self.read_now(read)
        except self._errors as exc:
            self.refuse(str(exc), again=forced)
            return None

    def request_reload(self) -> None:
        """Wake :meth:`run` now, with ``forced`` (the SIGHUP handler); safe from a signal handler."""
        self._wake.set()

    async def run(self, check: Callable[[bool], object], poll: float) -> None:
        """Call ``check(forced)`` every ``poll`` seconds, and at once with ``forced`` on
        :meth:`request_reload`, until cancelled; an awaitable ``check`` result is awaited."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), poll)
                forced = True
            except TimeoutError:
                forced = False
            self._wake.clear()  # a request during the check wakes the next round
            result = check(forced)
            if inspect.isawaitable(result):
                await result
