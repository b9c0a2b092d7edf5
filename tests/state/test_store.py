"""The replicated store: merge order independence, ownership, tombstones, digest."""

from __future__ import annotations

import itertools
import random

import pytest

from region_agent.base.clock import ManualClock
from region_agent.state.hlc import ClockDriftError, HybridClock, pack, physical_ms
from region_agent.state.model import (
    CopyHealth,
    ModelError,
    Project,
    Region,
    copy_key,
    may_write,
    owner_of,
    project_key,
    region_key,
)
from region_agent.state.store import (
    Entry,
    OwnershipError,
    Store,
    Version,
    dumps_entries,
    entry_from_json,
    entry_to_json,
)


def make_store(writer: str) -> Store:
    return Store(writer=writer, clock=HybridClock(ManualClock().wall_ms))


def test_hlc_is_monotonic_when_the_wall_clock_steps_back() -> None:
    wall = ManualClock()
    clock = HybridClock(wall.wall_ms)
    first = clock.now()
    wall.step_wall(-5)
    second = clock.now()
    assert second > first
    assert physical_ms(second) == physical_ms(first)


def test_hlc_moves_past_observed_remote_time() -> None:
    wall = ManualClock()
    clock = HybridClock(wall.wall_ms)
    remote = pack(wall.wall_ms() + 1000, 7)
    clock.observe(remote)
    assert clock.now() > remote


def test_hlc_refuses_a_remote_clock_far_in_the_future() -> None:
    wall = ManualClock()
    with pytest.raises(ClockDriftError):
        HybridClock(wall.wall_ms).observe(pack(wall.wall_ms() + 3_600_000))


@pytest.mark.parametrize(
    ("writer", "key", "allowed"),
    [
        ("sfo1/node-a", copy_key("shop", "sfo1"), True),
        ("sfo1/node-a", copy_key("shop", "ams1"), False),
        ("sfo1/node-a", region_key("sfo1"), False),  # regions are platform configuration
        ("control/api-1", region_key("sfo1"), True),
        ("sfo1/node-a", project_key("shop"), False),
        ("control/api-1", project_key("shop"), True),
        ("control/api-1", copy_key("shop", "sfo1"), False),
        ("standalone/laptop", copy_key("shop", "ams1"), True),
        ("standalone/laptop", project_key("shop"), True),
    ],
)
def test_ownership(writer: str, key: tuple[str, ...], allowed: bool) -> None:
    assert may_write(writer, key) is allowed


def test_owner_of_names_the_role() -> None:
    assert owner_of(copy_key("shop", "ams1")) == "region:ams1"
    assert owner_of(project_key("shop")) == "control"


def test_local_write_to_a_foreign_key_is_refused_and_changes_nothing() -> None:
    store = make_store("sfo1/a")
    with pytest.raises(OwnershipError):
        store.put(copy_key("shop", "ams1"), CopyHealth(True))
    assert len(store) == 0


def test_equal_write_makes_no_new_version() -> None:
    store = make_store("sfo1/a")
    assert store.put(copy_key("shop", "sfo1"), CopyHealth(True)) is not None
    assert store.put(copy_key("shop", "sfo1"), CopyHealth(True)) is None
    assert store.put(copy_key("shop", "sfo1"), CopyHealth(False, "down")) is not None


def _entries() -> list[Entry]:
    """Writes of two regions and the control plane, including conflicting versions."""
    region = Region("sfo1", ipv4=("192.0.2.1",))
    return [
        Entry(project_key("shop"), Project("shop", ("sfo1", "ams1")), Version(pack(100), "control/a")),
        Entry(project_key("shop"), Project("shop", ("sfo1", "ams1"), primary="ams1"), Version(pack(200), "control/b")),
        Entry(project_key("shop"), None, Version(pack(150), "control/a")),
        Entry(region_key("sfo1"), region, Version(pack(100), "control/a")),
        Entry(copy_key("shop", "sfo1"), CopyHealth(True), Version(pack(300), "sfo1/n1")),
        # Same HLC from two agents of one region: the writer id breaks the tie.
        Entry(copy_key("shop", "sfo1"), CopyHealth(False, "x"), Version(pack(300), "sfo1/n2")),
        Entry(copy_key("shop", "ams1"), CopyHealth(False, "down"), Version(pack(50), "ams1/n1")),
    ]


