"""Batches: merge validates a peer's batch first and applies the rest; put_many is all-or-nothing.

Also the entry encoding's schema version and the tombstone sweep.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.state.hlc import HybridClock, pack
from region_agent.state.model import (
    SCHEMA_VERSION,
    CopyHealth,
    Key,
    ModelError,
    Project,
    Region,
    Value,
    copy_key,
    project_key,
    region_key,
)
from region_agent.state.store import Entry, OwnershipError, Store, Version, entry_from_json, entry_to_json

WALL_MS = ManualClock().wall_ms()  # where every store's clock starts


def _store(writer: str = "sfo1/me", wall: ManualClock | None = None,
           ttl: float = 60.0) -> tuple[Store, CollectorRegistry]:
    registry = CollectorRegistry()
    clock = HybridClock((wall or ManualClock()).wall_ms)
    return Store(writer=writer, clock=clock, tombstone_ttl=ttl, control_tombstone_ttl=ttl, registry=registry), registry


def _rejected(registry: CollectorRegistry, reason: str) -> float:
    value = registry.get_sample_value("region_agent_state_merge_rejected_total", {"reason": reason})
    assert value is not None
    return value


def _entry(key: Key, value: Value | None, writer: str, ms: int = WALL_MS - 1000) -> Entry:
    return Entry(key, value, Version(pack(ms), writer))


GOOD = [
    _entry(project_key("shop"), Project("shop", ("sfo1", "ams1")), "control/api"),
    _entry(region_key("ams1"), Region("ams1", ipv4=("192.0.2.2",)), "control/api"),
    _entry(copy_key("shop", "ams1"), CopyHealth(True), "ams1/n1"),
]

# (entry, reason): each must be refused by a store of writer sfo1/me, whatever else is in the batch.
BAD = [
    (_entry(copy_key("shop", "ams1"), CopyHealth(False, "forged"), "sfo1/n2"), "not-owner"),
    (_entry(copy_key("shop", "sfo1"), CopyHealth(False, "forged"), "standalone/laptop"), "standalone-writer"),
    (_entry(project_key("shop"), None, "standalone/laptop"), "standalone-writer"),
    (_entry(region_key("sfo1"), Region("sfo1"), "sfo1/n2"), "not-owner"),
    (_entry(project_key("blog"), Project("blog", ("sfo1",)), "ams1/n1"), "not-owner"),
    (_entry(project_key("blog"), Project("blog", ("sfo1",)), "control"), "bad-writer"),
    (_entry(project_key("blog"), Project("blog", ("sfo1",)), "mars/n1"), "bad-writer"),
    (_entry(("acme", "x"), None, "control/api"), "bad-key"),
    (_entry(project_key("blog"), Project("shop", ("sfo1",)), "control/api"), "bad-value"),
    (_entry(copy_key("blog", "sfo1"), Region("sfo1"), "sfo1/n2"), "bad-value"),
    (_entry(project_key("blog"), Project("blog", ("sfo1",)), "control/api", ms=WALL_MS + 3_600_000), "clock-drift"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD, ids=[f"{r}-{i}" for i, (_, r) in enumerate(BAD)])
def test_a_bad_entry_is_refused_counted_and_the_rest_applies(bad: Entry, reason: str) -> None:
    store, registry = _store()
    heard: list[list[Entry]] = []
    store.subscribe(heard.append)
    result = store.merge([GOOD[0], bad, *GOOD[1:]])
    assert [(r.entry, r.reason.value) for r in result.rejected] == [(bad, reason)]
    assert result.applied == GOOD
    assert heard == [GOOD]  # once, with exactly what applied
    assert _rejected(registry, reason) == 1
    assert store.entry(bad.key) in (None, *GOOD)  # the refused version is nowhere


def test_a_batch_of_only_bad_entries_changes_nothing_and_notifies_nobody() -> None:
    store, registry = _store()
    heard: list[list[Entry]] = []
    store.subscribe(heard.append)
    before = store.digest()
    result = store.merge([bad for bad, _ in BAD])
    assert len(result.rejected) == len(BAD) and result.applied == []
    assert heard == [] and store.digest() == before and len(store) == 0
    assert _rejected(registry, "standalone-writer") == 2


def test_merge_applies_one_winner_per_key_and_reports_stale_entries() -> None:
    store, _ = _store()
    old = _entry(copy_key("shop", "ams1"), CopyHealth(False, "x"), "ams1/n1", ms=WALL_MS - 5000)
    new = _entry(copy_key("shop", "ams1"), CopyHealth(True), "ams1/n2", ms=WALL_MS - 4000)
    heard: list[list[Entry]] = []
    store.subscribe(heard.append)
    assert store.merge([new, old]).applied == [new]
    assert heard == [[new]]
    result = store.merge([old])
    assert result.applied == [] and result.stale == 1 and heard == [[new]]


def test_a_standalone_store_accepts_no_peer_entries_of_another_standalone_agent() -> None:
    store, _ = _store("standalone/a")
    other = _entry(project_key("shop"), Project("shop", ("sfo1",)), "standalone/b")
    assert [r.reason.value for r in store.merge([other]).rejected] == ["standalone-writer"]
    assert store.get(project_key("shop")) is None


def test_put_many_notifies_once_and_skips_equal_values() -> None:
    store, _ = _store("standalone/me")
    heard: list[list[Entry]] = []
    store.subscribe(heard.append)
    items: list[tuple[Key, Value | None]] = [(project_key(f"p{i}"), Project(f"p{i}", ("sfo1",))) for i in range(5)]
    assert len(store.put_many(items)) == 5
    changed = store.put_many([*items[:4], (project_key("p4"), None), (project_key("p9"), None)])
    assert [e.key for e in changed] == [project_key("p4")]  # p0..p3 equal, p9 never existed
    assert [len(batch) for batch in heard] == [5, 1]


def test_put_many_takes_the_last_value_of_a_key_given_twice() -> None:
    store, _ = _store("standalone/me")
    changed = store.put_many([(project_key("p"), Project("p", ("sfo1",))), (project_key("p"), Project("p", ("ams1",)))])
    assert len(changed) == 1 and store.get(project_key("p")) == Project("p", ("ams1",))


@pytest.mark.parametrize(("writer", "item", "error"), [
    ("sfo1/me", (copy_key("shop", "ams1"), CopyHealth(True)), OwnershipError),
    ("sfo1/me", (project_key("shop"), Project("shop", ("sfo1",))), OwnershipError),
    ("control/me", (project_key("shop"), Project("blog", ("sfo1",))), ModelError),
    ("control/me", (("nope", "x"), None), ModelError),
])
def test_put_many_is_all_or_nothing(writer: str, item: tuple[Key, Value | None], error: type[Exception]) -> None:
    store, _ = _store(writer)
    heard: list[list[Entry]] = []
    store.subscribe(heard.append)
    first = (project_key("ok"), Project("ok", ("sfo1",))) if writer.startswith("control") else (
        copy_key("ok", "sfo1"), CopyHealth(True))
    with pytest.raises(error):
        store.put_many([first, item])
    assert len(store) == 0 and heard == []


def test_a_store_needs_a_writer_id_with_a_role() -> None:
    with pytest.raises(ModelError):
        Store(writer="laptop", clock=HybridClock(ManualClock().wall_ms))


# --- schema version ----------------------------------------------------------------------

def test_entries_are_encoded_with_the_schema_version() -> None:
    encoded = entry_to_json(GOOD[0])
    assert encoded["v"] == SCHEMA_VERSION
    assert entry_from_json(encoded) == GOOD[0]


@pytest.mark.parametrize("version", [None, 0, 1, 3, "2", True, 2.5])
def test_unknown_schema_versions_are_refused(version: object) -> None:
    encoded = entry_to_json(GOOD[0])
    if version is None:
        del encoded["v"]
    else:
        encoded["v"] = version
    with pytest.raises(ModelError, match="schema version"):
        entry_from_json(encoded)


# --- tombstones ----------------------------------------------------------------------------

def test_tombstones_expire_after_the_ttl_by_the_store_clock() -> None:
    wall = ManualClock()
    store, registry = _store("standalone/me", wall, ttl=60)
    store.put_many([(project_key("a"), Project("a", ("sfo1",))), (project_key("b"), Project("b", ("sfo1",)))])
    store.put_many([(project_key("a"), None), (project_key("b"), None)])
    wall.advance(30)
    store.put(project_key("b"), Project("b", ("ams1",)))  # a write over a tombstone: no longer one
    assert store.expire_tombstones() == 0
    wall.advance(31)
    assert store.expire_tombstones() == 1
    assert store.entry(project_key("a")) is None and store.get(project_key("b")) is not None
    assert registry.get_sample_value("region_agent_state_tombstones_expired_total") == 1
    assert registry.get_sample_value("region_agent_state_tombstones") == 0


def test_expiry_leaves_the_digest_equal_to_a_store_that_never_saw_the_key() -> None:
    wall = ManualClock()
    store, _ = _store("control/me", wall, ttl=60)
    fresh, _ = _store("control/other", wall, ttl=60)
    keep = _entry(project_key("keep"), Project("keep", ("sfo1",)), "control/api")
    store.merge([keep, _entry(project_key("gone"), None, "control/api")])
    fresh.merge([keep])
    assert store.digest() != fresh.digest()
    wall.advance(61)
    store.expire_tombstones()
    assert store.digest() == fresh.digest()
