"""The store's snapshot file: round trip, atomic writes, refusals, a corrupt file moved aside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from region_agent.state import persist
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.persist import (
    SnapshotError,
    SnapshotTimes,
    StoreSnapshotFile,
    absence_at_start,
    decode_snapshot,
    encode_snapshot,
    snapshot_times,
)
from region_agent.state.store import Store
from tests.conftest import wait_for


def _store(writer: str = "sfo1/n1") -> Store:
    return Store(writer=writer, clock=HybridClock(lambda: int(time.time() * 1000)))


def _filled() -> Store:
    store = _store()
    store.put_many([(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",))),
                    (project_key("shop"), Project("shop", ("sfo1",))),
                    (project_key("gone"), Project("gone", ("sfo1",)))], writer="control/api")
    store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    store.put_many([(project_key("gone"), None)], writer="control/api")   # a tombstone
    return store


async def test_a_saved_store_loads_back_equal_tombstones_included(tmp_path: Path) -> None:
    source = _filled()
    path = tmp_path / "state.jsonl"
    await StoreSnapshotFile(path, source, CollectorRegistry()).save()
    assert not list(tmp_path.glob(".*.tmp"))   # written through a temporary file, renamed
    restored = _store("sfo1/n1")
    loaded = StoreSnapshotFile(path, restored, CollectorRegistry())
    assert await loaded.load() == len(source)
    assert restored.digest() == source.digest() and "gone" not in restored.projects
    # Writes after a restart are newer than everything loaded (the clock advanced past them).
    restored.put(copy_key("shop", "sfo1"), CopyHealth(False, "down"))
    assert restored.copies[("shop", "sfo1")].healthy is False


async def test_a_stop_in_the_middle_of_a_save_still_leaves_the_changes_on_disk(tmp_path: Path) -> None:
    """The save clears the dirty flag before it encodes and writes (in threads): a stop (the task
    cancelled) right then must neither cut that save nor skip the last one. Before, the cancel cut
    it and the last save saw nothing dirty: the agent stopped without its snapshot."""
    store = _store()
    path = tmp_path / "state.jsonl"
    snapshot = StoreSnapshotFile(path, store, CollectorRegistry(), interval=0.0)
    task = asyncio.create_task(snapshot.run())
    stops: list[bool] = []

    def fresh() -> float | None:
        """Read by the save just before it clears the dirty flag: the stop comes then, once."""
        if not stops:
            stops.append(task.cancel())
        return None

    snapshot.fresh = fresh
    await asyncio.sleep(0)   # waiting for a change
    store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert stops == [True]
    restored = _store()
    assert await StoreSnapshotFile(path, restored, CollectorRegistry()).load() == 1
    assert restored.copies[("shop", "sfo1")].healthy


async def test_a_missing_file_starts_empty_and_a_corrupt_one_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    store = _store()
    snap = StoreSnapshotFile(path, store, CollectorRegistry())
    assert await snap.load() == 0 and snap.problem is None
    path.write_bytes(encode_snapshot(list(_filled().entries()), time.time())[:-40])   # torn write
    assert await snap.load() == 0
    problem: str | None = getattr(snap, "problem")  # noqa: B009 - re-read after load (mypy narrowed it)
    assert problem is not None and "moved to" in problem
    assert not path.exists() and len(list(tmp_path.glob("state.jsonl.corrupt-*"))) == 1
    assert len(store) == 0
    await snap.save()   # the next save clears the problem
    assert getattr(snap, "problem") is None and path.exists()  # noqa: B009


def test_foreign_or_malformed_lines_are_refused_one_by_one() -> None:
    good = encode_snapshot(list(_filled().entries()), time.time()).decode().splitlines()
    lines = [good[0].replace(f'"entries": {len(good) - 1}', f'"entries": {len(good)}'), *good[1:], '{"v": 99}']
    entries, refused = decode_snapshot(("\n".join(lines) + "\n").encode())
    assert len(entries) == len(good) - 1 and refused == 1
    with pytest.raises(SnapshotError):
        decode_snapshot(b"\xff\xfe")
    with pytest.raises(SnapshotError):
        decode_snapshot(b'{"format": 2, "entries": 0}\n')


async def test_entries_a_peer_could_not_send_are_refused_on_load_too(tmp_path: Path) -> None:
    """The file is validated like a peer: a standalone writer's entries never enter a cluster store."""
    path = tmp_path / "state.jsonl"
    standalone = Store(writer="standalone/laptop", clock=HybridClock(lambda: int(time.time() * 1000)))
    standalone.put(project_key("shop"), Project("shop", ("sfo1",)))
    await StoreSnapshotFile(path, standalone, CollectorRegistry()).save()
    cluster = _store()
    assert await StoreSnapshotFile(path, cluster, CollectorRegistry()).load() == 0
    assert len(cluster) == 0


