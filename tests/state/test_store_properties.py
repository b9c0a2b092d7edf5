"""A property of the replicated store: whatever the writes, deletes, clock skews within the bound, sync
order, tombstone expiry and absences shorter than the horizon, replicas that have all synced hold one
digest, compile one zone, and no delete comes back.

Three to five replicas, each an agent with its own clock (skewed up to ±500 ms from the others) taking
control writes in its own name. Each step is a write, a delete, a sync between two replicas (both
ways, in either order), time passing, or a tombstone sweep at one replica. A replica is never left
unsynced for more than a third of the tombstone horizon (the operational rule: an agent away longer
is rebuilt, not rejoined). At the end every pair syncs; the truth is last-writer-wins over every
operation made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from region_agent.globaldns.compiler import ZoneConfig, compile_zone
from region_agent.state.hlc import HybridClock
from region_agent.state.model import Key, Project, Region, project_key, region_key
from region_agent.state.store import Store, Version

HORIZON_MS = 20_000
SLUGS = ("shop", "blog", "docs", "mail")
REGIONS = ("sfo1", "ams1", "fra1")


@dataclass
class Replica:
    store: Store
    skew_ms: int
    last_sync_ms: int = 0


@dataclass
class World:
    now_ms: int = 1_800_000_000_000
    replicas: list[Replica] = field(default_factory=list)
    truth: dict[Key, tuple[Version, object]] = field(default_factory=dict)

    def add(self, index: int, skew_ms: int) -> None:
        wall = lambda skew=skew_ms: self.now_ms + skew  # noqa: E731 - each replica reads its own clock
        store = Store(writer=f"{REGIONS[index % 3]}/n{index}", clock=HybridClock(wall),
                      tombstone_ttl=HORIZON_MS / 1000, control_tombstone_ttl=HORIZON_MS / 1000)
        self.replicas.append(Replica(store, skew_ms))

    def write(self, index: int, slug: str, regions: tuple[str, ...] | None) -> None:
        replica = self.replicas[index]
        writer = f"control/{REGIONS[index % 3]}.n{index}"
        value = None if regions is None else Project(slug, regions)
        for entry in replica.store.put_many([(project_key(slug), value)], writer=writer):
            best = self.truth.get(entry.key)
            if best is None or entry.version > best[0]:
                self.truth[entry.key] = (entry.version, entry.value)

    def sync(self, a: int, b: int) -> None:
        first, second = self.replicas[a], self.replicas[b]
        second.store.merge(first.store.entries())
        first.store.merge(second.store.entries())
        first.last_sync_ms = second.last_sync_ms = self.now_ms

    def advance(self, ms: int, away: int | None = None) -> None:
        """Time passes; every replica sweeps its tombstones, as the agents do. ``away`` did not sync."""
        self.now_ms += ms
        # The operational rule: nobody stays away a third of the horizon; a neighbour syncs with it.
        for i, replica in enumerate(self.replicas):
            if i != away and self.now_ms - replica.last_sync_ms > HORIZON_MS // 3:
                self.sync(i, (i + 1) % len(self.replicas) if (i + 1) % len(self.replicas) != away else (i + 2) %
                          len(self.replicas))
        for replica in self.replicas:
            replica.store.expire_tombstones(self.now_ms + replica.skew_ms)


operation = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 4), st.sampled_from(SLUGS),
              st.lists(st.sampled_from(REGIONS), min_size=1, max_size=3, unique=True).map(tuple)),
    st.tuples(st.just("delete"), st.integers(0, 4), st.sampled_from(SLUGS)),
    st.tuples(st.just("sync"), st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("time"), st.integers(1, 15_000)),
    st.tuples(st.just("away"), st.integers(0, 4), st.integers(1, HORIZON_MS // 3)),   # a short absence
    st.tuples(st.just("expire"), st.integers(0, 4)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(count=st.integers(3, 5), skews=st.lists(st.integers(-500, 500), min_size=5, max_size=5),
       steps=st.lists(operation, max_size=60))
def test_synced_replicas_agree_and_no_delete_comes_back(count: int, skews: list[int],
                                                        steps: list[tuple[object, ...]]) -> None:
    world = World()
    for i in range(count):
        world.add(i, skews[i])
    base = [(region_key(r), Region(r, ipv4=(f"192.0.2.{n + 1}",))) for n, r in enumerate(REGIONS)]
    world.replicas[0].store.put_many(base, writer="control/sfo1.n0")
    for i in range(1, count):
        world.sync(0, i)
    for step in steps:
        match step:
            case ("write", int(i), str(slug), tuple(regions)):
                world.write(i % count, slug, regions)
            case ("delete", int(i), str(slug)):
                world.write(i % count, slug, None)
            case ("sync", int(a), int(b)) if a % count != b % count:
                world.sync(a % count, b % count)
            case ("time", int(ms)):
                world.advance(ms)
            case ("away", int(i), int(ms)):
                world.advance(ms, away=i % count)
            case ("expire", int(i)):
                replica = world.replicas[i % count]
                replica.store.expire_tombstones(world.now_ms + replica.skew_ms)
    for _ in range(2):   # everyone with everyone, twice: anti-entropy converged
        for a in range(count):
            for b in range(a + 1, count):
                world.sync(a, b)
    stores = [r.store for r in world.replicas]
    assert len({s.digest() for s in stores}) == 1
    zones = [compile_zone(s.snapshot(), ZoneConfig("g.example.com")) for s in stores]
    assert len({z.serial for z in zones}) == 1
    assert len({tuple(sorted(z.nodes)) for z in zones}) == 1
    for key, (_version, value) in world.truth.items():
        for store in stores:
            assert store.get(key) == value, (key, value, store.get(key))   # a delete stays deleted
