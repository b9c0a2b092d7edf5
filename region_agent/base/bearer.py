"""The operator's bearer token: read from a file, compared in constant time, re-read when it changes.

The file is looked at again at most every couple of seconds (on a request, not by a task), so a
rotated Kubernetes Secret takes effect without a restart, and a file that becomes unreadable or
empty keeps the previous token (logged) instead of locking the operator out.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

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
        self._mtime_ns = -1
        self._expected = b""
        self._checked_at = monotonic()
        self._load(required=True)

    def _load(self, *, required: bool) -> None:
        try:
            stat = os.stat(self._path)
            if stat.st_mtime_ns == self._mtime_ns:
                return
            token = self._path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            if required:
                raise TokenFileError(
                    f"health.operator_token_file {self._path}: {exc.strerror}"
                ) from exc
            logger.warning("operator token file %s unreadable (%s); keeping the previous token",
                           self._path, exc.strerror)
            return
        if not token:
            if required:
                raise TokenFileError(f"health.operator_token_file {self._path} is empty")
            logger.warning("operator token file %s is empty; keeping the previous token", self._path)
            return
        self._expected = b"Bearer " + token.encode()
        self._mtime_ns = stat.st_mtime_ns

    def accepts(self, authorization: str | None) -> bool:
        now = self._monotonic()
        if now - self._checked_at >= _RECHECK_SECONDS:
            self._checked_at = now
            self._load(required=False)
        given = (authorization or "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self._expected)