async def test_a_snapshot_older_than_the_tombstone_horizon_is_moved_aside(tmp_path: Path) -> None:
    """Three days past a 2-day horizon: it may hold a project deleted while the agent was away, whose tombstone
    every peer has forgotten. Loading it would offer the project again; it is moved aside instead."""
    source = _filled()
    path = tmp_path / "state.jsonl"
    path.write_bytes(encode_snapshot(list(source.entries()), time.time() - 3 * 86_400))
    restored = Store(writer="sfo1/n1", clock=HybridClock(lambda: int(time.time() * 1000)),
                     control_tombstone_ttl=2 * 86_400 + 3600)
    snapshot = StoreSnapshotFile(path, restored, CollectorRegistry())
    assert await snapshot.load() == 0 and len(restored) == 0
    assert not path.exists() and len(list(tmp_path.glob("state.jsonl.stale-*"))) == 1
    assert snapshot.problem is not None and "horizon" in snapshot.problem
    # The same snapshot a day old is within the horizon: loaded.
    path.write_bytes(encode_snapshot(list(source.entries()), time.time() - 86_400 + 3600))
    assert await StoreSnapshotFile(path, restored, CollectorRegistry()).load() == len(source)


def test_control_tombstones_outlive_the_others() -> None:
    """Projects, regions and fences are what a returning agent must never resurrect: 30 days; copy health
    and ACME records a day."""
    wall_ms = [1_800_000_000_000]
    store = Store(writer="control/x", clock=HybridClock(lambda: wall_ms[0]))
    store.put(project_key("shop"), Project("shop", ("sfo1",)))
    store.put_many([(copy_key("shop", "sfo1"), CopyHealth(True))], writer="sfo1/n1")
    store.put_many([(copy_key("shop", "sfo1"), None)], writer="sfo1/n1")
    store.delete(project_key("shop"))
    store.put(project_key("blog"), Project("blog", ("sfo1",)))   # the newest entry, which never expires
    two_days = wall_ms[0] + 2 * 86_400_000
    assert store.expire_tombstones(two_days) == 1                # the copy's
    assert store.entry(project_key("shop")) is not None          # the project's delete is remembered
    assert store.expire_tombstones(wall_ms[0] + 31 * 86_400_000) == 1


# --- the last fresh sync round, kept with the snapshot (the 29-day rule across a restart) -------------------

DAY = 86_400.0
NOW = 1_800_000_000.0


@pytest.mark.parametrize(("times", "away"), [
    (SnapshotTimes(saved_at=NOW - 60, last_fresh=NOW - 40 * DAY), 40 * DAY),   # cut off, kept saving: 40 days
    (SnapshotTimes(saved_at=NOW - 60, last_fresh=NOW - 90), 90.0),
    # An older agent's snapshot has no last fresh round: it was no later than the snapshot, never "now".
    (SnapshotTimes(saved_at=NOW - 3 * DAY, last_fresh=None, carries_fresh=False), 3 * DAY),
    (SnapshotTimes(saved_at=None, last_fresh=None, carries_fresh=False), math.inf),
    (SnapshotTimes(saved_at=NOW - 60, last_fresh=None), math.inf),             # written as unknown (null)
    # A round later than the snapshot that holds it is no round: the snapshot's time stands.
    (SnapshotTimes(saved_at=NOW - 2 * DAY, last_fresh=NOW - 60), 2 * DAY),
    (SnapshotTimes(saved_at=None, last_fresh=NOW - DAY), DAY),
    # The wall clock went back across the restart (or ran ahead before it): how long ago is unknown.
    (SnapshotTimes(saved_at=NOW + DAY, last_fresh=NOW - DAY), math.inf),
    (SnapshotTimes(saved_at=NOW + 10, last_fresh=NOW + 10), math.inf),
    (SnapshotTimes(saved_at=None, last_fresh=NOW + 10), math.inf),
    (SnapshotTimes(saved_at=NOW + DAY, last_fresh=None, carries_fresh=False), math.inf),
    # Within the tolerance (what the store accepts from a peer's clock): now, short by at most that.
    (SnapshotTimes(saved_at=NOW + 3, last_fresh=NOW + 2), 0.0),
])
def test_the_absence_at_start_is_never_shorter_than_the_snapshot_shows(times: SnapshotTimes, away: float) -> None:
    assert absence_at_start(times, NOW, tolerance=4.0) == away


def test_a_wall_clock_jump_forward_only_makes_the_absence_longer() -> None:
    times = SnapshotTimes(saved_at=NOW - 60, last_fresh=NOW - 3600)
    assert absence_at_start(times, NOW + 30 * DAY, tolerance=4.0) == 30 * DAY + 3600


