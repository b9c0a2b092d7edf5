"""Anti-entropy between real stores, the streams replaced by an in-memory hop on the event loop."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import pytest
from prometheus_client import CollectorRegistry

from region_agent.app.replication import StoreReplica
from region_agent.gossip.messages import Address, Sync, SyncPhase, decode, encode
from region_agent.gossip.sync import AntiEntropy, _Round
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, Region, copy_key, project_key, region_key
from region_agent.state.store import Entry, Store, Version
from tests.conftest import wait_for


class Net:
    """Delivers encoded sync messages between nodes on the next loop turn; counts them by phase."""

    def __init__(self) -> None:
        self.nodes: dict[Address, AntiEntropy] = {}
        self.sent: Counter[str] = Counter()
        self.bytes = 0

    def sender(self, me: Address):  # type: ignore[no-untyped-def]
        def send(to: Address, data: bytes) -> None:
            message = decode(data)
            assert isinstance(message, Sync)
            self.sent[message.phase.name] += 1
            self.bytes += len(data)
            asyncio.get_running_loop().call_soon(self.nodes[to].receive, message, me)
        return send


def _store(writer: str) -> Store:
    return Store(writer=writer, clock=HybridClock(lambda: int(time.time() * 1000)))


def _node(net: Net, index: int, store: Store, *, budget: int = 4 << 20) -> tuple[AntiEntropy, Address]:
    addr = Address(f"127.0.0.{index}", 7946)
    node = AntiEntropy(name=f"sfo1/n{index}", replica=StoreReplica(store, CollectorRegistry()),
                       send=net.sender(addr), peers=lambda: [], interval=60.0, rng=random.Random(index),
                       budget=budget)
    net.nodes[addr] = node
    return node, addr


def _control_entries(count: int, *, start_ms: int) -> list[Entry]:
    entries = [Entry(region_key("sfo1"), Region("sfo1", ipv4=("192.0.2.1",)), Version(start_ms << 16, "control/api"))]
    entries += [Entry(project_key(f"p{i:05d}"), Project(f"p{i:05d}", ("sfo1",)), Version((start_ms + i) << 16,
                                                                                          "control/api"))
                for i in range(count)]
    return entries


async def test_stores_in_sync_exchange_two_small_messages_and_nothing_else() -> None:
    net = Net()
    a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    entries = _control_entries(50, start_ms=int(time.time() * 1000) - 60_000)
    a_store.merge(entries)
    b_store.merge(entries)
    a, _ = _node(net, 1, a_store)
    _, b_addr = _node(net, 2, b_store)
    a.start_round(b_addr)
    await wait_for(lambda: a.stats.rounds["in_sync"] == 1, timeout=5, message="round done")
    assert dict(net.sent) == {"OFFER": 1, "DIGESTS": 1}
    assert net.bytes < 200
    assert a.synced.is_set() and a.peer_digests["sfo1/n2"].digest == a_store.digest()


async def test_a_round_repairs_both_sides_with_only_the_differing_buckets() -> None:
    net = Net()
    now_ms = int(time.time() * 1000)
    a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    shared = _control_entries(2_000, start_ms=now_ms - 60_000)
    a_store.merge(shared)
    b_store.merge(shared)
    a_store.put(copy_key("p00001", "sfo1"), CopyHealth(True))          # only A knows it
    b_store.put(copy_key("p00002", "ams1"), CopyHealth(False, "down"))  # only B knows it
    newer = Entry(project_key("p00003"), Project("p00003", ("sfo1", "ams1")), Version((now_ms - 1000) << 16,
                                                                                      "control/api"))
    b_store.merge([newer])                                                # B has a newer version
    a, _ = _node(net, 1, a_store)
    _, b_addr = _node(net, 2, b_store)
    a.start_round(b_addr)
    await wait_for(lambda: a.stats.rounds["repaired"] == 1, timeout=5, message="round done")
    assert a_store.digest() == b_store.digest()
    assert b_store.copies[("p00001", "sfo1")] == CopyHealth(True)
    assert a_store.projects["p00003"].regions == ("sfo1", "ams1")
    # Three differing buckets of 256, about 8 entries each: a few dozen entries moved, not 2,000.
    assert a.stats.entries_sent + net.nodes[b_addr].stats.entries_sent < 100
    assert dict(net.sent) == {"OFFER": 1, "DIGESTS": 1, "ENTRIES": 1, "FINAL": 1}


async def test_a_large_catch_up_moves_in_budgeted_rounds_and_converges() -> None:
    net = Net()
    a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    a_store.merge(_control_entries(5_000, start_ms=int(time.time() * 1000) - 60_000))   # B restarted empty
    a, _ = _node(net, 1, a_store, budget=64 * 1024)
    b, b_addr = _node(net, 2, b_store, budget=64 * 1024)
    a.start_round(b_addr)
    await wait_for(lambda: a_store.digest() == b_store.digest() and not a._rounds and not a._tasks and not b._tasks,
                   timeout=20, message="converged")
    assert len(b_store.projects) == 5_000
    # Each ENTRIES message stayed near the budget: whole buckets, at least one per message.
    assert net.sent["ENTRIES"] > 5, net.sent
    assert a.stats.rounds["repaired"] + a.stats.rounds["exchanged"] == net.sent["FINAL"]


async def test_an_owner_is_enforced_a_forged_entry_changes_nothing_and_the_rest_applies() -> None:
    net = Net()
    now_ms = int(time.time() * 1000)
    a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    a_store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    forged = Entry(copy_key("shop", "sfo1"), CopyHealth(False, "forged"), Version((now_ms + 10) << 16, "ams1/b"))
    b_store._apply(forged)  # a buggy or hostile peer holds an entry it may not write
    b_store.merge(_control_entries(3, start_ms=now_ms - 1000))
    a, _ = _node(net, 1, a_store)
    _, b_addr = _node(net, 2, b_store)
    a.start_round(b_addr)
    await wait_for(lambda: "FINAL" in net.sent, timeout=5, message="round done")
    await wait_for(lambda: not net.nodes[b_addr]._tasks and not a._tasks, timeout=5, message="merges done")
    assert a_store.copies[("shop", "sfo1")] == CopyHealth(True)
    assert len(a_store.projects) == 3
    assert a_store.metrics.rejected.labels("not-owner")._value.get() == 1


async def test_steps_of_unknown_rounds_are_ignored_and_sessions_are_bounded() -> None:
    net = Net()
    a, _ = _node(net, 1, _store("sfo1/a"))
    peer = Address("127.0.0.9", 1)
    a.receive(Sync(SyncPhase.FINAL, 12345, "x/y", entries=(b"{}",)), peer)
    a.receive(Sync(SyncPhase.DIGESTS, 12345, "x/y", digest=b"\x00" * 16), peer)
    await wait_for(lambda: a.stats.rounds["unknown"] == 2 and not a._tasks, timeout=5, message="ignored")
    net.nodes[peer] = a  # replies go back to a, which ignores them as unknown rounds
    for _ in range(10):   # more than max_sessions (4) at once: the rest are dropped, counted
        a.receive(Sync(SyncPhase.OFFER, 1, "x/y", digest=b"\x01" * 16), peer)
    assert a.stats.rounds["busy"] == 6
    # The four replies come back to a: each ignored as an unknown round, or dropped as busy.
    await wait_for(lambda: a.stats.rounds["unknown"] + a.stats.rounds["busy"] == 2 + 6 + 4 and not a._tasks,
                   timeout=5, message="replies handled")


@pytest.mark.parametrize("data", [
    encode(Sync(SyncPhase.ENTRIES, 7, "sfo1/n1", buckets=((3, b"\x00" * 16),), entries=(b"x",), more=True)),
])
def test_sync_messages_round_trip_and_truncations_are_malformed(data: bytes) -> None:
    from region_agent.gossip.messages import MessageError

    message = decode(data)
    assert isinstance(message, Sync) and message.more and message.buckets == ((3, b"\x00" * 16),)
    for cut in range(len(data)):
        with pytest.raises(MessageError):
            decode(data[:cut])
    with pytest.raises(MessageError):
        Sync(SyncPhase.OFFER, 1, "sfo1/n1", digest=b"short")


async def test_crossing_offers_run_one_round_and_a_busy_peer_defers_the_second() -> None:
    net = Net()
    a_store, b_store = _store("sfo1/a"), _store("ams1/b")
    a_store.merge(_control_entries(3_000, start_ms=int(time.time() * 1000) - 60_000))   # B joins empty
    a, a_addr = _node(net, 1, a_store)   # name sfo1/n1 < sfo1/n2: a yields when offers cross
    b, b_addr = _node(net, 2, b_store)
    a.start_round(b_addr)
    b.start_round(a_addr)
    await wait_for(lambda: a_store.digest() == b_store.digest() and not a._rounds and not b._rounds
                   and not a._tasks and not b._tasks, timeout=10, message="converged")
    assert a.stats.rounds["yielded"] == 1
    assert net.sent["ENTRIES"] == 1 and net.sent["FINAL"] == 1   # the 3,000 entries crossed once
    # While b's round with a is under way, a's new offer is answered "busy" and a defers: no entries move.
    a_store.put_many([(project_key("late"), Project("late", ("sfo1",)))], writer="control/api")
    b._rounds[999] = _Round(a_addr, time.monotonic(), 0, answered=True)
    a.start_round(b_addr)
    await wait_for(lambda: a.stats.rounds["deferred"] == 1 and not a._rounds and not a._tasks and not b._tasks,
                   timeout=5, message="a deferred")
    assert net.sent["ENTRIES"] == 1 and b_store.digest() != a_store.digest()
    del b._rounds[999]
    a.start_round(b_addr)   # the next periodic round repairs it
    await wait_for(lambda: a_store.digest() == b_store.digest(), timeout=5, message="repaired")


# --- pull-only rejoin ------------------------------------------------------------------------


def _away_scene(count: int) -> tuple[Store, Store, Store, int]:
    """A (away a month) holds every project; B and C deleted p00007 meanwhile, the tombstone expired
    (31 days), and B wrote p99999 since. Returns the stores and the wall ms of "now"."""
    now_ms = int(time.time() * 1000)
    month = 31 * 86_400_000
    stores = [_store(w) for w in ("sfo1/a", "ams1/b", "fra1/c")]
    shared = _control_entries(count, start_ms=now_ms - month - 3_600_000)
    for store in stores:
        store.merge(shared)
    a, b, c = stores
    for store in (b, c):
        store.merge([Entry(project_key("p00007"), None, Version((now_ms - month) << 16, "control/api")),
                     Entry(project_key("p99999"), Project("p99999", ("sfo1",)), Version((now_ms - 1000) << 16,
                                                                                         "control/api"))])
        assert store.expire_tombstones(now_ms) == 1 and store.entry(project_key("p00007")) is None
    return a, b, c, now_ms


async def test_a_plain_round_with_an_agent_away_beyond_the_horizon_brings_a_delete_back() -> None:
    """Why pull-only exists: the same scene, synced the ordinary way, resurrects the project."""
    net = Net()
    a_store, b_store, _, _ = _away_scene(40)
    a, _ = _node(net, 1, a_store)
    _, b_addr = _node(net, 2, b_store)
    a.start_round(b_addr)
    await wait_for(lambda: a_store.digest() == b_store.digest(), timeout=5, message="converged")
    assert "p00007" in b_store.projects


@pytest.mark.parametrize("budget", [4 << 20, 100])
async def test_an_agent_away_beyond_the_horizon_rejoins_pull_only_and_brings_nothing_back(budget: int) -> None:
    net = Net()
    a_store, b_store, c_store, _ = _away_scene(40)
    a, a_addr = _node(net, 1, a_store, budget=budget)
    b, b_addr = _node(net, 2, b_store, budget=budget)
    c, _ = _node(net, 3, c_store, budget=budget)
    for peer in (b, c):
        peer.synced.set()   # they have been syncing with each other all along
    told: list[bool] = []
    a.on_pull_only = told.append
    a._peers = lambda: [b_addr]
    a.absent_limit = 60.0
    a._check_absence()
    assert told == [], "fresh: nothing happens"
    a.last_fresh = time.monotonic() - 61   # no fresh round for longer than the limit
    a._check_absence()
    assert told == [True] and a.pull_only
    # Meanwhile C offers A an ordinary round: A answers busy, nothing of A's reaches C.
    c.start_round(a_addr)
    await wait_for(lambda: c.stats.rounds["deferred"] == 1, timeout=5, message="busy")
    assert "p00007" not in c_store.projects and a.stats.entries_sent == 0
    a.start_round(b_addr)
    await wait_for(lambda: not a.pull_only, timeout=20, message="pulled")
    await wait_for(lambda: a_store.digest() == b_store.digest(), timeout=5, message="converged")
    assert "p00007" not in a_store.projects and "p99999" in a_store.projects
    assert "p00007" not in b_store.projects and b.stats.entries_received == 0, "a pull sends nothing"
    assert told == [True, False] and a.stats.entries_dropped == 1
    if budget < 4 << 20:
        assert a.stats.rounds["pulled"] > 1, "a small budget pulls in several rounds"
    # Fresh again: an ordinary round with C is in sync.
    a.start_round(Address("127.0.0.3", 7946))
    await wait_for(lambda: a.stats.rounds["in_sync"] == 1, timeout=5, message="in sync with C")


async def test_two_agents_both_away_answer_each_others_pull() -> None:
    """Every agent away that long: nobody holds better state, so a pull-only peer answers a pull."""
    net = Net()
    a_store, b_store, _, _ = _away_scene(10)
    a, _ = _node(net, 1, a_store)
    b, b_addr = _node(net, 2, b_store)
    for node in (a, b):
        node.synced.set()   # both were in the cluster before they were cut off
        node._peers = lambda: [b_addr]   # someone to pull from
        node.absent_limit, node.last_fresh = 60.0, time.monotonic() - 61
        node._check_absence()
    a.start_round(b_addr)
    await wait_for(lambda: not a.pull_only, timeout=5, message="a pulled from b")
    assert a_store.digest() == b_store.digest() and b.pull_only


async def test_a_peer_that_never_synced_is_not_pulled_from_and_a_lone_agent_stays_fresh() -> None:
    """A pull takes the peer's store as the truth: an empty newcomer (its snapshot moved aside) answers busy,
    so the rejoining agent keeps what it has. With no peer at all there is nothing to pull: an agent alone
    with a majority (the one region) stays fresh instead of withholding its zone for good."""
    net = Net()
    a_store, _, _, _ = _away_scene(10)
    a, _ = _node(net, 1, a_store)
    empty, empty_addr = _node(net, 2, _store("ams1/new"))
    a.absent_limit, a.last_fresh = 60.0, time.monotonic() - 61
    told: list[bool] = []
    a.on_pull_only = told.append
    a._check_absence()
    assert told == [], "alone (no peer) with a majority: fresh"
    a._peers = lambda: [empty_addr]
    a.last_fresh = time.monotonic() - 61
    a._check_absence()
    assert told == [True]
    a.start_round(empty_addr)
    await wait_for(lambda: a.stats.rounds["deferred"] >= 1, timeout=5, message="the newcomer says busy")
    assert a.pull_only and len(a_store.projects) == 10 and empty.stats.entries_sent == 0


# --- the absence clock across a restart (restore_absence: the snapshot's last fresh round) ---------------------

def _pulling(node: AntiEntropy) -> bool:
    """``pull_only`` read afresh (mypy would keep it narrowed across the calls that change it)."""
    return node.pull_only


async def test_a_restart_restored_as_away_beyond_the_limit_is_pull_only_before_any_round() -> None:
    """The decision is made at start, from the snapshot's time, before the first offer or answer: a peer's
    ordinary offer is answered busy at once (nothing of A's leaves it), and A's own offers are pulls."""
    net = Net()
    a_store, b_store, c_store, _ = _away_scene(40)
    a, a_addr = _node(net, 1, a_store)
    b, b_addr = _node(net, 2, b_store)
    c, _ = _node(net, 3, c_store)
    for peer in (b, c):
        peer.synced.set()
    told: list[bool] = []
    a.on_pull_only = told.append
    a.absent_limit = 29 * 86_400.0
    a.counts = lambda: False   # no majority in sight yet (it has just started)
    assert not a.pull_only
    a.restore_absence(40 * 86_400.0)
    assert told == [True] and _pulling(a) and a.stats.rounds["pull_only"] == 1
    last = a.last_fresh_wall()
    assert last is not None and abs(time.time() - 40 * 86_400 - last) < 5   # what the next snapshot keeps
    a._check_absence()   # alone and no majority: it waits for a peer to pull from, still pull-only
    assert _pulling(a) and told == [True]
    c.start_round(a_addr)
    await wait_for(lambda: c.stats.rounds["deferred"] == 1, timeout=5, message="busy")
    assert "p00007" not in c_store.projects and a.stats.entries_sent == 0
    a.start_round(b_addr)
    await wait_for(lambda: not a.pull_only, timeout=5, message="pulled")
    assert "p00007" not in a_store.projects and "p00007" not in b_store.projects and told == [True, False]
    now = a.last_fresh_wall()
    assert now is not None and abs(now - time.time()) < 5, "fresh again after the pull"


def test_a_restart_restored_within_the_limit_keeps_its_clock_and_an_unknown_one_is_pull_only() -> None:
    net = Net()
    a, _ = _node(net, 1, _store("sfo1/a"))
    told: list[bool] = []
    a.on_pull_only = told.append
    a.absent_limit = 29 * 86_400.0
    a.restore_absence(3 * 86_400.0)
    assert not a.pull_only and told == []
    last = a.last_fresh_wall()
    assert last is not None and abs(time.time() - 3 * 86_400 - last) < 5, "not reset to the start"
    b, _ = _node(net, 2, _store("sfo1/b"))
    b.absent_limit = 29 * 86_400.0
    b.on_pull_only = told.append
    b.restore_absence(math.inf)   # the snapshot could not tell (a wall clock that went back)
    assert _pulling(b) and told == [True] and b.last_fresh_wall() is None
    # Alone with a majority (the only region) there is no one to pull from and no one's deletes to undo.
    b._check_absence()
    assert not _pulling(b) and told == [True, False]
    fresh = b.last_fresh_wall()
    assert fresh is not None and abs(fresh - time.time()) < 5
