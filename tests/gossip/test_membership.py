"""The SWIM + Lifeguard rules, one member driven by hand in virtual time (no sockets, no sleeps).

The member under test talks to a recording transport; the tests play its peers by feeding it
packets and reading what it sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from region_agent.gossip.config import GossipConfig
from region_agent.gossip.membership import Membership, MemberView
from region_agent.gossip.messages import (
    Ack,
    Address,
    Alive,
    Compound,
    Dead,
    Member,
    MemberState,
    Message,
    Nack,
    Ping,
    PingReq,
    PushPull,
    Role,
    Single,
    State,
    Suspect,
    Sync,
    User,
    decode,
    decode_parts,
    encode,
)
from region_agent.gossip.scheduler import VirtualScheduler

CONFIG = GossipConfig(push_pull_interval=1000.0, join_sync_delays=())


def member(i: int, incarnation: int = 1) -> Member:
    return Member(f"sfo1/n{i}", "sfo1", f"n{i}", Role.AGENT, Address(f"10.0.0.{i}", 7946), (), incarnation)


@dataclass
class Wire:
    """Records what the member sends; peers not in ``silent`` ack its pings 1 ms later."""

    clock: VirtualScheduler
    overhead: int = 0
    silent: set[int] = field(default_factory=set)
    receiver: Membership | None = None
    packets: list[tuple[Address, list[Single]]] = field(default_factory=list)
    streams: list[tuple[Address, Message]] = field(default_factory=list)

    def send_packet(self, addr: Address, data: bytes) -> None:
        assert len(data) <= CONFIG.packet_bytes
        message = decode(data)
        assert not isinstance(message, PushPull | Sync)
        parts = decode_parts(message) if isinstance(message, Compound) else [message]
        self.packets.append((addr, parts))
        peer = index_of(addr)
        for part in parts:
            if isinstance(part, Ping) and peer not in self.silent and self.receiver is not None:
                self._answer(self.receiver, encode(Ack(part.seq)), addr)

    def _answer(self, receiver: Membership, ack: bytes, addr: Address) -> None:
        self.clock.call_later(0.001, lambda: receiver.receive_packet(ack, addr))

    def send_stream(self, addr: Address, data: bytes) -> None:
        self.streams.append((addr, decode(data)))

    def sent(self, kind: type[Single], to: Address | None = None) -> list[Single]:
        return [m for addr, parts in self.packets for m in parts
                if isinstance(m, kind) and (to is None or addr == to)]

    def clear(self) -> None:
        self.packets.clear()
        self.streams.clear()


@dataclass
class Rig:
    node: Membership
    wire: Wire
    clock: VirtualScheduler
    changes: list[tuple[str, State | None, State]] = field(default_factory=list)

    def member_changed(self, view: MemberView, previous: State | None) -> None:
        self.changes.append((view.member.name, previous, view.state))

    def user_message(self, message: User) -> None:
        self.changes.append((message.key, None, State.ALIVE))

    def feed(self, *messages: Single, source: int = 2) -> None:
        data = encode(messages[0]) if len(messages) == 1 else encode(Compound(tuple(encode(m) for m in messages)))
        self.node.receive_packet(data, member(source).addr)

    def state(self, i: int) -> State:
        view = self.node.member(member(i).name)
        assert view is not None
        return view.state

    def run_until_ping(self, limit: float = 5.0) -> tuple[Address, Ping]:
        """Advance until the member pings someone; returns where and what."""
        self.clock.run_for(limit, stop=lambda: bool(self.wire.sent(Ping)))
        (addr, ping), = [(a, m) for a, parts in self.wire.packets for m in parts if isinstance(m, Ping)]
        return addr, ping


def rig(peers: int = 4, config: GossipConfig = CONFIG, seed: int = 7, silent: tuple[int, ...] = ()) -> Rig:
    """The member n1 knowing n2..n(peers+1); all answer pings except those in ``silent``."""
    clock = VirtualScheduler()
    wire = Wire(clock, silent=set(silent))
    rig_ = Rig(None, wire, clock)  # type: ignore[arg-type]
    node = Membership(config, member(1), wire, clock, rng=random.Random(seed), events=rig_)
    node.add_known(member(i) for i in range(2, 2 + peers))
    node.start()
    rig_.node = node
    wire.receiver = node
    rig_.changes.clear()
    return rig_


def index_of(addr: Address) -> int:
    return int(addr.host.rsplit(".", 1)[1])


# --- probing ----------------------------------------------------------------------------------


def test_ack_keeps_the_target_alive_and_health_good() -> None:
    r = rig(silent=(2, 3, 4, 5))
    addr, ping = r.run_until_ping()
    started = r.clock.now()
    assert ping.target == member(index_of(addr)).name
    r.feed(Ack(ping.seq), source=index_of(addr))
    r.clock.run_until(started + CONFIG.probe_interval - 0.002)
    assert not r.wire.sent(PingReq)  # the acked probe needed no help
    assert r.state(index_of(addr)) is State.ALIVE
    assert r.node.stats.probe_failures == 0
    # The next probe starts one interval after the acked one, not earlier.
    assert len(r.wire.sent(Ping)) == 1
    r.clock.run_for(0.002)
    assert len(r.wire.sent(Ping)) == 2


def test_no_ack_then_indirect_probe_then_suspect_then_dead() -> None:
    r = rig(silent=(2, 3, 4, 5))
    addr, ping = r.run_until_ping()
    target = index_of(addr)
    started = r.clock.now()
    # Nobody answers anything: after the probe timeout the member asks k others.
    r.clock.run_for(CONFIG.probe_timeout + 0.001)
    requests = [m for m in r.wire.sent(PingReq) if isinstance(m, PingReq)]
    assert len(requests) == CONFIG.indirect_checks
    assert {q.target for q in requests} == {member(target).name}
    assert all(q.nack and q.seq == ping.seq for q in requests)
    # End of the interval: suspect, and the suspicion is gossiped.
    r.clock.run_until(started + CONFIG.probe_interval + 0.001)
    assert r.state(target) is State.SUSPECT
    assert r.node.stats.suspicions == 1
    # No confirmations, so the full Lifeguard maximum, then dead.
    n = r.node.live_count()
    r.clock.run_until(started + CONFIG.probe_interval + CONFIG.suspicion_max(n) - 0.05,
                      stop=lambda: r.state(target) is not State.SUSPECT)
    assert r.state(target) is State.SUSPECT, "confirmed by nobody, so no shortening"
    r.clock.run_for(0.1)
    assert r.state(target) is State.DEAD
    assert r.node.stats.deaths == 1
    assert (member(target).name, State.SUSPECT, State.DEAD) in r.changes


def test_indirect_ack_counts_as_success() -> None:
    r = rig(silent=(2, 3, 4, 5))
    addr, ping = r.run_until_ping()
    r.clock.run_for(CONFIG.probe_timeout + 0.001)
    r.feed(Ack(ping.seq), source=3)  # relayed by a helper
    r.clock.run_for(CONFIG.probe_interval)
    assert r.state(index_of(addr)) is State.ALIVE
    assert r.node.stats.probe_failures == 0


def test_missed_nacks_lower_local_health_and_stretch_the_interval() -> None:
    r = rig(silent=(2, 3, 4, 5))
    r.run_until_ping()
    r.clock.run_for(CONFIG.probe_interval - 0.01)
    r.wire.clear()
    r.clock.run_for(0.02)  # the first probe fails; helpers never nacked: we may be the problem
    assert r.node.health_score == CONFIG.indirect_checks
    (second,) = r.wire.sent(Ping)  # the next probe starts at once, with timeouts scaled by score + 1
    assert isinstance(second, Ping)

    def asked() -> bool:
        return any(isinstance(m, PingReq) and m.seq == second.seq for m in r.wire.sent(PingReq))

    r.clock.run_for(CONFIG.probe_timeout * 1.5)
    assert not asked()
    r.clock.run_for(CONFIG.probe_timeout * (CONFIG.indirect_checks + 1) - CONFIG.probe_timeout * 1.5)
    assert asked()


def test_nacks_spare_local_health() -> None:
    r = rig(silent=(2, 3, 4, 5))
    addr, ping = r.run_until_ping()
    r.clock.run_for(CONFIG.probe_timeout + 0.001)
    helpers = [index_of(a) for a, parts in r.wire.packets if any(isinstance(m, PingReq) for m in parts)]
    for helper in helpers:
        r.feed(Nack(ping.seq), source=helper)
    r.clock.run_for(CONFIG.probe_interval)
    assert r.state(index_of(addr)) is State.SUSPECT
    assert r.node.health_score == 0


# --- answering ----------------------------------------------------------------------------------


def test_ping_is_acked_to_its_source() -> None:
    r = rig()
    r.feed(Ping(42, member(1).name, member(3).name), source=3)
    assert [m for m in r.wire.sent(Ack, to=member(3).addr) if isinstance(m, Ack) and m.seq == 42]


def test_misdirected_ping_is_not_acked() -> None:
    r = rig()
    r.feed(Ping(42, member(9).name, member(3).name), source=3)
    assert not [m for m in r.wire.sent(Ack) if isinstance(m, Ack) and m.seq == 42]
    assert r.node.stats.rejected["misdirected"] == 1


@pytest.mark.parametrize("target_answers", [True, False])
def test_ping_req_relays_ack_or_nack(target_answers: bool) -> None:
    r = rig(silent=(4,))
    r.feed(PingReq(77, member(4).name, member(4).addr, member(3).name, nack=True), source=3)
    relayed = [m for m in r.wire.sent(Ping, to=member(4).addr) if isinstance(m, Ping)]
    assert len(relayed) == 1
    if target_answers:
        r.feed(Ack(relayed[0].seq), source=4)
    r.clock.run_for(CONFIG.probe_timeout + 0.01, stop=lambda: False)
    acks = [m for m in r.wire.sent(Ack, to=member(3).addr) if isinstance(m, Ack) and m.seq == 77]
    nacks = [m for m in r.wire.sent(Nack, to=member(3).addr) if isinstance(m, Nack) and m.seq == 77]
    assert (len(acks), len(nacks)) == ((1, 0) if target_answers else (0, 1))


def test_malformed_packet_is_counted_and_ignored() -> None:
    r = rig()
    r.node.receive_packet(b"\x01\x63garbage", member(2).addr)
    r.node.receive_packet(encode(PushPull(False, False, ())), member(2).addr)  # push-pull is stream-only
    assert r.node.stats.rejected["malformed"] == 2
    assert r.wire.packets == []


# --- suspicion, refutation, death ---------------------------------------------------------------

# (message fed to the member about n2 at incarnation 1, n2's state afterwards)
RULES: list[tuple[str, Single, State]] = [
    ("suspect", Suspect("sfo1/n2", 1, "sfo1/n3"), State.SUSPECT),
    ("old suspect ignored", Suspect("sfo1/n2", 0, "sfo1/n3"), State.ALIVE),
    ("dead", Dead("sfo1/n2", 1, "sfo1/n3"), State.DEAD),
    ("old dead ignored", Dead("sfo1/n2", 0, "sfo1/n3"), State.ALIVE),
    ("leave", Dead("sfo1/n2", 1, "sfo1/n2"), State.LEFT),
    ("same alive is no news", Alive(member(2, 1)), State.ALIVE),
    ("suspect of an unknown member ignored", Suspect("sfo1/n99", 5, "sfo1/n3"), State.ALIVE),
]


@pytest.mark.parametrize(("message", "after"), [(m, s) for _, m, s in RULES], ids=[n for n, _, _ in RULES])
def test_rules(message: Single, after: State) -> None:
    r = rig()
    r.feed(message, source=3)
    assert r.state(2) is after
    assert r.node.member("sfo1/n99") is None


def test_refutation_by_higher_incarnation_clears_the_suspicion() -> None:
    r = rig()
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n3"))
    assert r.state(2) is State.SUSPECT
    r.feed(Alive(member(2, 1)))  # same incarnation: not a refutation
    assert r.state(2) is State.SUSPECT
    r.feed(Alive(member(2, 2)))
    assert r.state(2) is State.ALIVE
    r.clock.run_for(CONFIG.suspicion_max(5) + 1)
    assert r.state(2) is State.ALIVE
    assert r.node.stats.deaths == 0


def test_dead_member_comes_back_with_a_higher_incarnation() -> None:
    r = rig()
    r.feed(Dead("sfo1/n2", 1, "sfo1/n3"))
    r.feed(Alive(member(2, 1)))
    assert r.state(2) is State.DEAD
    r.feed(Alive(member(2, 2)))
    assert r.state(2) is State.ALIVE


def test_two_live_processes_with_one_name_keep_the_known_one() -> None:
    r = rig()
    impostor = Member("sfo1/n2", "sfo1", "n2", Role.AGENT, Address("10.9.9.9", 7946), (), 5)
    r.feed(Alive(impostor))
    view = r.node.member("sfo1/n2")
    assert view is not None and view.member.addr == member(2).addr
    assert r.node.stats.rejected["conflict"] == 1


@pytest.mark.parametrize(("confirmers", "expected_after"), [(0, "max"), (1, "between"), (2, "min"), (3, "min")])
def test_confirmations_shorten_the_suspicion(confirmers: int, expected_after: str) -> None:
    config = GossipConfig(suspicion_mult=4, push_pull_interval=1000.0, join_sync_delays=())  # K = 2
    r = rig(peers=6, config=config)
    n = r.node.live_count()
    minimum, maximum = config.suspicion_min(n), config.suspicion_max(n)
    start = r.clock.now()
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n3"))
    for i in range(confirmers):
        r.feed(Suspect("sfo1/n2", 1, f"sfo1/n{4 + i}"))
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n3"))  # the same accuser twice is one accusation
    r.clock.run_until(start + maximum + 1, stop=lambda: r.state(2) is State.DEAD)
    took = r.clock.now() - start
    if expected_after == "max":
        assert took == pytest.approx(maximum, abs=0.01)
    elif expected_after == "min":
        assert took == pytest.approx(minimum, abs=0.01)
    else:
        assert minimum + 0.1 < took < maximum - 0.1


def test_new_confirmation_is_regossiped() -> None:
    r = rig(config=GossipConfig(suspicion_mult=4, push_pull_interval=1000.0, join_sync_delays=()))  # K = 2
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n3"))
    r.clock.run_for(3.0)
    before = len(r.wire.sent(Suspect))
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n4"))
    r.clock.run_for(3.0)
    assert len(r.wire.sent(Suspect)) > before


@pytest.mark.parametrize("accusation", [Suspect("sfo1/n1", 1, "sfo1/n2"), Dead("sfo1/n1", 1, "sfo1/n2"),
                                        Suspect("sfo1/n1", 5, "sfo1/n2")])
def test_accusation_of_ourselves_is_refuted(accusation: Suspect | Dead) -> None:
    r = rig()
    r.feed(accusation)
    assert r.node.local.incarnation == accusation.incarnation + 1
    assert r.node.stats.refutations == 1
    assert r.node.health_score == 1
    view = r.node.member("sfo1/n1")
    assert view is not None and view.state is State.ALIVE
    r.clock.run_for(1.0)
    alive = [m for m in r.wire.sent(Alive) if isinstance(m, Alive) and m.member.name == "sfo1/n1"]
    assert alive and alive[0].member.incarnation == accusation.incarnation + 1


def test_stale_accusation_is_answered_with_our_alive_on_the_ack() -> None:
    r = rig()
    r.feed(Suspect("sfo1/n1", 1, "sfo1/n2"))
    r.clock.run_for(10.0)  # the refutation (incarnation 2) has been gossiped to its limit
    r.wire.clear()
    # n3 missed it: its probe still carries the old suspicion. The ack answers it.
    r.feed(Ping(5, "sfo1/n1", "sfo1/n3"), Suspect("sfo1/n1", 1, "sfo1/n3"), source=3)
    (ack_packet,) = [parts for addr, parts in r.wire.packets if any(isinstance(m, Ack) for m in parts)]
    assert Alive(r.node.local) in ack_packet
    assert r.node.local.incarnation == 2 and r.node.stats.refutations == 1  # a reminder, not a new refutation


def test_suspect_probe_carries_the_suspicion_to_the_suspect() -> None:
    r = rig(peers=1, silent=(2,))
    r.feed(Suspect("sfo1/n2", 1, "sfo1/n3"))
    r.wire.clear()
    r.run_until_ping()
    (_, parts), = [(a, p) for a, p in r.wire.packets if any(isinstance(m, Ping) for m in p)]
    assert any(isinstance(m, Suspect) and m.node == "sfo1/n2" for m in parts)


# --- leave --------------------------------------------------------------------------------------


def test_leave_tells_others_at_once_and_ignores_alive_about_us() -> None:
    r = rig()
    r.node.leave()
    dead = [m for m in r.wire.sent(Dead) if isinstance(m, Dead)]
    assert dead and dead[0].is_leave and dead[0].node == "sfo1/n1"
    view = r.node.member("sfo1/n1")
    assert view is not None and view.state is State.LEFT
    r.feed(Suspect("sfo1/n1", 1, "sfo1/n2"))
    assert r.node.stats.refutations == 0


# --- push-pull and broadcasts -------------------------------------------------------------------


def test_push_pull_merges_member_lists_and_answers() -> None:
    r = rig(peers=1)
    remote = (MemberState(member(7), State.ALIVE), MemberState(member(8), State.LEFT),
              MemberState(member(2, 3), State.ALIVE), MemberState(member(1, 4), State.SUSPECT))
    r.node.receive_stream(encode(PushPull(join=True, reply=False, states=remote)), member(7).addr)
    assert r.state(7) is State.ALIVE
    assert r.node.member("sfo1/n8") is None          # never heard of it: a leave is no news
    view2 = r.node.member("sfo1/n2")
    assert view2 is not None and view2.member.incarnation == 3
    assert r.node.local.incarnation == 5             # the peer suspected us: refuted
    (addr, answer), = r.wire.streams
    assert addr == member(7).addr and isinstance(answer, PushPull) and answer.reply and answer.join
    assert {s.member.name for s in answer.states} == {"sfo1/n1", "sfo1/n2"}


def test_push_pull_reply_is_not_answered() -> None:
    r = rig(peers=1)
    r.node.receive_stream(encode(PushPull(False, True, (MemberState(member(7), State.ALIVE),))), member(7).addr)
    assert r.wire.streams == []
    assert r.state(7) is State.ALIVE


def test_push_pull_suspects_what_a_peer_thinks_is_dead() -> None:
    r = rig(peers=1)
    r.node.receive_stream(encode(PushPull(False, True, (MemberState(member(2), State.DEAD),))), member(7).addr)
    assert r.state(2) is State.SUSPECT


def test_join_contacts_every_seed() -> None:
    r = rig(peers=0)
    assert r.node.join([member(2).addr, member(3).addr]) == 2
    assert [a for a, _ in r.wire.streams] == [member(2).addr, member(3).addr]
    assert all(isinstance(m, PushPull) and m.join and not m.reply for _, m in r.wire.streams)


@pytest.mark.parametrize("peers", [3, 20])
def test_broadcast_is_sent_retransmit_limit_times(peers: int) -> None:
    r = rig(peers=peers)
    r.node.broadcast("event-1", b"payload")
    r.clock.run_for(20.0)
    sent = [m for m in r.wire.sent(User) if isinstance(m, User) and m.key == "event-1"]
    assert len(sent) == CONFIG.retransmit_limit(peers + 1)
    assert r.node.queued_broadcasts() == 0


def test_user_broadcast_delivered_once_and_regossiped() -> None:
    r = rig()
    message = User("event-2", "sfo1/n3", b"x")
    r.feed(message)
    r.feed(message)
    assert [c for c in r.changes if c[0] == "event-2"] == [("event-2", None, State.ALIVE)]
    r.clock.run_for(5.0)
    assert len([m for m in r.wire.sent(User) if m == message]) == CONFIG.retransmit_limit(5)


def test_piggybacked_packets_stay_within_the_datagram_budget() -> None:
    r = rig(peers=40)
    for i in range(200):
        r.node.broadcast(f"e{i}", bytes(300))
    r.clock.run_for(5.0)  # Wire.send_packet asserts the size of every datagram
    assert any(len(parts) > 2 for _, parts in r.wire.packets)


def test_stop_goes_silent() -> None:
    r = rig()
    r.node.stop()
    r.wire.clear()
    r.clock.run_for(10.0)
    r.feed(Ping(1, "sfo1/n1", "sfo1/n2"))
    assert r.wire.packets == []


def test_failed_members_are_retried_until_the_reconnect_timeout() -> None:
    config = GossipConfig(push_pull_interval=1000.0, join_sync_delays=(), reconnect_interval=5.0,
                          reconnect_timeout=60.0, gossip_to_the_dead=10.0)
    r = rig(peers=3, config=config)
    r.feed(Dead("sfo1/n2", 1, "sfo1/n3"))
    r.clock.run_for(30.0)
    tried = [a for a, m in r.wire.streams if isinstance(m, PushPull) and a == member(2).addr]
    assert len(tried) >= 4
    assert r.node.member("sfo1/n2") is None  # forgotten after gossip_to_the_dead, still retried
    r.clock.run_for(40.0)
    r.wire.clear()
    r.clock.run_for(30.0)
    assert not [a for a, _ in r.wire.streams if a == member(2).addr]


def test_a_left_member_is_not_retried() -> None:
    config = GossipConfig(push_pull_interval=1000.0, join_sync_delays=(), reconnect_interval=5.0)
    r = rig(peers=3, config=config)
    r.feed(Dead("sfo1/n2", 1, "sfo1/n2"))
    r.clock.run_for(30.0)
    assert not [a for a, _ in r.wire.streams if a == member(2).addr]
