"""The store's snapshot file: round trip, atomic writes, refusals, a corrupt file moved aside."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.persist import SnapshotError, StoreSnapshotFile, decode_snapshot, encode_snapshot
from region_agent.state.store import Store


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
