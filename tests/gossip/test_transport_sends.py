"""This agent's own streams to peers that stall: what they hold is bounded (``SendLimits``).

A stalled peer accepts TCP connections and reads nothing; its receive buffer is small and each message
larger than what the sender's kernel takes (its send buffer grows to tcp_wmem's maximum), so the
sender's ``drain()`` blocks and its sends stay in flight. Before: every ``send_stream`` made a task that
held its sealed message until it had its turn, so 50 push-pulls to such a peer held 50 messages; the
wait for a turn was taken from the send's own 10 s; and a send whose peer stopped reading never ended
(its close waited for a flush), holding its turn for good. Here: 4 in flight and 4 waiting per peer,
the oldest waiting giving way, a byte budget across peers, a turn timeout and a send timeout of their
own, each drop counted. Each test runs on asyncio's loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from region_agent.gossip.keyring import OVERHEAD, Keyring, KeyringError
from region_agent.gossip.messages import Address
from region_agent.gossip.metrics import _stream_families
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.transport import OUTGOING_PER_PEER, OUTGOING_QUEUED_PER_PEER, GossipTransport, SendLimits
from tests.conftest import wait_for
from tests.gossip.test_transport_limits import KEY, Recorder, both_loops, delivered

KiB = 1024
MiB = 1024 * KiB
SENDER = "127.0.0.2"


def payload_size() -> int:
    """A message the sender's kernel can not take whole while the peer reads nothing: beyond the largest
    send buffer TCP grows to (tcp_wmem's maximum, 4 MiB by default), the stalled peer's small receive
    buffer and asyncio's 64 KiB high-water mark."""
    try:
        wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        wmem_max = 4 * MiB
    if wmem_max > 16 * MiB:
        pytest.skip(f"tcp_wmem allows {wmem_max} byte send buffers: a stalling message would be too large")
    return wmem_max + 2 * MiB


def sealed_size(data_size: int) -> int:
    return OVERHEAD + 1 + len(SENDER) + 2 + data_size


class StalledPeer:
    """Accepts gossip TCP connections and reads none of its first ``stalled`` (all when None) until
    :meth:`read`; then reads each frame whole and opens it with the key (``messages``)."""

    def __init__(self, host: str, *, stalled: int | None = None) -> None:
        self.host = host
        self.stalled = stalled
        self.accepted = 0
        self.messages: list[bytes] = []
        self._reading = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> Address:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the accepted sockets inherit it
        sock.bind((self.host, 0))
        sock.listen(64)
        self._server = await asyncio.start_server(self._on_connection, sock=sock)
        return Address(self.host, sock.getsockname()[1])

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.accepted
        self.accepted += 1
        self._writers.append(writer)
        if self.stalled is None or number < self.stalled:
            await self._reading.wait()
        try:
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            plain = Keyring(KEY).decrypt(await reader.readexactly(size))
            self.messages.append(plain[3 + plain[0]:])
        except (asyncio.IncompleteReadError, OSError, KeyringError):
            pass  # cut by the sender, or by go_away
        finally:
            writer.close()

    def read(self) -> None:
        self._reading.set()

    async def go_away(self) -> None:
        """Close the listener and reset every connection held."""
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._reading.set()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def agents(size: int, **send_limits: Any) -> AsyncIterator[tuple[GossipTransport, GossipTransport, Recorder]]:
    """``sender`` sends under the test's SendLimits; ``healthy`` is a peer that reads what it is sent."""
    keyring = Keyring(KEY)
    max_stream = size + 64 * KiB
    sender = await GossipTransport.start(SENDER, 0, keyring, GossipStats(), max_stream=max_stream,
                                         send_limits=SendLimits(**send_limits))
    healthy = await GossipTransport.start("127.0.0.3", 0, keyring, GossipStats(), max_stream=max_stream)
    got = Recorder()
    healthy.attach(got)
    try:
        yield sender, healthy, got
    finally:
        await sender.close()
        await healthy.close()


def exported(sender: GossipTransport) -> dict[str, Any]:
    """The send families as scraped: a counter by reason, the gauges by value."""
    out: dict[str, Any] = {}
    for family in _stream_families(sender.streams.counters):
        if family.name == "region_agent_gossip_stream_send_dropped":
            out[family.name] = {s.labels["reason"]: s.value for s in family.samples}
        elif family.name.startswith("region_agent_gossip_stream_send_"):
            out[family.name] = family.samples[0].value
    return out


@both_loops
async def test_sends_to_stalled_peers_are_bounded_and_drain_when_the_peers_read_or_go() -> None:
    size = payload_size()
    message = sealed_size(size)
    budget = 10 * message  # room for one stalled peer's 8 and two more
    async with agents(size, pending_bytes=budget, turn_timeout=60.0, timeout=60.0) as (sender, healthy, got):
        counters = sender.streams.counters
        one, two = StalledPeer("127.0.0.4"), StalledPeer("127.0.0.5")
        to_one, to_two = await one.start(), await two.start()
        bound = OUTGOING_PER_PEER + OUTGOING_QUEUED_PER_PEER
        for i in range(50):
            sender.send_stream(to_one, bytes([i]) * size)
            assert counters.send_pending == min(i + 1, bound)
        # Four in flight, four waiting; each newer one took the place of the oldest waiting.
        assert counters.send_waiting == OUTGOING_QUEUED_PER_PEER
        assert counters.send_dropped == {"peer_queue": 50 - bound}
        for i in range(10):
            sender.send_stream(to_two, bytes([100 + i]) * size)
        assert counters.send_pending == 10 and counters.send_pending_bytes == budget
        assert counters.send_dropped == {"peer_queue": 50 - bound, "pending_bytes": 8}
        assert counters.peak_send_pending == 10 and counters.peak_send_pending_bytes == budget
        assert exported(sender) == {
            "region_agent_gossip_stream_send_dropped": {"peer_queue": 50 - bound, "pending_bytes": 8},
            "region_agent_gossip_stream_send_pending": 10, "region_agent_gossip_stream_send_waiting": 4,
            "region_agent_gossip_stream_send_pending_bytes": budget}

        await wait_for(lambda: one.accepted >= OUTGOING_PER_PEER and two.accepted >= 2,
                       message="the sends in flight connected")
        # Stalled in drain(): no send in flight ended, so none of the waiting ones connected.
        assert one.accepted == OUTGOING_PER_PEER and two.accepted == 2
        assert counters.send_pending == 10 and counters.send_waiting == 4

        await two.go_away()
        one.read()
        await wait_for(lambda: len(one.messages) == bound, timeout=30, message="the first peer's messages read")
        # The first four (in flight), then the newest four (waiting): 4..45 gave way one after the other.
        assert sorted(m[0] for m in one.messages) == [0, 1, 2, 3, 46, 47, 48, 49]
        assert all(len(m) == size for m in one.messages)
        await wait_for(lambda: counters.send_pending == 0 and not sender.streams._tasks, timeout=30,
                       message="nothing pending")
        assert counters.send_pending_bytes == 0 and counters.send_waiting == 0 and not sender.streams._outgoing
        assert one.accepted == bound and two.accepted == 2
        assert counters.peak_send_pending == 10 and counters.peak_send_pending_bytes == budget
        assert counters.send_dropped == {"peer_queue": 50 - bound, "pending_bytes": 8}  # a reset is not a bound
        await delivered(healthy, sender, got, b"to a healthy peer")
        await one.go_away()


@both_loops
async def test_a_send_waits_for_its_turn_at_most_turn_timeout() -> None:
    size = payload_size()
    async with agents(size, per_peer=1, turn_timeout=0.3, timeout=60.0) as (sender, healthy, got):
        counters = sender.streams.counters
        peer = StalledPeer("127.0.0.4")
        to_peer = await peer.start()
        for i in range(3):
            sender.send_stream(to_peer, bytes([i]) * size)
        assert counters.send_pending == 3 and counters.send_waiting == 2
        await wait_for(lambda: counters.send_dropped["turn_timeout"] == 2, timeout=10,
                       message="the two waiting behind the stalled one dropped")
        assert counters.send_pending == 1 and counters.send_waiting == 0
        assert counters.send_pending_bytes == sealed_size(size)
        assert exported(sender)["region_agent_gossip_stream_send_dropped"] == {"turn_timeout": 2}
        peer.read()
        await wait_for(lambda: peer.messages and counters.send_pending == 0, timeout=30,
                       message="the one in flight delivered")
        assert [m[0] for m in peer.messages] == [0] and peer.accepted == 1
        assert counters.send_dropped == {"turn_timeout": 2} and counters.send_pending_bytes == 0
        await delivered(healthy, sender, got, b"to a healthy peer")
        await peer.go_away()


@both_loops
async def test_the_wait_for_a_turn_is_not_taken_from_the_sends_own_budget() -> None:
    """The first send stalls until its 1.5 s are out and is cut; the second waited those 1.5 s for its
    turn and still has 1.5 s of its own to connect and write."""
    size = payload_size()
    async with agents(size, per_peer=1, turn_timeout=30.0, timeout=1.5) as (sender, _, _got):
        counters = sender.streams.counters
        peer = StalledPeer("127.0.0.4", stalled=1)  # its first connection is never read, later ones are
        to_peer = await peer.start()
        started = time.monotonic()
        sender.send_stream(to_peer, b"\x00" * size)
        sender.send_stream(to_peer, b"\x01 after the wait")
        await wait_for(lambda: peer.messages, timeout=20, message="the second message")
        assert time.monotonic() - started >= 1.4  # it went after the first one's budget was out
        assert peer.messages == [b"\x01 after the wait"] and peer.accepted == 2
        assert counters.send_dropped == {"timeout": 1}
        await wait_for(lambda: counters.send_pending == 0 and not sender.streams._tasks, timeout=10,
                       message="both sends ended")
        await peer.go_away()
