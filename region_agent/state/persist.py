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

The header also carries ``last_fresh``: the wall time of this agent's last *fresh* sync round (one
completed while it saw a majority of regions, see :mod:`region_agent.gossip.sync`), or ``null``
when that is unknown. A restarted agent's absence clock goes on from there, not from its start:
an agent cut off for a month that restarts from a recent snapshot still rejoins pull-only. The
time is written as the wall clock reads it when the snapshot is taken (the gossip layer measures
it on the monotonic clock and converts it then), and it is kept up to date on disk within
:data:`FRESH_SAVE_LAG_SECONDS` (a snapshot is written for it even while the store does not change).
:func:`absence_at_start` is how a restart reads it back (a snapshot written before the field
existed, a wall clock that went back, see there). The format number is unchanged: an older agent
ignores the field, and an older snapshot (without it) still loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from region_agent.base.files import atomic_write
from region_agent.state.model import ModelError
from region_agent.state.store import Entry, Store, entry_from_json, entry_to_json

logger = logging.getLogger("region_agent.state")

FORMAT = 1
MAX_BYTES = 512 * 1024 * 1024
HORIZON_MARGIN_SECONDS = 86_400.0   # a snapshot this close to the horizon is already too old
# The last fresh round on disk may trail the one in memory by this much before a snapshot is written for it
# alone (checked as often): on disk it is at most about twice this old, which only ever makes a restarted
# agent look away longer than it was (by an hour, against a 29-day limit), never shorter.
FRESH_SAVE_LAG_SECONDS = 1800.0


class SnapshotError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SnapshotTimes:
    """What a snapshot's header says about time (wall seconds, as this host's clock read them)."""

    saved_at: float | None         # when it was written; None: the header has none
    last_fresh: float | None       # the last fresh sync round; None: unknown (``null``, or not a number)
    carries_fresh: bool = True     # False: written before ``last_fresh`` was kept (an older agent)


def absence_at_start(times: SnapshotTimes, now: float, *, tolerance: float) -> float:
    """Seconds since the last fresh sync round, for an agent restarted from a snapshot with ``times``, the
    wall clock reading ``now``; ``math.inf`` when the snapshot can not tell (then the agent rejoins pull-only).

    Never less than the truth as far as this host's clock can tell, so a clock never makes an agent fresh:

    - A snapshot of an older agent has no ``last_fresh``: its own ``saved_at`` stands in. The last fresh
      round was no later than that (the agent was running then, fresh or not), so the absence is *at
      least* ``now - saved_at``; it may have been longer, which the older agent did not record. Treating
      every such snapshot as unknown would instead turn each agent of a rolling upgrade pull-only once
      (not ready, and dropping whatever it holds that its peers do not have yet); "now" would be the
      defect this replaces. No ``saved_at`` either: unknown.
    - A ``last_fresh`` later than ``saved_at`` (no agent writes one) counts as ``saved_at``.
    - A time more than ``tolerance`` ahead of ``now`` (the wall clock went back across the restart, or ran
      ahead when the snapshot was written) says nothing of how long ago it was: unknown. Within
      ``tolerance`` it counts as now (an absence short by at most that much).
    - A wall clock that jumped forward only makes the absence look longer: at worst a pull not needed.
      A jump back smaller than the time since the snapshot was written can not be seen from here.
    """
    if times.carries_fresh and times.last_fresh is None:
        return math.inf
    last = times.last_fresh if times.carries_fresh else times.saved_at
    if last is None:
        return math.inf
    if times.saved_at is not None:
        if times.saved_at > now + tolerance:
            return math.inf
        last = min(last, times.saved_at)
    if last > now + tolerance:
        return math.inf
    return max(0.0, now - last)


