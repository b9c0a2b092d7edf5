"""The operator's bearer token: read from a file, compared in constant time, re-read when it changes.

The file is looked at again at most every couple of seconds (on a request, not by a task), so a
rotated Kubernetes Secret takes effect without a restart, and a file that becomes unreadable or
empty keeps the previous token (logged, and shown as :meth:`BearerToken.problems`) instead of
locking the operator out.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path

from region_agent.base.files import FileWatcher

__all__ = ["BearerToken", "TokenFileError"]

logger = logging.getLogger("region_agent.health")
_RECHECK_SECONDS = 2.0


class TokenFileError(ValueError):
    """The token file can not be used (the message names the setting)."""


class BearerToken:
    """``Authorization: Bearer <token>`` against the token in a file."""

    def __init__(self, path: Path, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._path = path
        self._monotonic = monotonic
        self._watch = FileWatcher(path, what="operator token file", keeping="keeping the previous token",
                                  logger=logger, errors=TokenFileError)
        self._checked_at = monotonic()
        self._expected = self._watch.read_now(self._read)  # raises: at start there is no token to keep

    def _read(self) -> bytes:
        try:
            token = self._path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TokenFileError(f"health.operator_token_file {self._path}: {exc.strerror}") from exc
        if not token:
            raise TokenFileError(f"health.operator_token_file {self._path} is empty")
        return b"Bearer " + token.encode()

    @property
    def problem(self) -> str | None:
        """Why the file's current content is not in use (the previous token is), or None."""
        return self._watch.problem

    def problems(self) -> tuple[str, ...]:
        return self._watch.problems()

    def accepts(self, authorization: str | None) -> bool:
        now = self._monotonic()
        if now - self._checked_at >= _RECHECK_SECONDS:
            self._checked_at = now
            expected = self._watch.read_if_due(self._read)
            if expected is not None:
                self._expected = expected
        given = (authorization or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self._expected)
