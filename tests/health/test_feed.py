"""Publisher and subscriber over a real Unix socket in one event loop; time by a manual clock.

The staleness rule reads the subscriber's monotonic clock, so a ManualClock makes "older
than the bound" exact without waiting; everything else is waited on with deadlines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from region_agent.base.clock import ManualClock
from region_agent.base.tasks import cancel_and_wait
from region_agent.health.feed import FeedPublisher, FeedSubscriber
from region_agent.health.feed_protocol import encode_delta, encode_heartbeat, encode_snapshot
from region_agent.state.local import CopyReason, RegionView
from tests.conftest import wait_for
from tests.health.helpers import copy, many_copies, view

BOUND = 10.0
V1 = view([copy("shop"), copy("blog")])


@dataclasses.dataclass
class Sub:
    subscriber: FeedSubscriber
    registry: CollectorRegistry
    clock: ManualClock

    def view(self) -> RegionView | None:
        return self.subscriber.current()[0]

    def stale(self) -> bool:
        return self.subscriber.current()[1].stale

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "feed.sock"


@pytest.fixture
async def publishers(socket_path: Path) -> AsyncIterator[Callable[..., Awaitable[FeedPublisher]]]:
    made: list[FeedPublisher] = []

    async def make(**options: object) -> FeedPublisher:
        publisher = FeedPublisher(
            socket_path=socket_path, registry=CollectorRegistry(),
            **{"heartbeat_interval": 0.05, "min_interval": 0.0, **options},  # type: ignore[arg-type]
        )
        await publisher.start()
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        await publisher.stop()


@pytest.fixture
async def sub(socket_path: Path) -> AsyncIterator[Sub]:
    registry = CollectorRegistry()
    clock = ManualClock()
    subscriber = FeedSubscriber(
        socket_path=socket_path, region="sfo1", stale_after=BOUND, registry=registry, reconnect_max=0.05,
        clock=clock, max_line_bytes=256 * 1024,
    )
    task = asyncio.get_running_loop().create_task(subscriber.run(), name="test-subscriber")
    yield Sub(subscriber, registry, clock)
    await cancel_and_wait([task])


async def test_fed_then_changes_arrive_as_deltas(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    assert sub.view() is None and sub.stale()  # never heard: stale
    publisher = await publishers()
    publisher.publish(V1)
    await wait_for(lambda: sub.view() == V1, message="the first view")
    assert not sub.stale()
    v2 = dataclasses.replace(V1, copies={**V1.copies, "blog": copy("blog", CopyReason.FENCED)}, zone_serial=8)
    publisher.publish(v2)
    await wait_for(lambda: sub.view() == v2, message="the changed view")
    assert sub.metric("region_agent_health_feed_messages_total", type="snapshot") == 1
    assert sub.metric("region_agent_health_feed_messages_total", type="delta") == 1
    await wait_for(lambda: sub.metric("region_agent_health_feed_messages_total", type="heartbeat") >= 2)


async def test_coalescing_sends_the_latest_view(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    publisher = await publishers(min_interval=0.05)
    publisher.publish(V1)
    await wait_for(lambda: sub.view() == V1)
    views = [dataclasses.replace(V1, zone_serial=n) for n in range(20)]
    for v in views:
        publisher.publish(v)
    await wait_for(lambda: sub.view() == views[-1])
    assert sub.metric("region_agent_health_feed_messages_total", type="delta") < 20


async def test_stale_after_the_bound_when_the_agent_goes_silent(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    publisher = await publishers()
    publisher.publish(V1)
    await wait_for(lambda: sub.view() == V1)
    await publisher.stop()
    await wait_for(lambda: sub.metric("region_agent_health_feed_connected") == 0, message="disconnect noticed")
    sub.clock.advance(BOUND - 0.01)
    assert not sub.stale() and sub.view() == V1
    sub.clock.advance(0.02)
    assert sub.stale()
    assert sub.view() == V1  # kept for /health/region; the answers say stale


async def test_agent_restart_within_the_bound_changes_nothing(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    old = await publishers()
    old.publish(V1)
    await wait_for(lambda: sub.view() == V1)
    await old.stop()
    sub.clock.advance(BOUND / 2)
    new = await publishers()
    # The restarted agent's first view is not synced yet: it must not replace the synced one.
    new.publish(view([copy("shop")], synced=False))
    await wait_for(lambda: sub.metric("region_agent_health_feed_messages_total", type="snapshot") == 2)
    assert sub.view() == V1 and not sub.stale()
    synced = view([copy("shop"), copy("blog"), copy("new")])
    new.publish(synced)
    await wait_for(lambda: sub.view() == synced, message="the restarted agent's synced view")
    sub.clock.advance(BOUND / 2 + 1)  # past the old agent's last word: the new one vouches now
    await wait_for(lambda: not sub.stale(), message="vouched by the new agent")


async def test_an_agent_that_stays_unsynced_past_the_bound_goes_stale(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    old = await publishers()
    old.publish(V1)
    await wait_for(lambda: sub.view() == V1)
    await old.stop()
    new = await publishers()
    new.publish(view(synced=False))
    await wait_for(lambda: sub.metric("region_agent_health_feed_messages_total", type="heartbeat") >= 3)
    sub.clock.advance(BOUND + 1)
    assert sub.stale(), "heartbeats of an unsynced agent must not vouch for the old view"


async def test_first_view_unsynced_is_held_and_vouched(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    publisher = await publishers()
    listing = view(synced=False)
    publisher.publish(listing)
    await wait_for(lambda: sub.view() == listing)
    assert not sub.stale()  # the answers say cache-not-synced, not stale


async def test_heartbeats_alone_do_not_make_a_feed_fresh(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub
) -> None:
    await publishers()  # serves, but has no view yet
    await wait_for(lambda: sub.metric("region_agent_health_feed_messages_total", type="heartbeat") >= 2)
    assert sub.view() is None and sub.stale()


# --- bad input from the socket -----------------------------------------------------------------


HANG_UP = b"<hang up>"


@pytest.fixture
async def raw_agent(socket_path: Path) -> AsyncIterator[list[list[bytes]]]:
    """A fake agent: the n-th connection gets the n-th list of lines, then stays open
    (or hangs up when the list ends with :data:`HANG_UP`)."""
    scripts: list[list[bytes]] = []
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        lines = scripts[connections] if connections < len(scripts) else []
        connections += 1
        for line in lines:
            if line is HANG_UP:
                break
            writer.write(line)
        await writer.drain()
        if HANG_UP not in lines:
            await reader.read()
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(socket_path))
    yield scripts
    server.close()


async def test_an_invalid_line_is_counted_ignored_and_followed_by_a_resync(
    raw_agent: list[list[bytes]], sub: Sub
) -> None:
    v2 = dataclasses.replace(V1, zone_serial=99)
    raw_agent.append([encode_snapshot(V1, 1), b'{"v":1,"type":"delta","seq":2,"garbage":true}\n',
                      encode_delta(V1, v2, 3)])
    raw_agent.append([encode_snapshot(v2, 4)])
    await wait_for(lambda: sub.view() == v2, message="resynced by a new snapshot")
    assert sub.metric("region_agent_health_feed_errors_total", kind="invalid") == 1
    assert sub.metric("region_agent_health_feed_connects_total") == 2


@pytest.mark.parametrize(
    ("first_connection", "error_kind"),
    [
        ([encode_snapshot(view(region="lax1"), 1)], "invalid"),
        ([encode_delta(V1, V1, 1)], "invalid"),  # a delta before any snapshot
        ([b"\xff" * 300_000 + b"\n"], "oversize"),
        ([encode_snapshot(view(many_copies(3000)), 1)], "oversize"),
        ([encode_snapshot(V1, 1)[:-40], HANG_UP], "closed"),  # half a line, then the agent hangs up
    ],
)
async def test_bad_feeds_never_reach_the_answers(
    raw_agent: list[list[bytes]], sub: Sub, first_connection: list[bytes], error_kind: str
) -> None:
    raw_agent.append(first_connection)
    await wait_for(lambda: sub.metric("region_agent_health_feed_errors_total", kind=error_kind) >= 1)
    assert sub.view() is None and sub.stale()


async def test_a_subscriber_that_does_not_read_is_dropped(
    publishers: Callable[..., Awaitable[FeedPublisher]], socket_path: Path
) -> None:
    publisher = await publishers(max_buffer_bytes=4096)
    _reader, writer = await asyncio.open_unix_connection(str(socket_path))  # never reads
    await wait_for(lambda: publisher.subscribers == 1)
    publisher.publish(view(many_copies(200)))  # a snapshot of ~30 KB: over the cap
    await wait_for(lambda: publisher.subscribers == 0, message="the slow subscriber dropped")
    writer.close()


async def test_publisher_replaces_a_stale_socket_file_and_removes_its_own(
    publishers: Callable[..., Awaitable[FeedPublisher]], socket_path: Path
) -> None:
    leftover = await asyncio.start_unix_server(lambda r, w: None, path=str(socket_path))
    leftover.close()  # the file stays behind, like after a crash
    assert os.path.exists(socket_path)
    publisher = await publishers()
    assert os.path.exists(socket_path)
    await publisher.stop()
    assert not os.path.exists(socket_path)


def test_heartbeat_lines_are_tiny() -> None:
    assert len(encode_heartbeat(123456)) < 64


async def test_a_view_that_can_not_be_encoded_is_skipped_and_the_feed_goes_on(
    publishers: Callable[..., Awaitable[FeedPublisher]], sub: Sub, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = await publishers()
    publisher.publish(V1)
    await wait_for(lambda: sub.view() == V1)
    publisher.publish(dataclasses.replace(V1, zone_digest=object()))  # type: ignore[arg-type]
    await wait_for(lambda: "can not encode the view" in caplog.text, message="the encoding error logged")
    v3 = dataclasses.replace(V1, zone_serial=3)
    publisher.publish(v3)
    await wait_for(lambda: sub.view() == v3, message="the next good view")