def encode_snapshot(entries: list[Entry], saved_at: float, last_fresh: float | None = None) -> bytes:
    """The file's bytes; ``last_fresh`` None is written as ``null`` (unknown: a restart rejoins pull-only)."""
    rows = [json.dumps(entry_to_json(e), separators=(",", ":"), ensure_ascii=False) for e in entries]
    fresh = last_fresh if last_fresh is not None and math.isfinite(last_fresh) else None
    header = json.dumps({"format": FORMAT, "saved_at": saved_at, "last_fresh": fresh, "entries": len(rows)})
    return ("\n".join([header, *rows]) + "\n").encode()


def _header(raw: bytes) -> dict[str, object]:
    try:
        header = json.loads(raw[:raw.find(b"\n")] if b"\n" in raw else raw)
    except (UnicodeDecodeError, ValueError):
        return {}
    return header if isinstance(header, dict) else {}


def _seconds(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def snapshot_saved_at(raw: bytes) -> float | None:
    """The header's ``saved_at`` (wall seconds), None when the header has none."""
    return _seconds(_header(raw).get("saved_at"))


def snapshot_times(raw: bytes) -> SnapshotTimes:
    """The header's times; a ``last_fresh`` that is there but no finite number is unknown (None)."""
    header = _header(raw)
    return SnapshotTimes(_seconds(header.get("saved_at")), _seconds(header.get("last_fresh")),
                         carries_fresh="last_fresh" in header)


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
        # The wall time of this agent's last fresh sync round (None: unknown), read at every save; the
        # cluster sets it (AntiEntropy.last_fresh_wall). Unset, every snapshot says "unknown".
        self.fresh: Callable[[], float | None] = lambda: None
        self.times: SnapshotTimes | None = None   # the loaded snapshot's; None: none loaded (started empty)
        self._fresh_on_disk: float | None = None
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
            times = snapshot_times(raw)
            saved_at = times.saved_at
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
        self.times = times
        self._fresh_on_disk = times.last_fresh
        if times.carries_fresh:
            self._dirty.clear()
        else:
            self._dirty.set()   # an older snapshot: written again soon, with the last fresh round
        return applied

    def _aside(self, kind: str, why: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.{kind}-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, aside)
        self.problem = f"state file {self.path} {why}; moved to {aside.name}, started empty"
        logger.error(self.problem)

    def _fresh_moved(self) -> bool:
        """The last fresh round in memory is not the one on disk (more than the lag apart, or one unknown)."""
        now, on_disk = self.fresh(), self._fresh_on_disk
        if now is None or on_disk is None:
            return (now is None) != (on_disk is None)
        return abs(now - on_disk) > FRESH_SAVE_LAG_SECONDS   # either way: a wall clock step moves it back

    async def save(self) -> None:
        entries = list(self.store.entries())   # immutable entries: encoded in a thread
        fresh = self.fresh()
        self._dirty.clear()
        try:
            data = await asyncio.to_thread(encode_snapshot, entries, time.time(), fresh)
            await asyncio.to_thread(atomic_write, self.path, data)
        except OSError as exc:
            self._saves.labels("failed").inc()
            self.problem = f"state file {self.path} not written: {exc.strerror or exc}"
            logger.warning(self.problem)
            self._dirty.set()   # try again next time
            return
        self._saves.labels("ok").inc()
        self._last.set(time.time())
        self._fresh_on_disk = fresh
        self.problem = None

    async def run(self) -> None:
        """Save at most every ``interval`` while the store changes, and once more when stopped; also when the
        last fresh round on disk trails the one in memory by more than :data:`FRESH_SAVE_LAG_SECONDS`."""
        saving: asyncio.Future[None] | None = None
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), FRESH_SAVE_LAG_SECONDS)
                if not self._dirty.is_set() and not self._fresh_moved():
                    continue
                await asyncio.sleep(self.interval)
                # Shielded: a stop in the middle must not cut a save that has already taken the store's
                # changes off the dirty flag (the last save below would then skip them).
                saving = asyncio.ensure_future(self.save())
                await asyncio.shield(saving)
                saving = None
        finally:
            if saving is not None:
                await asyncio.shield(saving)   # it ends first: one writer of the file at a time
            if self._dirty.is_set() or self._fresh_moved():
                await asyncio.shield(self.save())
