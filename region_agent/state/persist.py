"""The replicated store on local disk, so a restarted agent answers before (or without) its peers.

In cluster mode the projects and regions come from the control API, not from a file: if every
agent of the cluster restarted at once, nothing would be left to sync from. So each agent keeps a
snapshot of its store in ``state_file``: loaded at start through the store's merge (validated
like a peer's entries: a corrupt or foreign entry is refused, never trusted), written atomically
(temporary file, fsync, rename, fsync of the directory) at most every ``interval`` seconds while
the store changes, and once more at stop. Anti-entropy then brings anything newer.

A file that can not be read or parsed is moved aside (``<name>.corrupt-<unix time>``) and the
agent starts empty: a bad volume is never a reason not to start, and the evidence is kept.
Tombstones are saved too, so a delete does not come back from an old snapshot, as long as the
snapshot is younger than the tombstone horizon: one saved longer ago than
:data:`~region_agent.state.store.CONTROL_TOMBSTONE_TTL_SECONDS` minus :data:`HORIZON_MARGIN_SECONDS`
may hold entries whose deletes every peer has since forgotten, so it is moved aside
(``<name>.stale-<unix time>``) and the agent starts empty, taking the peers' state (Cassandra's
``gc_grace_seconds`` rule: a node away longer is rebuilt, never rejoined).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.files import atomic_write
from region_agent.state.model import ModelError
from region_agent.state.store import Entry, Store, entry_from_json, entry_to_json

logger = logging.getLogger("region_agent.state")

FORMAT = 1
MAX_BYTES = 512 * 1024 * 1024
HORIZON_MARGIN_SECONDS = 86_400.0   # a snapshot this close to the horizon is already too old


class SnapshotError(ValueError):
    pass


def encode_snapshot(entries: list[Entry], saved_at: float) -> bytes:
    rows = [json.dumps(entry_to_json(e), separators=(",", ":"), ensure_ascii=False) for e in entries]
    header = json.dumps({"format": FORMAT, "saved_at": saved_at, "entries": len(rows)})
    return ("\n".join([header, *rows]) + "\n").encode()


def snapshot_saved_at(raw: bytes) -> float | None:
    """The header's ``saved_at`` (wall seconds), None when the header has none."""
    try:
        header = json.loads(raw[:raw.find(b"\n")] if b"\n" in raw else raw)
    except (UnicodeDecodeError, ValueError):
        return None
    saved = header.get("saved_at") if isinstance(header, dict) else None
    return float(saved) if isinstance(saved, int | float) and not isinstance(saved, bool) else None


def decode_snapshot(raw: bytes) -> tuple[list[Entry], int]:
    """The entries, and how many lines were refused; a bad header or count is a :class:`SnapshotError`."""
    try:
        lines = raw.decode().splitlines()
        header = json.loads(lines[0]) if lines else None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotError(f"not a state snapshot: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SnapshotError(f"not a format {FORMAT} state snapshot")
    if not raw.endswith(b"\n") or header.get("entries") != len(lines) - 1:
        raise SnapshotError(f"truncated: {len(lines) - 1} of {header.get('entries')} entries")
    entries: list[Entry] = []
    refused = 0
    for line in lines[1:]:
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ModelError("not an object")
            entries.append(entry_from_json(data))
        except (ValueError, ModelError):
            refused += 1
    return entries, refused


def _read(path: Path) -> bytes | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size > MAX_BYTES:
        raise SnapshotError(f"{size} bytes, over the {MAX_BYTES} byte bound")
    return path.read_bytes()


class StoreSnapshotFile:
    def __init__(self, path: Path, store: Store, registry: CollectorRegistry, *, interval: float = 30.0) -> None:
        self.path = path
        self.store = store
        self.interval = interval
        self.problem: str | None = None
        self._dirty = asyncio.Event()
        self._saves = Counter("region_agent_state_file_saves", "Store snapshots written to state_file, by result",
                              ["result"], registry=registry)
        self._loaded = Gauge("region_agent_state_file_loaded_entries",
                             "Entries applied from state_file at start", registry=registry)
        self._last = Gauge("region_agent_state_file_last_save_timestamp_seconds",
                           "Wall time of the last snapshot written", registry=registry)
        store.subscribe(lambda _changed: self._dirty.set())

    def problems(self) -> tuple[str, ...]:
        return () if self.problem is None else (self.problem,)

    async def load(self) -> int:
        """Merge the snapshot into the store; returns the entries applied (0 for no or a bad file)."""
        try:
            raw = await asyncio.to_thread(_read, self.path)
            if raw is None:
                logger.info("state file %s does not exist yet: starting empty", self.path)
                return 0
            saved_at = snapshot_saved_at(raw)
            horizon = self.store.control_tombstone_ttl_ms / 1000 - HORIZON_MARGIN_SECONDS
            if saved_at is not None and time.time() - saved_at > horizon:
                self._aside("stale", f"saved {(time.time() - saved_at) / 86_400:.1f} days ago, beyond the "
                            f"{horizon / 86_400:.0f}-day tombstone horizon: deletes made since may be forgotten "
                            "everywhere")
                return 0
            entries, refused = await asyncio.to_thread(decode_snapshot, raw)
        except (OSError, SnapshotError) as exc:
            self._aside("corrupt", f"unusable ({exc})")
            return 0
        result = self.store.merge(entries)
        applied = len(result.applied)
        self._loaded.set(applied)
        logger.info("state file %s: %d entries applied (%d refused, %d lines unreadable)", self.path, applied,
                    len(result.rejected), refused)
        self._dirty.clear()
        return applied

    def _aside(self, kind: str, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.{kind}-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        self.problem = f"state file {self.path} {why}; moved to {aside.name}, started empty"
        logger.error(self.problem)

    async def save(self) -> None:
        entries = list(self.store.entries())   # immutable entries: encoded in a thread
        self._dirty.clear()
        try:
            data = await asyncio.to_thread(encode_snapshot, entries, time.time())
            await asyncio.to_thread(atomic_write, self.path, data)
        except OSError as exc:
            self._saves.labels("failed").inc()
            self.problem = f"state file {self.path} not written: {exc.strerror or exc}"
            logger.warning(self.problem)
            self._dirty.set()   # try again next time
            return
        self._saves.labels("ok").inc()
        self._last.set(time.time())
        self.problem = None

    async def run(self) -> None:
        """Save at most every ``interval`` while the store changes, and once more when stopped."""
        try:
            while True:
                await self._dirty.wait()
                await asyncio.sleep(self.interval)
                await self.save()
        finally:
            if self._dirty.is_set():
                await asyncio.shield(self.save())
