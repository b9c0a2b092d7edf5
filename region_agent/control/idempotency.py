"""Replaying the result of a write the control plane retries: a bounded LRU with a TTL (pure).

A write carries ``Idempotency-Key`` (or, failing that, a well-formed ``X-Request-Id``). The
first request with a key runs and, when it succeeds (2xx), its status and body are kept
with a fingerprint of the request (method, path, body); the same key with the same
fingerprint gets that answer again without running, the same key with another request is
a conflict. Failures are not kept: they changed nothing, so running the retry again is
harmless and may succeed (a 503 in a minority must not stick).

Bounds: ``max_entries`` (least recently used first out) and ``ttl`` seconds from the first
answer. The cache is per agent: a retry sent to another agent runs again, which is safe
because every write is a full replacement (PUT, DELETE, fence) that converges to the same
state; only the status of the retry may differ (200 instead of 201).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["IdempotencyCache", "KeyConflictError", "Stored", "fingerprint"]

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_TTL_SECONDS = 86_400.0


@dataclass(frozen=True, slots=True)
class Stored:
    fingerprint: str
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]
    stored_at: float


class KeyConflictError(Exception):
    """The key was used for another request."""


def fingerprint(method: str, path: str, body: bytes) -> str:
    h = hashlib.sha256()
    for part in (method.encode(), path.encode(), body):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


class IdempotencyCache:
    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES, ttl: float = DEFAULT_TTL_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or ttl <= 0:
            raise ValueError("max_entries and ttl must be positive")
        self.max_entries = max_entries
        self.ttl = ttl
        self._monotonic = monotonic
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str, print_: str) -> Stored | None:
        """The stored answer for ``key``; raises :class:`KeyConflictError` when it answered another request."""
        stored = self._entries.get(key)
        if stored is None:
            return None
        if self._monotonic() - stored.stored_at > self.ttl:
            del self._entries[key]
            return None
        if stored.fingerprint != print_:
            raise KeyConflictError(key)
        self._entries.move_to_end(key)
        return stored

    def store(self, key: str, print_: str, status: int, body: bytes, headers: tuple[tuple[str, str], ...]) -> None:
        now = self._monotonic()
        self._entries[key] = Stored(print_, status, body, headers, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        # Expired entries at the old end go too, so an idle cache does not hold a day of keys.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.stored_at <= self.ttl:
                break
            self._entries.popitem(last=False)
