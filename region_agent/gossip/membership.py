"""The SWIM + Lifeguard membership state machine, with no sockets and no sleeps.

Everything enters through :meth:`Membership.receive_packet`/:meth:`Membership.receive_stream` and
the timers of the injected :class:`~region_agent.gossip.scheduler.Scheduler`; everything leaves through
the injected :class:`Transport`. Callers must call all methods from one thread/event loop, and no
method blocks or awaits, so the protocol can run in virtual time (tests, ``bench/gossip_sim.py``).

The rules follow memberlist's ``state.go`` (hashicorp/memberlist):

* probe one member per (health-scaled) interval, round-robin over a shuffled list; no ack within
  the probe timeout → ask ``indirect_checks`` members to probe it (ping-req, they nack when the
  target stays silent); still no ack by the end of the interval → suspect it;
* a suspicion is gossiped; the suspected member refutes with a higher incarnation; otherwise it is
  declared dead when the Lifeguard timer fires (shortened by independent confirmations);
* local health (missed nacks, refutations) stretches this node's own timeouts;
* news (alive, suspect, dead, user broadcasts) is queued and piggybacked on every packet, and
  pushed to ``gossip_nodes`` random members every gossip interval;
* push-pull of the whole member list with one random member periodically and right after a join.

With :class:`~region_agent.gossip.credentials.Credentials` every member record is signed by its
member and checked before it counts (see that module); an accusation (suspect, dead) about an
incarnation newer than the member's signed record is ignored, so no forged datagram can push a
member past the incarnation it can refute.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from region_agent.gossip.awareness import Awareness
from region_agent.gossip.config import GossipConfig
from region_agent.gossip.credentials import Credentials
from region_agent.gossip.messages import (
    MAX_COMPOUND_PARTS,
    MAX_UINT32,
    NO_PROOF,
    Ack,
    Address,
    Alive,
    Compound,
    Dead,
    Member,
    MemberState,
    Message,
    MessageError,
    MessageType,
    Nack,
    Ping,
    PingReq,
    Proof,
    PushPull,
    Single,
    State,
    Suspect,
    Sync,
    User,
    decode,
    decode_parts,
    encode,
    message_type,
)
from region_agent.gossip.queue import COMPOUND_HEADER, PART_OVERHEAD, BroadcastQueue
from region_agent.gossip.scheduler import Scheduler, Timer
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.suspicion import Suspicion


class Transport(Protocol):
    """How bytes travel. Both sends are fire-and-forget and must not block."""

    overhead: int
    """Bytes the transport adds to each datagram (encryption header and tag)."""

    def send_packet(self, addr: Address, data: bytes) -> None:
        """Best effort, at most ``config.packet_bytes - overhead`` bytes."""
        ...

    def send_stream(self, addr: Address, data: bytes) -> None:
        """Reliable delivery of one message (push-pull), at most ``config.stream_bytes``."""
        ...


@dataclass(frozen=True, slots=True)
class MemberView:
    member: Member
    state: State
    since: float      # scheduler time of the last state change


class Events(Protocol):
    """Application callbacks, called synchronously from the receive path and timers: must not block."""

    def member_changed(self, view: MemberView, previous: State | None) -> None:
        """A member appeared (previous None), changed state, or changed its record."""
        ...

    def user_message(self, message: User) -> None:
        """A user broadcast arrived for the first time."""
        ...


class NoEvents:
    def member_changed(self, view: MemberView, previous: State | None) -> None:
        pass

    def user_message(self, message: User) -> None:
        pass


@dataclass(slots=True)
class _Node:
    member: Member
    state: State
    since: float
    proof: Proof = NO_PROOF    # the member's own signature of its record (empty without credentials)


@dataclass(slots=True)
class _Probe:
    target: str
    seq: int
    started: float
    interval: float
    expected_nacks: int = 0
    nacks: int = 0
    timers: list[Timer] = field(default_factory=list)


@dataclass(slots=True)
class _Contact:
    """A ping to one member of another region, every probe interval: contact with every region stays
    fresh however many members there are (the write gate's bound), and failure is SWIM's business."""

    target: str
    seq: int
    started: float
    timer: Timer | None = None


@dataclass(slots=True)
class _Relay:
    """A ping we send on behalf of another member's ping-req."""

    requester: Address
    seq: int
    nack: bool
    timer: Timer | None = None


_LIVE = (State.ALIVE, State.SUSPECT)
MAX_INCARNATION_LEAP = 1 << 20   # how far past our own incarnation an accusation of us is still refuted
_GONE = (State.DEAD, State.LEFT)


class Membership:
    def __init__(self, config: GossipConfig, local: Member, transport: Transport, scheduler: Scheduler, *,
                 rng: random.Random | None = None, events: Events | None = None,
                 stats: GossipStats | None = None, credentials: Credentials | None = None,
                 admit: Callable[[Member], str | None] | None = None,
                 wall: Callable[[], float] | None = None) -> None:
        """``admit``: a last word on a (verified) member record, None to take it or a rejection reason
        (another zone's agent)."""
        self.config = config
        self._wall = wall   # this agent's wall clock: acks carry it, and offsets to peers are measured
        self._credentials = credentials
        self._admit = admit
        self._transport = transport
        self._scheduler = scheduler
        self._rng = rng or random.Random()
        self._events: Events = events or NoEvents()
        self.stats = stats or GossipStats()
        self._awareness = Awareness(config.awareness_max_multiplier)
        self._queue = BroadcastQueue(config.broadcast_queue_max)
        # Incarnations start at 1 so that a peer's "never heard of it" (0) is always older.
        local = dataclasses.replace(local, incarnation=max(1, local.incarnation))
        self._name = local.name
        self._nodes: dict[str, _Node] = {local.name: _Node(local, State.ALIVE, scheduler.now(), self._prove(local))}
        self._live = 1
        self._probe_list: list[str] = [local.name]
        self._probe_index = 0
        self._seq = 0
        self._pending: dict[int, _Probe | _Relay | _Contact] = {}
        self._suspicions: dict[str, Suspicion] = {}
        self._seen_user: OrderedDict[str, None] = OrderedDict()
        self.rtt: dict[str, float] = {}   # member name → seconds of its last acked probe
        self.last_ack: dict[str, float] = {}   # member name → last contact: its ack of our probe, or its ping
        # member name → (its wall clock minus ours, in seconds, corrected by half the round trip; when measured,
        # in scheduler time; our wall clock then). Only with ``wall``.
        self.clock_offsets: dict[str, tuple[float, float, float]] = {}
        self._timers: dict[str, Timer] = {}
        self._failed: OrderedDict[str, tuple[Address, float]] = OrderedDict()  # reconnect candidates
        self._gossip_phase = 0.0
        self.running = False
        self.leaving = False

    def _prove(self, member: Member) -> Proof:
        return NO_PROOF if self._credentials is None else self._credentials.prove(member)

    def _alive_message(self, name: str) -> bytes:
        node = self._nodes[name]
        return encode(Alive(node.member, node.proof))

    # --- public API ---------------------------------------------------------------------------

    @property
    def local(self) -> Member:
        return self._nodes[self._name].member

    @property
    def health_score(self) -> int:
        return self._awareness.score

    def live_count(self) -> int:
        """Members believed alive or suspect, this node included: the N of every formula."""
        return self._live

    def members(self) -> list[MemberView]:
        return [MemberView(n.member, n.state, n.since) for n in self._nodes.values()]

    def member(self, name: str) -> MemberView | None:
        node = self._nodes.get(name)
        return None if node is None else MemberView(node.member, node.state, node.since)

    def dropped_broadcasts(self) -> int:
        return self._queue.dropped

    def queued_broadcasts(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        """Start the probe, gossip and push-pull timers, each at a random phase so nodes started
        together do not probe in lockstep."""
        if self.running:
            return
        self.running = True
        c = self.config
        self._schedule("probe", self._rng.uniform(0, c.probe_interval), self._probe_tick)
        self._schedule("contact", self._rng.uniform(0, c.probe_interval), self._contact_tick)
        self._gossip_phase = self._rng.uniform(0, c.gossip_interval)
        if self._queue:
            self._arm_gossip()
        self._schedule("push_pull", self._rng.uniform(0.5, 1.0) * c.push_pull_every(self._live), self._push_pull_tick)
        self._schedule("reconnect", self._rng.uniform(0.5, 1.0) * c.reconnect_every(self._live), self._reconnect_tick)

    def join(self, seeds: Iterable[Address]) -> int:
        """Push-pull with every seed, then again with random members after ``join_sync_delays``.
        Returns the number of seeds contacted (the answers arrive later)."""
        count = 0
        payload = self._push_pull_payload(join=True, reply=False)
        for seed in seeds:
            self._send_stream(seed, payload, "push_pull")
            count += 1
        for i, delay in enumerate(self.config.join_sync_delays):
            self._schedule(f"join_sync_{i}", delay, self._push_pull_random)
        return count

    def leave(self) -> None:
        """Tell the others we leave: a dead message from ourselves, pushed out at once. Keep the
        node running for a few gossip intervals afterwards so retransmissions go out, then stop()."""
        if self.leaving:
            return
        self.leaving = True
        self._dead_node(Dead(self._name, self.local.incarnation, self._name))
        self._gossip_round()

    def stop(self) -> None:
        """Go silent (no leave message): timers cancelled, input ignored."""
        self.running = False
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for pending in self._pending.values():
            timers = pending.timers if isinstance(pending, _Probe) else [pending.timer]
            for pending_timer in timers:
                if pending_timer is not None:
                    pending_timer.cancel()
        self._pending.clear()
        for suspicion in self._suspicions.values():
            suspicion.cancel()
        self._suspicions.clear()

    def broadcast(self, key: str, payload: bytes) -> None:
        """Spread an opaque user message to every member (epidemic: each receiver re-gossips it)."""
        message = User(key, self._name, payload)
        self._remember_user(key)
        self._enqueue("u:" + key, encode(message), urgent=True)

    def add_known(self, members: Iterable[Member]) -> None:
        """Start with members already known alive (a restart's cached list, the simulator's steady state)."""
        now = self._scheduler.now()
        added = [m for m in members if m.name not in self._nodes]
        for member in added:
            self._nodes[member.name] = _Node(member, State.ALIVE, now)
            self._probe_list.append(member.name)
            self._live += 1
        self._rng.shuffle(self._probe_list)
        for member in added:
            self._events.member_changed(MemberView(member, State.ALIVE, now), None)

    # --- input --------------------------------------------------------------------------------

    def receive_packet(self, data: bytes, source: Address) -> None:
        if not self.running:
            return
        try:
            message = decode(data)
            if isinstance(message, PushPull | Sync):
                raise MessageError("a stream message over a datagram")
            singles = decode_parts(message) if isinstance(message, Compound) else [message]
        except MessageError:
            self.stats.rejected["malformed"] += 1
            return
        if isinstance(message, Compound):
            self.stats.received("compound", COMPOUND_HEADER + PART_OVERHEAD * len(singles))
            for single, raw in zip(singles, message.parts, strict=True):
                self.stats.received(message_type(single).name.lower(), len(raw))
        else:
            self.stats.received(message_type(message).name.lower(), len(data))
        # Pings last, so that the ack carries whatever the rest of the packet made us say.
        for single in sorted(singles, key=lambda m: isinstance(m, Ping)):
            self._handle(single, source)

    def receive_stream(self, data: bytes, source: Address) -> None:
        if not self.running:
            return
        try:
            message = decode(data)
            if not isinstance(message, PushPull):
                raise MessageError("only push-pull travels over a stream")
        except MessageError:
            self.stats.rejected["malformed"] += 1
            return
        self.stats.received("push_pull", len(data))
        if not message.reply:
            self._send_stream(source, self._push_pull_payload(join=message.join, reply=True), "push_pull")
        self._merge(message.states)

    def _handle(self, message: Single, source: Address) -> None:
        match message:
            case Ping():
                if message.target != self._name:
                    self.stats.rejected["misdirected"] += 1
                    return
                if message.source in self._nodes:
                    self.last_ack[message.source] = self._scheduler.now()   # it reached us: contact
                self._send(source, Ack(message.seq, self._wall_ms()))
            case PingReq():
                self._relay_ping(message, source)
            case Ack():
                self._on_ack(message.seq, message.wall_ms)
            case Nack():
                pending = self._pending.get(message.seq)
                if isinstance(pending, _Probe):
                    pending.nacks += 1
            case Suspect():
                self._suspect_node(message)
            case Alive():
                self._alive_node(message.member, message.proof)
            case Dead():
                self._dead_node(message)
            case User():
                self._on_user(message)

    # --- probing ------------------------------------------------------------------------------

    def _probe_tick(self) -> None:
        target = self._next_probe_target()
        if target is None:
            self._schedule("probe", self.config.probe_interval, self._probe_tick)
            return
        self._probe_node(target)

    def _contact_tick(self) -> None:
        """Ping one live member of every other region (see :class:`_Contact`)."""
        by_region: dict[str, list[_Node]] = {}
        own = self.local.region
        for node in self._nodes.values():
            if node.state is State.ALIVE and node.member.region != own:
                by_region.setdefault(node.member.region, []).append(node)
        now = self._scheduler.now()
        for nodes in by_region.values():
            target = self._rng.choice(nodes)
            seq = self._next_seq()
            contact = _Contact(target.member.name, seq, now)
            self._pending[seq] = contact
            self._send(target.member.addr, Ping(seq, target.member.name, self._name))
            contact.timer = self._scheduler.call_later(self.config.probe_timeout, functools.partial(self._forget, seq))
        self._schedule("contact", self.config.probe_interval, self._contact_tick)

    def _forget(self, seq: int) -> None:
        self._pending.pop(seq, None)

    def _next_probe_target(self) -> _Node | None:
        for _ in range(2):  # at most one reshuffle
            while self._probe_index < len(self._probe_list):
                name = self._probe_list[self._probe_index]
                self._probe_index += 1
                node = self._nodes.get(name)
                if node is not None and name != self._name and node.state in _LIVE:
                    return node
            self._reset_probe_list()
        return None

    def _reset_probe_list(self) -> None:
        """End of a round: forget members dead for longer than gossip_to_the_dead, reshuffle."""
        now = self._scheduler.now()
        for name in [n for n, node in self._nodes.items()
                     if node.state in _GONE and now - node.since > self.config.gossip_to_the_dead and n != self._name]:
            del self._nodes[name]
            self.rtt.pop(name, None)
            self.last_ack.pop(name, None)
            self.clock_offsets.pop(name, None)
        self._probe_list = list(self._nodes)
        self._rng.shuffle(self._probe_list)
        self._probe_index = 0

    def _probe_node(self, target: _Node) -> None:
        self.stats.probes += 1
        seq = self._next_seq()
        now = self._scheduler.now()
        probe = _Probe(target.member.name, seq, now, self._awareness.scale(self.config.probe_interval))
        self._pending[seq] = probe
        extra: list[Single] = []
        if target.state is State.SUSPECT:
            # Carry the suspicion to the suspect itself, so it can refute at once.
            extra.append(Suspect(target.member.name, target.member.incarnation, self._name))
        self._send(target.member.addr, Ping(seq, target.member.name, self._name), extra)
        timeout = self._awareness.scale(self.config.probe_timeout)
        probe.timers.append(self._scheduler.call_later(timeout, lambda: self._probe_indirect(probe)))
        probe.timers.append(self._scheduler.call_later(probe.interval, lambda: self._probe_failed(probe)))

    def _probe_next(self, name: str) -> None:
        """Probe a suspect before anyone else. If it is dead, our failed probe is the independent
        confirmation Lifeguard waits for; if it is alive, our ping carries the suspicion and its ack
        carries the refutation back to us, whether or not the refutation's gossip ever reaches us.
        Only the order changes, so it costs no extra packets."""
        try:
            at = self._probe_list.index(name)
        except ValueError:
            return
        if at < self._probe_index:
            # Already probed this round: take the next slot, pushing the others back by one.
            self._probe_list.pop(at)
            self._probe_index -= 1
            self._probe_list.insert(self._probe_index, name)
        else:
            self._probe_list[at], self._probe_list[self._probe_index] = (
                self._probe_list[self._probe_index], self._probe_list[at])

    def _probe_indirect(self, probe: _Probe) -> None:
        if self._pending.get(probe.seq) is not probe:
            return
        target = self._nodes.get(probe.target)
        if target is None:
            return
        helpers = self._random_nodes(self.config.indirect_checks, exclude=(self._name, probe.target), live_only=True)
        probe.expected_nacks = len(helpers)
        for helper in helpers:
            self.stats.indirect_probes += 1
            self._send(helper.member.addr,
                       PingReq(probe.seq, probe.target, target.member.addr, self._name, nack=True))

    def _contacted(self, name: str, started: float, wall_ms: int) -> None:
        """An ack of our ping to ``name``: its round trip, the contact, and its clock."""
        now = self._scheduler.now()
        rtt = now - started
        self.rtt[name] = rtt
        self.last_ack[name] = now
        if wall_ms and self._wall is not None:
            ours = self._wall()
            self.clock_offsets[name] = (wall_ms / 1000 - (ours - rtt / 2), now, ours)

    def _wall_ms(self) -> int:
        return 0 if self._wall is None else max(0, int(self._wall() * 1000))

    def _on_ack(self, seq: int, wall_ms: int = 0) -> None:
        pending = self._pending.pop(seq, None)
        if pending is None:
            return
        if isinstance(pending, _Relay):
            if pending.timer is not None:
                pending.timer.cancel()
            self._send(pending.requester, Ack(pending.seq, wall_ms))
            return
        if isinstance(pending, _Contact):
            if pending.timer is not None:
                pending.timer.cancel()
            self._contacted(pending.target, pending.started, wall_ms)
            return
        for timer in pending.timers:
            timer.cancel()
        # Round trip of the probe (an indirect ack counts the relay's two extra hops too).
        self._contacted(pending.target, pending.started, wall_ms)
        self._awareness.apply(-1)
        self._schedule("probe", pending.started + pending.interval - self._scheduler.now(), self._probe_tick)

    def _probe_failed(self, probe: _Probe) -> None:
        if self._pending.pop(probe.seq, None) is not probe:
            return
        self.stats.probe_failures += 1
        # Lifeguard: helpers that did not even nack suggest the problem is ours, not the target's.
        if probe.expected_nacks > 0:
            self._awareness.apply(max(0, probe.expected_nacks - probe.nacks))
        else:
            self._awareness.apply(1)
        target = self._nodes.get(probe.target)
        if target is not None and self.running:
            self._suspect_node(Suspect(probe.target, target.member.incarnation, self._name))
        self._schedule("probe", 0.0, self._probe_tick)

    def _relay_ping(self, request: PingReq, requester: Address) -> None:
        seq = self._next_seq()
        relay = _Relay(requester, request.seq, request.nack)
        self._pending[seq] = relay

        def expire() -> None:
            if self._pending.pop(seq, None) is relay and relay.nack:
                self._send(requester, Nack(request.seq))

        relay.timer = self._scheduler.call_later(self.config.probe_timeout, expire)
        self._send(request.target_addr, Ping(seq, request.target, self._name))

    # --- state transitions ----------------------------------------------------------------------

    def _alive_node(self, member: Member, proof: Proof = NO_PROOF, cert: bytes = b"") -> None:
        name = member.name
        # We are on our way out: nobody may talk us back in.
        if self.leaving and name == self._name:
            return
        node = self._nodes.get(name)
        if self._credentials is not None and (node is None or member != node.member or proof != node.proof):
            problem = self._credentials.check(member, proof, cert)
            if problem is not None:
                self.stats.rejected[problem] += 1
                return
        if self._admit is not None and name != self._name:
            problem = self._admit(member)
            if problem is not None:
                self.stats.rejected[problem] += 1
                return
        if node is None:
            self._add_node(member, State.ALIVE, proof)
            self._enqueue("m:" + name, encode(Alive(member, proof)))
            return
        if name == self._name:
            # An alive about us that is not exactly ours (older record, or someone using our name): refute.
            if member.incarnation < node.member.incarnation or member == node.member:
                return
            self._refute(member.incarnation)
            return
        if member.addr != node.member.addr and node.state not in _GONE:
            # Two live processes claim one name; keep the one we know until it dies.
            self.stats.rejected["conflict"] += 1
            return
        # Old news (a restarted member refutes its old death with a higher incarnation).
        if member.incarnation <= node.member.incarnation and member.addr == node.member.addr:
            return
        suspicion = self._suspicions.pop(name, None)
        if suspicion is not None:
            suspicion.cancel()
        node.proof = proof
        self._enqueue("m:" + name, encode(Alive(member, proof)))
        self._set(node, State.ALIVE, member)

    def _suspect_node(self, message: Suspect) -> None:
        node = self._nodes.get(message.node)
        # Unknown member, or news older than what we know: ignore.
        if node is None or message.incarnation < node.member.incarnation:
            self._remind_if_about_us(message.node)
            return
        if self._beyond_refutation(message.node, message.incarnation, node.member.incarnation):
            return
        suspicion = self._suspicions.get(message.node)
        if suspicion is not None:
            # Another accuser: shortens the timer, and is worth telling others (Lifeguard).
            if suspicion.confirm(message.source):
                self._enqueue("m:" + message.node, encode(message))
            return
        if node.state is not State.ALIVE:
            return
        if message.node == self._name:
            self._refute(message.incarnation)
            return
        self.stats.suspicions += 1
        self._enqueue("m:" + message.node, encode(message))
        self._set(node, State.SUSPECT, dataclasses.replace(node.member, incarnation=message.incarnation))
        n = self._live
        incarnation = message.incarnation

        def timeout() -> None:
            self._suspicions.pop(message.node, None)
            current = self._nodes.get(message.node)
            if current is not None and current.state is State.SUSPECT and current.member.incarnation == incarnation:
                self.stats.deaths += 1
                self._dead_node(Dead(message.node, incarnation, self._name))

        self._probe_next(message.node)
        self._suspicions[message.node] = Suspicion(
            self._scheduler, accuser=message.source, minimum=self.config.suspicion_min(n),
            maximum=self.config.suspicion_max(n), expected=self.config.expected_confirmations(n),
            on_timeout=timeout)

    def _dead_node(self, message: Dead) -> None:
        node = self._nodes.get(message.node)
        if node is None or message.incarnation < node.member.incarnation:
            self._remind_if_about_us(message.node)
            return
        if self._beyond_refutation(message.node, message.incarnation, node.member.incarnation):
            return
        suspicion = self._suspicions.pop(message.node, None)
        if suspicion is not None:
            suspicion.cancel()
        if node.state in _GONE:
            return
        if message.node == self._name and not self.leaving:
            self._refute(message.incarnation)
            return
        self._enqueue("m:" + message.node, encode(message), urgent=True)
        self._set(node, State.LEFT if message.is_leave else State.DEAD,
                  dataclasses.replace(node.member, incarnation=message.incarnation))

    def _beyond_refutation(self, name: str, accused: int, known: int) -> bool:
        """Whether an accusation names an incarnation that only a forgery can name, and is ignored.

        About another member: any incarnation newer than its own (signed) record; its alive comes
        first, then news of it. About us: one more than ``MAX_INCARNATION_LEAP`` past ours (a
        restarted agent refutes the accusations of its previous life, which it starts above);
        at 2**32-1 an accusation could never be outbid, so a forged one must not be taken.
        """
        limit = known + MAX_INCARNATION_LEAP if name == self._name else known
        if accused <= limit:
            return False
        self.stats.rejected["future-incarnation"] += 1
        self._remind_if_about_us(name)
        return True

    def _remind_if_about_us(self, name: str) -> None:
        """Someone still repeats an accusation we already refuted: queue our current alive again
        (no new incarnation). A suspector's ping carries its suspicion, so our ack carries the
        answer straight back, instead of hoping the refutation's epidemic reached it."""
        if name == self._name and not self.leaving:
            self._enqueue("m:" + self._name, self._alive_message(self._name))

    def update_meta(self, meta: dict[str, str]) -> bool:
        """Change this node's metadata (memberlist's UpdateNode): a new incarnation, announced at once.
        Returns False when nothing changed (no broadcast)."""
        node = self._nodes[self._name]
        wanted = Member.meta_from(meta)
        if wanted == node.member.meta:
            return False
        member = dataclasses.replace(node.member, meta=wanted, incarnation=min(MAX_UINT32, node.member.incarnation + 1))
        node.member, node.proof = member, self._prove(member)
        self._enqueue("m:" + self._name, self._alive_message(self._name), urgent=True)
        self._events.member_changed(MemberView(member, node.state, node.since), node.state)
        return True

    def _refute(self, accused: int) -> None:
        """Someone thinks we are suspect or dead at incarnation ``accused``: outbid it."""
        node = self._nodes[self._name]
        member = dataclasses.replace(node.member,
                                     incarnation=min(MAX_UINT32, max(node.member.incarnation, accused) + 1))
        node.member, node.proof = member, self._prove(member)
        self.stats.refutations += 1
        self._awareness.apply(1)
        self._enqueue("m:" + self._name, self._alive_message(self._name), urgent=True)

    def _merge(self, states: Sequence[MemberState]) -> None:
        for row in states:
            member = row.member
            if row.state is State.ALIVE:
                self._alive_node(member, row.proof, row.cert)
            elif row.state is State.LEFT:
                self._dead_node(Dead(member.name, member.incarnation, member.name))
            else:
                # A peer's suspicion or verdict is only a reason to suspect: we check ourselves.
                self._suspect_node(Suspect(member.name, member.incarnation, self._name))

    def _add_node(self, member: Member, state: State, proof: Proof = NO_PROOF) -> None:
        now = self._scheduler.now()
        node = _Node(member, state, now, proof)
        self._nodes[member.name] = node
        if state in _LIVE:
            self._live += 1
        # A random position, so a new member is not probed by everyone at the same moment.
        self._probe_list.insert(self._rng.randint(0, len(self._probe_list)), member.name)
        self._events.member_changed(MemberView(member, state, now), None)

    def _set(self, node: _Node, state: State, member: Member) -> None:
        previous = node.state
        node.member = member
        name = member.name
        if state is State.DEAD and name != self._name:
            self._failed[name] = (member.addr, self._scheduler.now())
            self._failed.move_to_end(name)
            while len(self._failed) > self.config.reconnect_limit:
                self._failed.popitem(last=False)
        else:
            self._failed.pop(name, None)
        if state is not previous:
            self._live += (state in _LIVE) - (previous in _LIVE)
            node.since = self._scheduler.now()
            node.state = state
        self._events.member_changed(MemberView(member, state, node.since), previous)

    def _on_user(self, message: User) -> None:
        if message.key in self._seen_user:
            return
        self._remember_user(message.key)
        self._enqueue("u:" + message.key, encode(message), urgent=True)
        self._events.user_message(message)

    def _remember_user(self, key: str) -> None:
        self._seen_user[key] = None
        while len(self._seen_user) > self.config.user_seen_keys:
            self._seen_user.popitem(last=False)

    # --- gossip and push-pull --------------------------------------------------------------------

    def _enqueue(self, key: str, payload: bytes, *, urgent: bool = False) -> None:
        """Queue news for gossip. Urgent news (a user broadcast, a death, our own refutation) starts
        a gossip round now instead of at the next tick: the number of transmissions is the same,
        but each hop then costs a network latency instead of up to a gossip interval."""
        self._queue.queue(key, payload)
        if urgent and self.running:
            self._schedule("gossip", 0.0, self._gossip_tick)
        else:
            self._arm_gossip()

    def _arm_gossip(self) -> None:
        """The gossip timer runs only while something is queued (an idle cluster sends no gossip
        anyway); it keeps this node's random phase within the interval."""
        if "gossip" in self._timers or not self.running:
            return
        interval = self.config.gossip_interval
        now = self._scheduler.now()
        delay = (self._gossip_phase - now) % interval
        self._schedule("gossip", delay, self._gossip_tick)

    def _gossip_tick(self) -> None:
        self._timers.pop("gossip", None)
        self._gossip_round()
        if self._queue:
            self._schedule("gossip", self.config.gossip_interval, self._gossip_tick)

    def _gossip_round(self) -> None:
        if not self._queue:
            return
        now = self._scheduler.now()
        targets = self._random_nodes(
            self.config.gossip_nodes, exclude=(self._name,), live_only=False,
            # Gossip to the recently dead too, so they learn it and can refute.
            recent=now - self.config.gossip_to_the_dead)
        limit = self.config.retransmit_limit(self._live)
        budget = self._packet_budget() - COMPOUND_HEADER
        for target in targets:
            parts = self._queue.take(budget, limit, MAX_COMPOUND_PARTS)
            if not parts:
                return
            self._send_raw(target.member.addr, parts)

    def _push_pull_tick(self) -> None:
        self._push_pull_random()
        self._schedule("push_pull", self.config.push_pull_every(self._live), self._push_pull_tick)

    def _push_pull_random(self) -> None:
        peers = self._random_nodes(1, exclude=(self._name,), live_only=True)
        if peers:
            self.stats.push_pulls += 1
            self._send_stream(peers[0].member.addr, self._push_pull_payload(join=False, reply=False), "push_pull")

    def _reconnect_tick(self) -> None:
        """Push-pull with one member we believe failed: if it is back (or was only cut off), both
        sides learn the other's view, refute what is wrong and meet again."""
        self._schedule("reconnect", self.config.reconnect_every(self._live), self._reconnect_tick)
        horizon = self._scheduler.now() - self.config.reconnect_timeout
        while self._failed and next(iter(self._failed.values()))[1] < horizon:
            self._failed.popitem(last=False)
        if not self._failed:
            return
        addr, _ = self._failed[self._rng.choice(list(self._failed))]
        self.stats.reconnects += 1
        self._send_stream(addr, self._push_pull_payload(join=False, reply=False), "push_pull")

    def _push_pull_payload(self, *, join: bool, reply: bool) -> bytes:
        credentials = self._credentials
        states = tuple(MemberState(n.member, n.state, n.proof,
                                   b"" if credentials is None or not n.proof else credentials.certificate(n.proof))
                       for n in self._nodes.values())
        return encode(PushPull(join, reply, states))

    # --- helpers --------------------------------------------------------------------------------

    def _random_nodes(self, k: int, *, exclude: tuple[str, ...], live_only: bool,
                      recent: float | None = None) -> list[_Node]:
        """Up to k distinct random eligible members: an exact sample in small clusters, random tries
        (3N at most, as memberlist) in big ones so a gossip round does not scan the whole list."""
        names = self._probe_list

        def eligible(name: str) -> _Node | None:
            node = self._nodes.get(name)
            if node is None or name in exclude:
                return None
            if node.state in _LIVE or (not live_only and recent is not None and node.since >= recent):
                return node
            return None

        if len(names) <= 8 * k:
            candidates = [node for name in names if (node := eligible(name)) is not None]
            return self._rng.sample(candidates, min(k, len(candidates)))
        chosen: dict[str, _Node] = {}
        for _ in range(3 * len(names)):
            if len(chosen) >= k:
                break
            name = names[self._rng.randrange(len(names))]
            if name not in chosen and (node := eligible(name)) is not None:
                chosen[name] = node
        return list(chosen.values())

    def _packet_budget(self) -> int:
        return self.config.packet_bytes - self._transport.overhead

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFF_FFFF
        return self._seq

    def _schedule(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        if not self.running:
            return
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        self._timers[name] = self._scheduler.call_later(max(0.0, delay), callback)

    def _send(self, addr: Address, message: Message, extra: Sequence[Single] = ()) -> None:
        """Send one message, with as many queued broadcasts piggybacked as fit the datagram."""
        parts = [encode(message), *(encode(m) for m in extra)]
        used = COMPOUND_HEADER + sum(len(p) + PART_OVERHEAD for p in parts)
        parts += self._queue.take(self._packet_budget() - used, self.config.retransmit_limit(self._live),
                                  MAX_COMPOUND_PARTS - len(parts))
        self._send_raw(addr, parts)

    def _send_raw(self, addr: Address, parts: list[bytes]) -> None:
        for part in parts:
            self.stats.sent(MessageType(part[1]).name.lower(), len(part))
        if len(parts) == 1:
            data = parts[0]
        else:
            data = encode(Compound(tuple(parts)))
            self.stats.sent("compound", len(data) - sum(len(p) for p in parts))
        self._transport.send_packet(addr, data)

    def _send_stream(self, addr: Address, data: bytes, kind: str) -> None:
        self.stats.sent(kind, len(data))
        self._transport.send_stream(addr, data)
