"""Replaying the result of a write the control plane retries: a bounded LRU with a TTL (pure).

A write carries ``Idempotency-Key`` (or, failing that, a well-formed ``X-Request-Id``). The
first request with a key runs and, when it succeeds (2xx), its status and body are kept
with a fingerprint of the request (method, path, body); the same key with the same
fingerprint gets that answer again without running, the same key with another request is
a conflict. Failures are not kept: they changed nothing, so running the retry again is
harmless and may succeed (a 503 in a minority must not stick).

Bounds: ``max_entries`` (least recently used first out) and ``ttl`` seconds from the first
answer.

:class:`ReplicatedIdempotency` keeps the answers in the replicated store instead (``idem`` entries,
control-owned, signed like any write, an hour by default), so a retry replays at any agent and after
a restart: a retried DELETE answers its 204 again instead of 404. What it can not do without
consensus: the same key with two different requests at two agents at the same instant runs both
(the later record wins); the control plane should retry through one agent. Answers larger than
:data:`~region_agent.state.model.MAX_IDEMPOTENT_BODY` stay in this agent's own cache.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from region_agent.state.model import Idempotency, Kind, ModelError, idempotency_key
from region_agent.state.store import Store

__all__ = ["IdempotencyCache", "KeyConflictError", "ReplicatedIdempotency", "Stored", "fingerprint"]

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_TTL_SECONDS = 86_400.0
REPLICATED_TTL_SECONDS = 3_600.0
MAX_REPLICATED = 10_000   # records kept in the store at once; past it, answers stay local


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


class ReplicatedIdempotency:
    """The same contract as :class:`IdempotencyCache`, kept in the replicated store (see the module docstring)."""

    def __init__(self, store: Store, writer: str, *, ttl: float = REPLICATED_TTL_SECONDS,
                 wall: Callable[[], float] = time.time) -> None:
        self._store = store
        self.writer = writer
        self.ttl = ttl
        self._wall = wall
        self.local = IdempotencyCache(ttl=ttl)   # answers too large for the store

    def lookup(self, key: str, print_: str) -> Stored | None:
        record = self._store.get(idempotency_key(key))
        if not isinstance(record, Idempotency) or record.expires_at < self._wall():
            return self.local.lookup(key, print_)
        if record.fingerprint != print_:
            raise KeyConflictError(key)
        return Stored(record.fingerprint, record.status, record.body.encode(), record.headers,
                      record.expires_at - self.ttl)

    def store_answer(self, key: str, print_: str, status: int, body: bytes,
                     headers: tuple[tuple[str, str], ...]) -> None:
        try:
            record = Idempotency(print_, status, body.decode(), headers, int(self._wall() + self.ttl))
        except (ModelError, UnicodeDecodeError):
            record = None
        if record is None or len(self._store.idempotency) >= MAX_REPLICATED:
            self.local.store(key, print_, status, body, headers)
            return
        self._store.put_many([(idempotency_key(key), record)], writer=self.writer)

    store = store_answer   # the name IdempotencyCache uses

    def sweep(self) -> int:
        """Delete the records past their time (any agent may; they are control-owned)."""
        now = self._wall()
        expired = [(Kind.IDEM.value, h) for h, r in self._store.idempotency.items() if r.expires_at < now]
        if expired:
            self._store.put_many([(key, None) for key in expired], writer=self.writer)
        return len(expired)