@pytest.mark.parametrize(("header", "times"), [
    ('{"format": 1, "saved_at": 5.0, "entries": 0}', SnapshotTimes(5.0, None, carries_fresh=False)),
    ('{"format": 1, "saved_at": 5.0, "last_fresh": 4, "entries": 0}', SnapshotTimes(5.0, 4.0)),
    ('{"format": 1, "saved_at": 5.0, "last_fresh": null, "entries": 0}', SnapshotTimes(5.0, None)),
    ('{"format": 1, "saved_at": 5.0, "last_fresh": "yesterday", "entries": 0}', SnapshotTimes(5.0, None)),
    ('{"format": 1, "saved_at": 5.0, "last_fresh": true, "entries": 0}', SnapshotTimes(5.0, None)),
    ('{"format": 1, "saved_at": NaN, "last_fresh": Infinity, "entries": 0}', SnapshotTimes(None, None)),
    ('[1, 2]', SnapshotTimes(None, None, carries_fresh=False)),
    ('not json', SnapshotTimes(None, None, carries_fresh=False)),
])
def test_the_header_times_are_read_strictly(header: str, times: SnapshotTimes) -> None:
    """A last fresh round that is there but no finite number is unknown, never taken as some time."""
    assert snapshot_times((header + "\n").encode()) == times


async def test_the_last_fresh_round_round_trips_with_the_snapshot(tmp_path: Path) -> None:
    source = _filled()
    path = tmp_path / "state.jsonl"
    writer = StoreSnapshotFile(path, source, CollectorRegistry())
    fresh = time.time() - 40 * DAY
    writer.fresh = lambda: fresh
    await writer.save()
    restored = _store()
    reader = StoreSnapshotFile(path, restored, CollectorRegistry())
    assert reader.times is None   # nothing loaded yet
    assert await reader.load() == len(source)
    times: SnapshotTimes | None = getattr(reader, "times")  # noqa: B009 - re-read after load (mypy narrowed it)
    assert times is not None and times.carries_fresh and times.last_fresh == fresh
    assert times.saved_at is not None and fresh < times.saved_at <= time.time()
    assert abs(absence_at_start(times, time.time(), tolerance=4.0) - 40 * DAY) < 60
    # Unknown (a restart that could not tell) is kept as unknown, not as the time of the save.
    writer.fresh = lambda: None
    await writer.save()
    unknown = StoreSnapshotFile(path, _store(), CollectorRegistry())
    assert await unknown.load() == len(source)
    assert unknown.times is not None and unknown.times.carries_fresh and unknown.times.last_fresh is None
    assert absence_at_start(unknown.times, time.time(), tolerance=4.0) == math.inf


async def test_an_older_snapshot_still_loads_and_is_written_again_with_the_last_fresh_round(tmp_path: Path) -> None:
    source = _filled()
    path = tmp_path / "state.jsonl"
    saved_at = time.time() - 3 * DAY
    old = encode_snapshot(list(source.entries()), saved_at).decode().splitlines()
    header = json.loads(old[0])
    del header["last_fresh"]   # as an agent before this field wrote it
    path.write_text("\n".join([json.dumps(header), *old[1:]]) + "\n")
    restored = _store()
    snapshot = StoreSnapshotFile(path, restored, CollectorRegistry(), interval=0.01)
    assert await snapshot.load() == len(source) and restored.digest() == source.digest()
    assert snapshot.times == SnapshotTimes(saved_at, None, carries_fresh=False)
    assert absence_at_start(snapshot.times, time.time(), tolerance=4.0) >= 3 * DAY   # at least since it was saved
    fresh = time.time() - 3 * DAY - 60
    snapshot.fresh = lambda: fresh
    task = asyncio.create_task(snapshot.run())
    try:
        await wait_for(lambda: "last_fresh" in _header(path), timeout=5, message="rewritten in the new form")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert snapshot_times(path.read_bytes()).last_fresh == fresh


async def test_a_snapshot_is_written_for_a_moved_fresh_round_alone(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle store is not rewritten, but the last fresh round on disk never trails by more than the lag (nor
    leads: a wall clock stepped back moves it too); at stop it is written if it moved that much."""
    monkeypatch.setattr(persist, "FRESH_SAVE_LAG_SECONDS", 0.05)
    path = tmp_path / "state.jsonl"
    snapshot = StoreSnapshotFile(path, _filled(), CollectorRegistry(), interval=0.01)
    fresh = [time.time() - 600]
    snapshot.fresh = lambda: fresh[0]
    await snapshot.save()
    task = asyncio.create_task(snapshot.run())
    try:
        for moved in (time.time(), time.time() - 3600):   # a fresh round; then the wall clock stepped back
            fresh[0] = moved
            await wait_for(lambda: snapshot_times(path.read_bytes()).last_fresh == fresh[0], timeout=5,
                           message="the moved round on disk")
    finally:
        fresh[0] = time.time() + 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert snapshot_times(path.read_bytes()).last_fresh == fresh[0], "written once more at stop"


def _header(path: Path) -> dict[str, object]:
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert isinstance(header, dict)
    return header
