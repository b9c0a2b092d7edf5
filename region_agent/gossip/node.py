"""One agent's place in the cluster: transport, membership and anti-entropy, wired together.

:class:`GossipNode` binds the encrypted UDP/TCP transport, runs the SWIM membership on the event
loop, routes stream messages (push-pull of members to the membership, sync steps to
anti-entropy), hands user broadcasts to the application's handlers, and keeps joining the seeds
while it knows nobody (backoff with jitter: a lone agent of a new region, or a whole cluster
restarted at once, finds the others as soon as they are up).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from region_agent.gossip.credentials import Credentials
from region_agent.gossip.keyring import Keyring
from region_agent.gossip.membership import Membership, MemberView
from region_agent.gossip.messages import Address, Member, MessageError, MessageType, Role, State, User, decode
from region_agent.gossip.scheduler import AsyncioScheduler
from region_agent.gossip.settings import GossipSettings
from region_agent.gossip.stats import GossipStats
from region_agent.gossip.sync import AntiEntropy, Replica
from region_agent.gossip.transport import GossipTransport, StreamLimits

logger = logging.getLogger("region_agent.gossip")

UserHandler = Callable[[User], bool]          # True when the handler took the message
MemberListener = Callable[[MemberView, State | None], None]
LEAVE_GRACE = 1.0   # seconds the leave broadcast gets to go out before the sockets close
SEED_WARN_INTERVAL = 600.0   # seconds between two warnings that one seed (or seeds_dns) does not resolve


class GossipNode:
    def __init__(self, settings: GossipSettings, *, region: str, node: str, keyring: Keyring, replica: Replica,
                 role: Role = Role.AGENT, tls: Any = None, rng: random.Random | None = None,
                 credentials: Credentials | None = None, meta: dict[str, str] | None = None,
                 admit: Callable[[Member], str | None] | None = None) -> None:
        self.settings = settings
        self.name = f"{region}/{node}"
        self.region = region
        self.node = node
        self.role = role
        self.keyring = keyring
        self.replica = replica
        self.tls = tls
        self.credentials = credentials   # signed member records; None: a lab cluster (records taken as given)
        self.meta = dict(meta or {})     # this agent's member metadata at start (its zone, say)
        self.admit = admit
        self.stats = GossipStats()
        self.config = settings.timings()
        self.transport: GossipTransport | None = None
        self.membership: Membership | None = None
        self.anti_entropy: AntiEntropy | None = None
        self.user_handlers: list[UserHandler] = []
        self.member_listeners: list[MemberListener] = []
        self.join_attempts = 0
        self.joined = asyncio.Event()      # set once another member is known
        self._rng = rng or random.Random()
        self._alone = asyncio.Event()
        self.seed_warnings: dict[str, float] = {}   # seed that does not resolve -> monotonic time of its warning

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        # Peers reach us (and streams name us) at the advertised address, not a wildcard bind.
        transport = await GossipTransport.start(self.settings.bind_address, self.settings.port, self.keyring,
                                                self.stats, advertised=self.settings.advertised, tls=self.tls,
                                                max_stream=self.config.stream_bytes,
                                                limits=StreamLimits.from_settings(self.settings))
        self.transport = transport
        # A restarted agent starts above every incarnation of its previous life (wall seconds), so
        # the others' memory of it is old news and no accusation of its past needs refuting.
        local = Member(self.name, self.region, self.node, self.role, transport.addr, Member.meta_from(self.meta),
                       incarnation=int(time.time()))
        self.membership = Membership(self.config, local, transport, AsyncioScheduler(), rng=self._rng,
                                     events=self, stats=self.stats, credentials=self.credentials, admit=self.admit,
                                     wall=time.time)
        self.anti_entropy = AntiEntropy(name=self.name, replica=self.replica, send=transport.send_stream,
                                        peers=self.peer_addresses, interval=self.settings.sync_interval,
                                        rng=self._rng)
        transport.attach(self)
        self.membership.start()
        self._alone.set()
        logger.info("gossip: %s listening on %s (%s preset)", self.name, transport.addr, self.settings.preset)

    async def stop(self) -> None:
        """Leave gracefully (others mark us left at once, not dead after a suspicion), then close."""
        if self.membership is not None and self.membership.running:
            self.membership.leave()
            await asyncio.sleep(min(LEAVE_GRACE, 3 * self.config.gossip_interval))
            self.membership.stop()
        if self.transport is not None:
            await self.transport.close()

    async def run_anti_entropy(self) -> None:
        assert self.anti_entropy is not None
        await self.anti_entropy.run()

    async def run_join(self) -> None:
        """Join the seeds whenever no other member is alive, with backoff and jitter between attempts."""
        delay = 0.5
        while True:
            await self._alone.wait()
            seeds = await self.resolve_seeds()
            if seeds:
                self.join_attempts += 1
                assert self.membership is not None
                self.membership.join(seeds)
            await asyncio.sleep(delay * self._rng.uniform(0.5, 1.5))
            delay = min(delay * 2, self.settings.join_retry_max) if self._alone.is_set() else 0.5

    async def resolve_seeds(self) -> list[Address]:
        """The configured seeds and the addresses behind ``seeds_dns``, never ourselves.

        A seed that does not resolve is warned about once per :data:`SEED_WARN_INTERVAL` (the join
        retries every few seconds), and one info line says when it resolves again."""
        out: list[Address] = []
        loop = asyncio.get_running_loop()

        async def lookup(what: str, host: str, port: int) -> list[Any]:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a lookup
                # that ends as the task is cancelled and drops the cancel, so a stop would wait its budget.
                async with asyncio.timeout(5.0):
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            except (OSError, TimeoutError) as exc:
                now = time.monotonic()
                warned = self.seed_warnings.get(what)
                if warned is None or now - warned >= SEED_WARN_INTERVAL:
                    self.seed_warnings[what] = now
                    logger.warning("gossip: %s does not resolve: %s (said again at most every %.0f min)",
                                   what, str(exc) or "no answer within 5 s", SEED_WARN_INTERVAL / 60)
                return []
            if self.seed_warnings.pop(what, None) is not None:
                logger.info("gossip: %s resolves again", what)
            return list(infos)

        for host, port in self.settings.seed_list():
            infos = await lookup(f"seed {host}", host, port)
            out.extend(Address(str(info[4][0]), port) for info in infos[:1])
        if self.settings.seeds_dns:
            infos = await lookup(f"seeds_dns {self.settings.seeds_dns}", self.settings.seeds_dns, self.settings.port)
            out.extend(Address(str(info[4][0]), self.settings.port) for info in infos)
        me = self.transport.addr if self.transport is not None else None
        unique: dict[Address, None] = {}
        for addr in out:
            if addr != me:
                unique[addr] = None
        return list(unique)

    # --- views --------------------------------------------------------------------------------

    def members(self) -> list[MemberView]:
        return [] if self.membership is None else self.membership.members()

    def peer_addresses(self) -> Sequence[Address]:
        """Live members other than this one: anti-entropy partners."""
        return [v.member.addr for v in self.members()
                if v.member.name != self.name and v.state in (State.ALIVE, State.SUSPECT)]

    def alive_regions(self) -> set[str]:
        """Regions with at least one agent alive or suspect (this one's included)."""
        return {v.member.region for v in self.members() if v.state in (State.ALIVE, State.SUSPECT)
                and v.member.role is Role.AGENT}

    def broadcast(self, key: str, payload: bytes) -> None:
        if self.membership is not None:
            self.membership.broadcast(key, payload)

    def queued_broadcasts(self) -> int:
        return 0 if self.membership is None else self.membership.queued_broadcasts()

    def sync_now(self, fanout: int = 1) -> None:
        if self.anti_entropy is not None:
            self.anti_entropy.sync_now(fanout)

    # --- transport receiver -------------------------------------------------------------------

    def receive_packet(self, data: bytes, source: Address) -> None:
        if self.membership is not None:
            self.membership.receive_packet(data, source)

    def receive_stream(self, data: bytes, source: Address) -> None:
        if len(data) >= 2 and data[1] == MessageType.SYNC:
            if self.anti_entropy is None or self.membership is None or not self.membership.running:
                return
            try:
                message = decode(data)
            except MessageError:
                self.stats.rejected["malformed"] += 1
                return
            self.stats.received("sync", len(data))
            self.anti_entropy.receive(message, source)   # type: ignore[arg-type]
            return
        if self.membership is not None:
            self.membership.receive_stream(data, source)

    # --- membership events --------------------------------------------------------------------

    def member_changed(self, view: MemberView, previous: State | None) -> None:
        others_alive = any(v.member.name != self.name and v.state in (State.ALIVE, State.SUSPECT)
                           for v in self.members())
        if others_alive:
            self._alone.clear()
            if not self.joined.is_set():
                self.joined.set()
                self.sync_now(1)   # catch up at once instead of at the next periodic round
        else:
            self._alone.set()
        if view.state in (State.DEAD, State.LEFT) and self.anti_entropy is not None:
            self.anti_entropy.forget_peer(view.member.name)
        if previous is not view.state:
            logger.info("gossip: member %s (%s) %s -> %s", view.member.name, view.member.addr,
                        "new" if previous is None else previous.name.lower(), view.state.name.lower())
        for listener in list(self.member_listeners):
            listener(view, previous)

    def user_message(self, message: User) -> None:
        for handler in self.user_handlers:
            if handler(message):
                return
        self.stats.rejected["unknown_user"] += 1

    def since_wall(self, view: MemberView) -> float:
        """A member view's ``since`` (loop time) as wall time."""
        return time.time() - (asyncio.get_running_loop().time() - view.since)
