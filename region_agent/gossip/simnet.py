"""An in-memory network in virtual time: packet loss, latency, dead hosts and partitions.

Each host gets a :class:`SimTransport`; a packet is delivered by a scheduler callback after a
random latency unless it is lost, its sender or receiver is down, or a partition separates them.
Streams are reliable (no loss) but still cut by partitions and dead hosts. Used by the tests and by
``bench/gossip_sim.py``; nothing here touches a socket or the wall clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from region_agent.gossip.config import GossipConfig
from region_agent.gossip.membership import Membership, MemberView
from region_agent.gossip.messages import Address, Member, Role, State, User
from region_agent.gossip.scheduler import VirtualScheduler

# What the keyring adds to a datagram (version, nonce, tag), so simulated budgets match real ones.
DEFAULT_OVERHEAD = 29


class Receiver(Protocol):
    def receive_packet(self, data: bytes, source: Address) -> None: ...

    def receive_stream(self, data: bytes, source: Address) -> None: ...


@dataclass
class NetStats:
    packets: int = 0
    packet_bytes: int = 0
    streams: int = 0
    stream_bytes: int = 0
    lost: int = 0
    blocked: int = 0


class SimNetwork:
    def __init__(self, scheduler: VirtualScheduler, rng: random.Random, *, loss: float = 0.0,
                 latency: tuple[float, float] = (0.0005, 0.005), max_packet: int = 1400,
                 max_stream: int = 16 * 1024 * 1024) -> None:
        if not 0.0 <= loss < 1.0:
            raise ValueError("loss must be in [0, 1)")
        self.scheduler = scheduler
        self.rng = rng
        self.loss = loss
        self.latency = latency
        self.max_packet = max_packet
        self.max_stream = max_stream
        self.stats = NetStats()
        self._hosts: dict[Address, Receiver] = {}
        self._down: set[Address] = set()
        self._group: dict[Address, int] = {}

    def attach(self, addr: Address, receiver: Receiver, *, overhead: int = DEFAULT_OVERHEAD) -> SimTransport:
        self._hosts[addr] = receiver
        self._down.discard(addr)
        return SimTransport(self, addr, overhead)

    def transport(self, addr: Address, *, overhead: int = DEFAULT_OVERHEAD) -> SimTransport:
        """A transport for a host whose receiver is attached later (:meth:`bind`)."""
        return SimTransport(self, addr, overhead)

    def bind(self, addr: Address, receiver: Receiver) -> None:
        self._hosts[addr] = receiver
        self._down.discard(addr)

    def down(self, addr: Address) -> None:
        """The host stops sending and receiving (a kill -9)."""
        self._down.add(addr)

    def up(self, addr: Address) -> None:
        self._down.discard(addr)

    def partition(self, groups: Iterable[Iterable[Address]]) -> None:
        """Only hosts of the same group reach each other; hosts in no group are in group 0."""
        self._group = {addr: i + 1 for i, group in enumerate(groups) for addr in group}

    def heal(self) -> None:
        self._group = {}

    def reachable(self, a: Address, b: Address) -> bool:
        return (a not in self._down and b not in self._down and b in self._hosts
                and self._group.get(a, 0) == self._group.get(b, 0))

    def _delay(self) -> float:
        low, high = self.latency
        return self.rng.uniform(low, high)

    def send(self, source: Address, target: Address, data: bytes, *, stream: bool, overhead: int = 0) -> None:
        if stream:
            if len(data) > self.max_stream:
                raise ValueError(f"stream message of {len(data)} bytes over {self.max_stream}")
            self.stats.streams += 1
            self.stats.stream_bytes += len(data)
        else:
            if len(data) + overhead > self.max_packet:
                raise ValueError(f"datagram of {len(data) + overhead} bytes over {self.max_packet}")
            self.stats.packets += 1
            self.stats.packet_bytes += len(data) + overhead
        if not self.reachable(source, target):
            self.stats.blocked += 1
            return
        if not stream and self.loss and self.rng.random() < self.loss:
            self.stats.lost += 1
            return
        # A stream costs a round trip more than a datagram (connection set-up).
        delay = self._delay() * (3 if stream else 1)
        self.scheduler.call_later(delay, lambda: self._deliver(source, target, data, stream))

    def _deliver(self, source: Address, target: Address, data: bytes, stream: bool) -> None:
        if not self.reachable(source, target):  # died or got cut off while the packet flew
            self.stats.blocked += 1
            return
        receiver = self._hosts[target]
        if stream:
            receiver.receive_stream(data, source)
        else:
            receiver.receive_packet(data, source)


class SimTransport:
    def __init__(self, network: SimNetwork, addr: Address, overhead: int) -> None:
        self.network = network
        self.addr = addr
        self.overhead = overhead

    def send_packet(self, addr: Address, data: bytes) -> None:
        # The datagram on the wire carries the (simulated) encryption overhead too.
        self.network.send(self.addr, addr, data, stream=False, overhead=self.overhead)

    def send_stream(self, addr: Address, data: bytes) -> None:
        self.network.send(self.addr, addr, data, stream=True)


class SimCluster:
    """N memberships on one simulated network, with names ``<region>/n<i>`` and hosts 10.x.y.z."""

    def __init__(self, config: GossipConfig, *, seed: int = 1, loss: float = 0.0,
                 latency: tuple[float, float] = (0.0005, 0.005), regions: tuple[str, ...] = ("sfo1",)) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.scheduler = VirtualScheduler()
        self.network = SimNetwork(self.scheduler, self.rng, loss=loss, latency=latency,
                                  max_packet=config.packet_bytes, max_stream=config.stream_bytes)
        self.regions = regions
        self.nodes: dict[str, Membership] = {}
        self.events: dict[str, RecordingEvents] = {}

    @staticmethod
    def address(i: int) -> Address:
        return Address(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 7946)

    def member(self, i: int, role: Role = Role.AGENT) -> Member:
        region = self.regions[i % len(self.regions)]
        return Member(f"{region}/n{i}", region, f"n{i}", role, self.address(i), (), 1)

    def add(self, i: int, *, start: bool = True) -> Membership:
        member = self.member(i)
        transport = self.network.transport(member.addr)
        events = RecordingEvents(self.scheduler)
        node = Membership(self.config, member, transport, self.scheduler,
                          rng=random.Random(self.rng.getrandbits(64)), events=events)
        self.network.bind(member.addr, node)
        self.nodes[member.name] = node
        self.events[member.name] = events
        if start:
            node.start()
        return node

    def converged_start(self, n: int) -> list[Membership]:
        """n members that already know each other (a steady state without replaying the joins)."""
        members = [self.member(i) for i in range(n)]
        nodes = [self.add(i, start=False) for i in range(n)]
        for node in nodes:
            node.add_known(members)
            node.start()
        return nodes

    def kill(self, name: str) -> None:
        """Stop a member without a leave, as kill -9 would."""
        node = self.nodes[name]
        node.stop()
        self.network.down(node.local.addr)

    def alive(self) -> list[Membership]:
        return [m for m in self.nodes.values() if m.running]

    def everyone_sees(self, name: str, states: tuple[State, ...]) -> bool:
        for node in self.alive():
            if node.local.name == name:
                continue
            view = node.member(name)
            if view is None or view.state not in states:
                return False
        return True

    def run_for(self, seconds: float, stop: Callable[[], bool] | None = None) -> bool:
        return self.scheduler.run_for(seconds, stop=stop)


class RecordingEvents:
    """Keeps what a member observed, with virtual timestamps (for tests and the simulator)."""

    def __init__(self, scheduler: VirtualScheduler) -> None:
        self._scheduler = scheduler
        self.changes: list[tuple[float, str, State | None, State]] = []
        self.user: dict[str, float] = {}

    def member_changed(self, view: MemberView, previous: State | None) -> None:
        if previous is not view.state:
            self.changes.append((self._scheduler.now(), view.member.name, previous, view.state))

    def user_message(self, message: User) -> None:
        self.user.setdefault(message.key, self._scheduler.now())
