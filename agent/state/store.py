"""The replicated store: versioned entries, deterministic merge, tombstones and a digest.

Every agent holds a full copy. An entry is ``(key, value or tombstone, version)`` where the
version is ``(hlc, writer)``; the entry with the greater version wins, everywhere, whatever
order updates arrive in (last writer wins on a hybrid logical clock, ties broken by writer
id), so two stores that have seen the same entries are equal. Deletes are tombstones that
win like writes and are dropped after ``tombstone_ttl`` so the store does not grow forever.

The digest is the sum, modulo 2**128, of one hash per entry, kept per bucket (the first
byte of a hash of the key): adding or replacing an entry updates it in O(1), two stores
compare in one message, and differing buckets say which entries to exchange.

This module does no I/O and never awaits: callers own locking-free single-loop access.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent.state.hlc import HybridClock, physical_ms
from agent.state.model import (
    CopyHealth,
    Key,
    Kind,
    ModelError,
    Project,
    Region,
    Value,
    check_key,
    may_write,
)

BUCKETS = 256
_MOD = 1 << 128


@dataclass(frozen=True, slots=True, order=True)
class Version:
    hlc: int
    writer: str


@dataclass(frozen=True, slots=True)
class Entry:
    key: Key
    value: Value | None  # None is a tombstone
    version: Version

    @property
    def is_tombstone(self) -> bool:
        return self.value is None


class OwnershipError(PermissionError):
    """A writer tried to change a key it does not own."""


def _key_bytes(key: Key) -> bytes:
    return "\x1f".join(key).encode()


def bucket_of(key: Key) -> int:
    return hashlib.blake2b(_key_bytes(key), digest_size=1).digest()[0]


def _entry_hash(entry: Entry) -> int:
    h = hashlib.blake2b(digest_size=16)
    h.update(_key_bytes(entry.key))
    h.update(b"\x00")
    h.update(entry.version.hlc.to_bytes(10, "big"))
    h.update(entry.version.writer.encode())
    h.update(b"\x00" if entry.value is None else b"\x01")
    return int.from_bytes(h.digest(), "big")


class StateView(Protocol):
    """The live records by kind: what the zone compiler and the checks read."""

    @property
    def regions(self) -> Mapping[str, Region]: ...

    @property
    def projects(self) -> Mapping[str, Project]: ...

    @property
    def copies(self) -> Mapping[tuple[str, str], CopyHealth]: ...

    @property
    def newest_hlc(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable copy of the live records (a :class:`StateView` that later writes do not change)."""

    regions: dict[str, Region]
    projects: dict[str, Project]
    copies: dict[tuple[str, str], CopyHealth]
    newest_hlc: int
    digest: str


Listener = Callable[[list[Entry]], None]