def test_merge_converges_whatever_the_order() -> None:
    entries = _entries()
    results = set()
    for order in itertools.islice(itertools.permutations(entries), 0, 5040, 97):
        store = make_store("control/x")
        for entry in order:
            store.merge([entry])
        snapshot = store.snapshot()
        results.add((store.digest(), tuple(sorted((k, str(v)) for k, v in snapshot.projects.items())),
                     tuple(sorted(snapshot.copies.items()))))
    assert len(results) == 1
    (_digest, projects, copies), = results
    assert projects == (("shop", str(Project("shop", ("sfo1", "ams1"), primary="ams1"))),)
    assert dict(copies)[("shop", "sfo1")] == CopyHealth(False, "x")  # "sfo1/n2" > "sfo1/n1"


def test_merge_ignores_stale_and_duplicate_entries() -> None:
    store = make_store("control/x")
    entries = _entries()
    assert store.merge(entries).applied
    before = store.digest()
    again = store.merge(entries)
    assert again.applied == [] and again.rejected == []
    assert again.stale == 4  # one winner per key: project, region, two copies
    assert store.digest() == before


def test_merge_refuses_an_entry_from_a_writer_that_does_not_own_the_key() -> None:
    store = make_store("sfo1/a")
    forged = Entry(copy_key("shop", "sfo1"), CopyHealth(False, "forged"), Version(pack(10), "ams1/evil"))
    result = store.merge([forged])
    assert [(r.entry, r.reason.value) for r in result.rejected] == [(forged, "not-owner")]
    assert store.get(copy_key("shop", "sfo1")) is None


def test_digest_is_equal_iff_contents_are_equal_and_updates_incrementally() -> None:
    a, b = make_store("control/a"), make_store("control/b")
    entries = _entries()
    shuffled = entries[:]
    random.Random(4).shuffle(shuffled)
    a.merge(entries)
    b.merge(shuffled)
    assert a.digest() == b.digest()
    assert a.bucket_digests() == b.bucket_digests()
    b.merge([Entry(region_key("ams1"), Region("ams1"), Version(pack(999), "control/n1"))])
    assert a.digest() != b.digest()
    differing = [i for i, (x, y) in enumerate(zip(a.bucket_digests(), b.bucket_digests(), strict=True)) if x != y]
    assert [e.key for e in b.entries_in_buckets(differing) if e.key not in {x.key for x in a.entries()}] == [
        region_key("ams1")
    ]
    a.merge(b.entries_in_buckets(differing))
    assert a.digest() == b.digest()


def test_tombstones_hide_values_and_expire_after_the_ttl() -> None:
    wall = ManualClock()
    store = Store(writer="control/a", clock=HybridClock(wall.wall_ms), tombstone_ttl=60, control_tombstone_ttl=60)
    store.put(project_key("shop"), Project("shop", ("sfo1",)))
    store.delete(project_key("shop"))
    assert store.get(project_key("shop")) is None
    assert store.snapshot().projects == {}
    store.put(project_key("blog"), Project("blog", ("sfo1",)))   # the tombstone is not the newest entry
    assert store.expire_tombstones(wall.wall_ms() + 59_000) == 0
    assert len(store) == 2
    assert store.expire_tombstones(wall.wall_ms() + 61_000) == 1
    assert len(store) == 1


