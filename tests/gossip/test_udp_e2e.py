"""Memberships over real encrypted UDP (and TCP push-pull) on 127.0.0.x: join, kill, leave, keys."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from region_agent.gossip.config import lan
from region_agent.gossip.keyring import Keyring
from region_agent.gossip.membership import Membership
from region_agent.gossip.messages import Address, Member, Ping, Role, State, encode
from region_agent.gossip.scheduler import AsyncioScheduler
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.transport import GossipTransport, PacketTooLargeError
from tests.conftest import wait_for

KEY = b"k" * 32
Start = Callable[..., Coroutine[Any, Any, tuple[Membership, GossipTransport]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    started: list[tuple[Membership, GossipTransport]] = []

    async def start_one(i: int, keyring: Keyring | None = None) -> tuple[Membership, GossipTransport]:
        stats = GossipStats()
        transport = await GossipTransport.start(f"127.0.0.{i + 2}", 0, keyring or Keyring(KEY), stats)
        member = Member(f"sfo1/n{i}", "sfo1", f"n{i}", Role.AGENT, transport.addr)
        node = Membership(lan(), member, transport, AsyncioScheduler(), rng=random.Random(i), stats=stats)
        transport.attach(node)
        node.start()
        started.append((node, transport))
        return node, transport

    yield start_one
    for node, transport in started:
        node.stop()
        await transport.close()


def sees(node: Membership, name: str, state: State) -> bool:
    view = node.member(name)
    return view is not None and view.state is state


async def test_join_kill_leave_over_udp(start: Start) -> None:
    nodes = [(await start(i))[0] for i in range(4)]
    for node in nodes[1:]:
        node.join([nodes[0].local.addr])
    await wait_for(lambda: all(n.live_count() == 4 for n in nodes), timeout=10, message="all four alive everywhere")

    # kill -9: silent, no leave
    victim = nodes[3]
    victim.stop()
    await wait_for(lambda: all(sees(n, victim.local.name, State.DEAD) for n in nodes[:3]), timeout=20,
                   message="the killed member dead everywhere")

    # graceful leave
    leaver = nodes[2]
    leaver.leave()
    await wait_for(lambda: all(sees(n, leaver.local.name, State.LEFT) for n in nodes[:2]), timeout=10,
                   message="the leaver left everywhere")
    assert all(n.stats.rejected["key"] == 0 for n in nodes)


async def test_wrong_key_rejected_and_counted(start: Start) -> None:
    a, _ = await start(0)
    b, _ = await start(1, Keyring(b"x" * 32))
    b.join([a.local.addr])
    await wait_for(lambda: a.stats.rejected["key"] > 0, timeout=10, message="a rejects b's key")
    assert a.member(b.local.name) is None


async def test_rotation_keeps_members(start: Start) -> None:
    rings = [Keyring(KEY) for _ in range(3)]
    nodes = [(await start(i, rings[i]))[0] for i in range(3)]
    for node in nodes[1:]:
        node.join([nodes[0].local.addr])
    await wait_for(lambda: all(n.live_count() == 3 for n in nodes), timeout=10, message="joined")

    async def traffic_flows() -> None:
        before = [n.stats.received_messages["ack"] for n in nodes]
        pairs = list(zip(nodes, before, strict=True))
        await wait_for(lambda: all(n.stats.received_messages["ack"] >= b + 3 for n, b in pairs),
                       timeout=5, message="acks under the current keys")

    new = b"n" * 32
    for ring in rings:
        ring.install(new)
    await traffic_flows()
    rings[0].use(new)  # one agent sends with the new key while the others still send with the old one
    await traffic_flows()
    for ring in rings[1:]:
        ring.use(new)
    await traffic_flows()
    for ring in rings:
        ring.remove(KEY)
    await traffic_flows()
    assert all(n.live_count() == 3 and n.stats.suspicions == 0 for n in nodes)
    assert all(n.stats.rejected["key"] == 0 for n in nodes)


async def test_oversized_datagram_refused(start: Start) -> None:
    _, transport = await start(0)
    with pytest.raises(PacketTooLargeError):
        transport.send_packet(Address("127.0.0.3", 9), bytes(1400))
    transport.send_packet(Address("127.0.0.3", 9), encode(Ping(1, "sfo1/a", "sfo1/b")))


class _Heard:
    def __init__(self) -> None:
        self.packets: list[tuple[bytes, Address]] = []
        self.streams: list[tuple[bytes, Address]] = []

    def receive_packet(self, data: bytes, source: Address) -> None:
        self.packets.append((data, source))

    def receive_stream(self, data: bytes, source: Address) -> None:
        self.streams.append((data, source))


async def test_datagrams_and_streams_share_the_port_and_streams_name_the_advertised_address() -> None:
    a = await GossipTransport.start("127.0.0.2", 0, Keyring(KEY), GossipStats(), advertised="127.0.0.9")
    b = await GossipTransport.start("127.0.0.3", 0, Keyring(KEY), GossipStats())
    heard = _Heard()
    b.attach(heard)
    try:
        assert a.addr == Address("127.0.0.9", a.packets.addr.port) == a.streams.addr
        assert a.packets.addr == Address("127.0.0.2", a.addr.port)  # bound here, advertised there
        a.send_packet(b.addr, b"datagram")
        a.send_stream(b.addr, b"stream")
        await wait_for(lambda: heard.packets and heard.streams, timeout=5, message="both delivered")
        assert heard.packets == [(b"datagram", Address("127.0.0.2", a.addr.port))]  # UDP: the socket's source
        assert heard.streams == [(b"stream", a.addr)]  # TCP: the sender named inside the frame
    finally:
        await a.close()
        await b.close()