class Store:
    def __init__(self, *, writer: str, clock: HybridClock, tombstone_ttl: float = 86_400.0) -> None:
        self.writer = writer
        self.clock = clock
        self.tombstone_ttl_ms = int(tombstone_ttl * 1000)
        self._entries: dict[Key, Entry] = {}
        self._bucket_sums = [0] * BUCKETS
        self._listeners: list[Listener] = []
        # Live records by kind, kept in step with _entries so a reader never scans or copies
        # the whole store. Read-only for everyone else (they are the StateView).
        self._regions: dict[str, Region] = {}
        self._projects: dict[str, Project] = {}
        self._copies: dict[tuple[str, str], CopyHealth] = {}
        self._newest_hlc = 0

    # --- reads --------------------------------------------------------------------------

    def get(self, key: Key) -> Value | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def entry(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def keys_of(self, kind: Kind) -> list[Key]:
        return [k for k, e in self._entries.items() if k[0] == kind.value and e.value is not None]

    def bucket_digests(self) -> tuple[int, ...]:
        return tuple(self._bucket_sums)

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for total in self._bucket_sums:
            h.update(total.to_bytes(16, "big"))
        return h.hexdigest()

    def entries_in_buckets(self, buckets: Iterable[int]) -> list[Entry]:
        wanted = set(buckets)
        return [e for e in self._entries.values() if bucket_of(e.key) in wanted]

    @property
    def regions(self) -> Mapping[str, Region]:
        return self._regions

    @property
    def projects(self) -> Mapping[str, Project]:
        return self._projects

    @property
    def copies(self) -> Mapping[tuple[str, str], CopyHealth]:
        return self._copies

    @property
    def newest_hlc(self) -> int:
        """The greatest version this store has applied (tombstones included)."""
        return self._newest_hlc

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self._regions), dict(self._projects), dict(self._copies), self._newest_hlc,
                        self.digest())

    # --- local writes -------------------------------------------------------------------

    def put(self, key: Key, value: Value) -> Entry | None:
        """Write ``value`` as this store's writer; returns None when nothing changed."""
        return self._write(key, value)

    def delete(self, key: Key) -> Entry | None:
        return self._write(key, None)

    def _write(self, key: Key, value: Value | None) -> Entry | None:
        check_key(key)
        if not may_write(self.writer, key):
            raise OwnershipError(f"writer {self.writer} does not own {key!r}")
        current = self._entries.get(key)
        if current is None and value is None:
            return None
        if current is not None and current.value == value:
            return None  # same content: no new version, no churn in gossip or the zone
        entry = Entry(key, value, Version(self.clock.now(), self.writer))
        self._apply(entry)
        self._notify([entry])
        return entry

    # --- remote entries -----------------------------------------------------------------

    def merge(self, entries: Iterable[Entry]) -> list[Entry]:
        """Apply entries from a peer; returns those that changed this store.

        An entry from a writer that does not own its key is refused (raises), so a peer
        can not rewrite another region's health; a stale entry is ignored.
        """
        applied: list[Entry] = []
        for entry in entries:
            check_key(entry.key)
            if not may_write(entry.version.writer, entry.key):
                raise OwnershipError(f"writer {entry.version.writer} does not own {entry.key!r}")
            self.clock.observe(entry.version.hlc)
            current = self._entries.get(entry.key)
            if current is not None and current.version >= entry.version:
                continue
            self._apply(entry)
            applied.append(entry)
        if applied:
            self._notify(applied)
        return applied

    def expire_tombstones(self, now_wall_ms: int) -> int:
        """Drop tombstones older than the TTL; returns how many were dropped."""
        cutoff = now_wall_ms - self.tombstone_ttl_ms
        old = [e for e in self._entries.values() if e.value is None and physical_ms(e.version.hlc) < cutoff]
        for entry in old:
            del self._entries[entry.key]
            self._adjust(entry, -1)  # tombstones are in no index
        return len(old)

    # --- notifications ------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(changed entries)`` after every change; must not block or await."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _notify(self, changed: list[Entry]) -> None:
        for listener in list(self._listeners):
            listener(changed)

    def _apply(self, entry: Entry) -> None:
        current = self._entries.get(entry.key)
        if current is not None:
            self._adjust(current, -1)
        self._entries[entry.key] = entry
        self._adjust(entry, +1)
        self._index(entry)
        self._newest_hlc = max(self._newest_hlc, entry.version.hlc)

    def _index(self, entry: Entry) -> None:
        key, value = entry.key, entry.value
        if key[0] == Kind.REGION.value:
            _set_or_pop(self._regions, key[1], value)
        elif key[0] == Kind.PROJECT.value:
            _set_or_pop(self._projects, key[1], value)
        else:
            _set_or_pop(self._copies, (key[1], key[2]), value)

    def _adjust(self, entry: Entry, sign: int) -> None:
        bucket = bucket_of(entry.key)
        self._bucket_sums[bucket] = (self._bucket_sums[bucket] + sign * _entry_hash(entry)) % _MOD


def _set_or_pop(index: dict[Any, Any], key: Any, value: Value | None) -> None:
    if value is None:
        index.pop(key, None)
    else:
        index[key] = value


def entry_to_json(entry: Entry) -> dict[str, object]:
    from agent.state.model import encode_value

    return {
        "key": list(entry.key),
        "value": None if entry.value is None else encode_value(entry.value),
        "hlc": entry.version.hlc,
        "writer": entry.version.writer,
    }


def entry_from_json(data: dict[str, object]) -> Entry:
    """Decode an entry received from outside; bad input raises :class:`ModelError`."""
    from agent.state.model import decode_value

    try:
        raw_key = data["key"]
        if not isinstance(raw_key, list):
            raise ModelError("key must be a list")
        key: Key = tuple(str(part) for part in raw_key)
        hlc = data["hlc"]
        writer = data["writer"]
        if not isinstance(hlc, int) or hlc < 0 or not isinstance(writer, str) or not writer:
            raise ModelError("hlc must be a non-negative integer and writer a non-empty string")
        raw_value = data.get("value")
        if raw_value is not None and not isinstance(raw_value, dict):
            raise ModelError("value must be an object or null")
    except KeyError as exc:
        raise ModelError(f"entry lacks {exc.args[0]!r}") from exc
    check_key(key)
    value = None if raw_value is None else decode_value(key, raw_value)
    return Entry(key, value, Version(hlc, writer))


def dumps_entries(entries: Iterable[Entry]) -> bytes:
    return json.dumps([entry_to_json(e) for e in entries], separators=(",", ":")).encode()
