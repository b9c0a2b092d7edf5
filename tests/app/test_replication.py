"""What leaves the store for gossip and what comes in; the bounds that keep a burst from flooding it."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from region_agent.app.replication import MAX_BROADCAST_BATCH, MAX_QUEUED, StoreReplica, broadcast_key, encode_entry
from region_agent.gossip.messages import User
from region_agent.gossip.queue import BroadcastQueue
from region_agent.state.hlc import HybridClock
from region_agent.state.model import CopyHealth, Project, copy_key, project_key
from region_agent.state.store import Store


def _store(writer: str) -> Store:
    return Store(writer=writer, clock=HybridClock(lambda: int(time.time() * 1000)))


class Wire:
    def __init__(self, queued: int = 0) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.syncs: list[int] = []
        self.queued = queued

    def attach(self, replica: StoreReplica) -> None:
        replica.attach(lambda k, p: self.sent.append((k, p)), self.syncs.append, lambda: self.queued)


def test_local_writes_are_broadcast_one_by_one_and_merges_are_not() -> None:
    store = _store("sfo1/n1")
    replica = StoreReplica(store, CollectorRegistry())
    wire = Wire()
    wire.attach(replica)
    entry = store.put(copy_key("shop", "sfo1"), CopyHealth(True))
    assert entry is not None and wire.sent == [(broadcast_key(entry), encode_entry(entry))]
    # A big batch goes to anti-entropy, not to the broadcast queue.
    store.put_many([(project_key(f"p{i}"), Project(f"p{i}", ("sfo1",))) for i in range(MAX_BROADCAST_BATCH + 1)],
                   writer="control/api")
    assert len(wire.sent) == 1 and wire.syncs == [3]


def test_a_stream_of_single_writes_outrunning_gossip_goes_to_anti_entropy() -> None:
    """10,000 first check results arrive one by one: once MAX_QUEUED broadcasts wait, the rest sync."""
    store = _store("sfo1/n1")
    replica = StoreReplica(store, CollectorRegistry())
    wire = Wire(queued=MAX_QUEUED)
    wire.attach(replica)
    for i in range(1_000):
        store.put(copy_key(f"p{i}", "sfo1"), CopyHealth(True))
    assert wire.sent == [] and len(wire.syncs) == 1_000   # each asks; the sync loop coalesces the wake-ups


async def test_broadcast_arrivals_merge_once_per_loop_turn_and_owners_are_enforced() -> None:
    source = _store("sfo1/n1")
    good = source.put(copy_key("shop", "sfo1"), CopyHealth(True))
    forged_source = _store("ams1/n1")
    forged = forged_source.put(copy_key("shop", "ams1"), CopyHealth(True))
    assert good is not None and forged is not None
    forged = type(forged)(copy_key("shop", "sfo1"), CopyHealth(False, "forged"), forged.version)
    target = _store("fra1/n1")
    replica = StoreReplica(target, CollectorRegistry())
    batches: list[int] = []
    target.subscribe(lambda changed: batches.append(len(changed)))
    for entry in (good, forged):
        assert replica.user_message(User(broadcast_key(entry), "x/n1", encode_entry(entry)))
    assert replica.user_message(User("s:junk", "x/n1", b"not json"))
    assert not replica.user_message(User("o:other", "x/n1", b"{}"))   # another handler's prefix
    await asyncio.sleep(0)   # one loop turn: the inbox is merged once
    assert batches == [1] and target.copies[("shop", "sfo1")] == CopyHealth(True)
    assert target.metrics.rejected.labels("not-owner")._value.get() == 1


def test_the_broadcast_queue_is_bounded_and_drops_the_most_sent_first() -> None:
    queue = BroadcastQueue(max_items=100)
    for i in range(50):
        queue.queue(f"old{i}", b"x" * 10)
    queue.take(budget=10_000, limit=100, max_parts=64)   # 50 items sent once each
    for i in range(5_000):
        queue.queue(f"new{i}", b"y" * 10)
    assert len(queue) <= 100 and queue.dropped >= 4_950
    assert queue.transmits("new4999") == 0        # the newest survives
    assert all(queue.transmits(f"old{i}") is None for i in range(50))   # the already-sent went first