def test_the_newest_entry_never_expires_so_the_serial_never_goes_back() -> None:
    """A delete that is the last change of a quiet zone: expiring it would turn the serial back (here, and in
    every snapshot saved after), and agents with equal digests would answer different serials."""
    wall = ManualClock()
    store = Store(writer="control/a", clock=HybridClock(wall.wall_ms), tombstone_ttl=60, control_tombstone_ttl=60)
    store.put(project_key("shop"), Project("shop", ("sfo1",)))
    store.put(project_key("blog"), Project("blog", ("sfo1",)))
    store.delete(project_key("shop"))
    newest = store.newest_hlc
    assert store.expire_tombstones(wall.wall_ms() + 61_000) == 0
    assert store.newest_hlc == newest and len(store) == 2
    store.put(project_key("docs"), Project("docs", ("sfo1",)))   # now something newer holds the serial
    assert store.expire_tombstones(wall.wall_ms() + 61_000) == 1
    rebuilt = Store(writer="control/b", clock=HybridClock(wall.wall_ms))
    rebuilt.merge(store.entries())
    assert rebuilt.newest_hlc == store.newest_hlc and rebuilt.digest() == store.digest()


def test_a_late_older_write_does_not_resurrect_a_deleted_key() -> None:
    store = make_store("control/x")
    store.merge([Entry(project_key("shop"), None, Version(pack(200), "control/a"))])
    store.merge([Entry(project_key("shop"), Project("shop", ("sfo1",)), Version(pack(100), "control/b"))])
    assert store.get(project_key("shop")) is None


def test_listeners_hear_every_change_once() -> None:
    store = make_store("control/x")
    heard: list[list[Entry]] = []
    unsubscribe = store.subscribe(heard.append)
    store.put(project_key("shop"), Project("shop", ("sfo1",)))
    store.merge(_entries())
    store.merge(_entries())  # nothing new
    unsubscribe()
    store.delete(project_key("shop"))
    # The local put is newer than the batch's project versions; of the two versions of
    # copy shop/sfo1 only the winner is heard.
    assert [len(batch) for batch in heard] == [1, 3]
    assert {e.key for e in heard[1]} == {region_key("sfo1"), copy_key("shop", "sfo1"), copy_key("shop", "ams1")}


def test_json_round_trip_and_validation() -> None:
    for entry in _entries():
        assert entry_from_json(entry_to_json(entry)) == entry
    assert dumps_entries(_entries()[:1]).startswith(b"[{")
    for bad, message in [
        ({"key": ["nope", "x"], "value": None, "hlc": 1, "writer": "control/a"}, "unknown key"),
        ({"key": ["region", "sfo1"], "value": {"name": "ams1"}, "hlc": 1, "writer": "sfo1/a"}, "names another key"),
        ({"key": ["region", "sfo1"], "value": {"name": "sfo1", "ipv4": ["not-an-ip"]}, "hlc": 1, "writer": "x"},
         "not an IP address"),
        ({"key": ["copy", "shop"], "value": None, "hlc": 1, "writer": "x"}, "must be 3 strings"),
        ({"key": ["project", "shop"], "value": None, "hlc": -1, "writer": "x"}, "non-negative"),
        ({"key": ["project", "shop"], "value": None, "writer": "x"}, "lacks 'hlc'"),
    ]:
        with pytest.raises(ModelError, match=message):
            entry_from_json({"v": 2, **bad})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"slug": "Shop", "regions": ("sfo1",)}, "slug"),
        ({"slug": "shop", "regions": ()}, "regions must not be empty"),
        ({"slug": "shop", "regions": ("sfo",)}, "region name"),
        ({"slug": "shop", "regions": ("sfo1", "sfo1")}, "twice"),
        ({"slug": "shop", "regions": ("sfo1",), "primary": "ams1"}, "primary"),
    ],
)
def test_project_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Project(**kwargs)  # type: ignore[arg-type]


def test_region_validation() -> None:
    with pytest.raises(ModelError, match="ipv4"):
        Region("sfo1", ipv4=("2001:db8::1",))
    with pytest.raises(ModelError, match="latitude"):
        Region("sfo1", latitude=91.0, longitude=0.0)
    assert Region("sfo1", ipv6=("2001:DB8::1",)).ipv6 == ("2001:db8::1",)
