"""This agent's part of a gossip cluster, built and wired in one place.

:class:`ClusterParts` binds the gossip port (a port in use, a bad keyring or bad TLS files stop
the agent with :class:`~region_agent.app.settings.SettingsError` naming the setting), then wires:

- the store replica (``s:`` broadcasts and anti-entropy of the replicated store),
- the observer (liveness from the membership, ingress probes of the other regions, ``o:``
  observation broadcasts) and the verdicts it feeds (:class:`~region_agent.cluster.answers.ClusterAnswers`,
  laid over the answers),
- the write gate the control API asks,
- the keyring file watcher and, with mutual TLS, the certificate files watcher;
- this agent's identity: its certificate (the TLS one, naming its region) signs every store entry
  it writes and its member record; the store checks every peer's entry against the certificates
  it holds (each agent files its own as a ``cert`` entry), the membership every member record.
  Without identity certificates a cluster starts only with ``gossip.allow_unsigned`` (a lab).

:meth:`runners` are the loops the supervisor runs; the rest are views of the cluster for the
region view, the control API and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from region_agent.app.replication import StoreReplica
from region_agent.app.revocations import RevocationError, Revocations
from region_agent.app.settings import AgentSettings, SettingsError
from region_agent.base.identity import CertBook, IdentityError, Signer, fingerprint
from region_agent.checks.rule import CheckRule
from region_agent.cluster.answers import ClusterAnswers
from region_agent.cluster.clock import ClockVerdict, clock_verdict
from region_agent.cluster.members import LIVE_STATES, MemberRow, member_rows
from region_agent.cluster.observer import ClusterObserver
from region_agent.cluster.quorum import REPORTS_META, REPORTS_PENDING, Policy, Quorum, has_majority
from region_agent.cluster.write_gate import WriteGate
from region_agent.gossip.credentials import IdentityCredentials
from region_agent.gossip.keyfile import KeyringWatcher, load_keyring
from region_agent.gossip.membership import Membership, MemberView
from region_agent.gossip.messages import Member, Role, State
from region_agent.gossip.metrics import register
from region_agent.gossip.node import GossipNode
from region_agent.gossip.sync import AntiEntropy
from region_agent.state.hlc import physical_ms
from region_agent.state.model import Certificate, cert_key, writer_agent
from region_agent.state.observations import Observations
from region_agent.state.persist import HORIZON_MARGIN_SECONDS, SnapshotTimes, absence_at_start
from region_agent.state.signatures import EntryVerifier
from region_agent.state.store import Store

if TYPE_CHECKING:
    from region_agent.gossip.tls import GossipTls

Runner = Callable[[], Coroutine[Any, Any, None]]
logger = logging.getLogger("region_agent.gossip")
CLOCK_CHECK_SECONDS = 5.0


class ClusterParts:
    def __init__(self, settings: AgentSettings, *, store: Store, observations: Observations,
                 registry: CollectorRegistry, user_agent: str, snapshot: SnapshotTimes | None = None) -> None:
        self.settings = settings
        self.store = store
        self.snapshot = snapshot   # the times of the snapshot the store was loaded from; None: started empty
        self.observations = observations
        self.registry = registry
        self.user_agent = user_agent
        self.quorum = Quorum(local_region=settings.region, max_age=settings.cluster.observation_max_age,
                             clock=time.time)
        self.view_listeners: list[Callable[[], None]] = []   # membership or verdicts changed
        self.tls: GossipTls | None = None
        self.unsigned = False   # a lab cluster (gossip.allow_unsigned): nothing signed, nothing checked
        self.revocations: Revocations | None = None
        self._zone_refused: set[str] = set()   # members logged once as of another zone

    async def start(self) -> None:
        """Bind the gossip port and wire everything; joining and syncing run in :meth:`runners`."""
        g = self.settings.gossip
        assert g.keyring_file is not None  # the settings require it
        try:
            keyring = load_keyring(g.keyring_file)
        except (ValueError, OSError) as exc:
            raise SettingsError(f"gossip.keyring_file: {exc}") from exc
        if g.tls_ca_file is not None and g.tls_cert_file is not None and g.tls_key_file is not None:
            from region_agent.gossip.tls import GossipTls

            try:
                self.tls = GossipTls.from_files(g.tls_ca_file, g.tls_cert_file, g.tls_key_file)
            except (ValueError, OSError) as exc:
                raise SettingsError(f"gossip.tls_*: {exc}") from exc
        credentials = self._identity()
        self.replica = StoreReplica(self.store, self.registry)
        role = Role.WITNESS if self.settings.cluster.role == "witness" else Role.AGENT
        node = self.node = GossipNode(g, region=self.settings.region, node=self.settings.node, keyring=keyring,
                                      replica=self.replica, tls=self.tls, role=role, credentials=credentials,
                                      meta=self._initial_meta(role), admit=self._same_zone)
        try:
            await node.start()
        except OSError as exc:
            raise SettingsError(f"gossip.port: can not listen on {g.bind_address} port {g.port}: "
                                f"{exc.strerror or exc}") from exc
        assert node.membership is not None and node.anti_entropy is not None  # start() made them
        self.membership: Membership = node.membership
        self.anti_entropy: AntiEntropy = node.anti_entropy
        self.keyring_watcher = KeyringWatcher(g.keyring_file, keyring)
        register(node, self.registry, self.keyring_watcher, regions=self.store.regions.keys)
        c, checks = self.settings.cluster, self.settings.checks
        self.observer = ClusterObserver(
            region=self.settings.region, settings=c, quorum=self.quorum, store=self.store, members=node.members,
            broadcast=node.broadcast, member_name=node.name, check_host=checks.host, check_port=checks.port,
            user_agent=f"{self.user_agent} ingress-probe", registry=self.registry,
            signer=None if self.unsigned else self._current_signer, book=None if self.unsigned else self.book,
            rule=CheckRule(checks.interval, checks.recheck_delay, checks.fall, checks.rise))
        self.answers = ClusterAnswers(store=self.store, observations=self.observations, view=self.observer.view,
                                      policy=Policy(c.two_region_policy), registry=self.registry)
        self.write_gate = WriteGate(self.observer.view, self.membership, asyncio.get_running_loop().time)
        # Away longer than the tombstone horizon (no fresh sync while a majority was in sight): rejoin pull-only.
        self.anti_entropy.absent_limit = self.store.control_tombstone_ttl_ms / 1000 - HORIZON_MARGIN_SECONDS
        self.anti_entropy.counts = lambda: has_majority(self.observer.view())
        self.anti_entropy.on_pull_only = self._on_pull_only
        self.pull_listeners: list[Callable[[bool], None]] = []
        max_offset = self.settings.cluster.max_clock_offset
        self.store.clock.max_drift_ms = int((3 * max_offset + 1) * 1000)
        if self.snapshot is not None:
            # The absence clock goes on from the snapshot's last fresh round, not from this start; a time
            # ahead of this clock by more than what the store accepts from a peer is unknown (see there).
            # Here, before the first await after the node started: no round has run yet.
            away = absence_at_start(self.snapshot, time.time(), tolerance=self.store.clock.max_drift_ms / 1000)
            logger.info("gossip: last fresh sync round %s", "unknown" if math.isinf(away)
                        else f"{away / 86_400:.1f} days ago (from the state file)")
            self.anti_entropy.restore_absence(away)
        self._clock_gauges()
        self._certificate_gauges()
        self.observer.listeners.append(self.answers.request)
        self.answers.listeners.append(self._view_changed)
        node.user_handlers.append(self.replica.user_message)
        node.user_handlers.append(self.observer.user_message)
        self.replica.attach(node.broadcast, node.sync_now, node.queued_broadcasts)
        node.member_listeners.append(self._on_member_change)
        if self.store.signer is not None:
            self._file_certificate()   # after attach: it goes out as a broadcast, not only by anti-entropy

    def _identity(self) -> IdentityCredentials | None:
        """Sign and verify from here on, or (a lab) neither; raises SettingsError for a certificate that
        names no identity, or one of another region."""
        tls = self.tls
        if tls is None or tls.signer is None:
            if not self.settings.gossip.allow_unsigned:
                why = "no TLS files" if tls is None else tls.identity_problem
                raise SettingsError(f"gossip.tls_cert_file: identity certificates are required in cluster mode ({why})")
            logger.warning("gossip.allow_unsigned: this cluster runs WITHOUT identity certificates; any holder of "
                           "the gossip keyring can forge any write, member or vote. Never run it so in production.")
            self.unsigned = True
            return None
        signer = tls.signer
        if not signer.identity.covers(self.settings.region, self.settings.node):
            raise SettingsError(f"gossip.tls_cert_file: the certificate names {signer.identity.name}, not this agent "
                                f"({self.settings.region}/{self.settings.node})")
        self.book = CertBook(tls.authorities)
        for cert in list(self.store.certificates.values()):   # what the snapshot brought
            with contextlib.suppress(IdentityError):
                self.book.add(cert.der)
        self.book.add(signer.identity.der)
        if self.settings.gossip.revoked_file is not None:
            self.revocations = Revocations(self.settings.gossip.revoked_file, self.book, self.store)
            try:
                self.revocations.load()
            except RevocationError as exc:
                raise SettingsError(f"gossip.revoked_file: {exc}") from exc
        tls.peer_check = self._peer_check
        self.store.signer = signer
        self.store.verifier = EntryVerifier(self.book)
        tls.listeners.append(self._certificate_rotated)
        return IdentityCredentials(self.book, self._current_signer)

    def _peer_check(self, der: bytes) -> str | None:
        """A stream peer's certificate: learned (to check what it signs) unless revoked or no identity."""
        try:
            self.book.add(der)
        except IdentityError:
            return "revoked" if fingerprint(der) in self.book.revoked else "no-identity"
        return None

    def _initial_meta(self, role: Role) -> dict[str, str]:
        meta = {"zone": self.settings.dns.zone}
        if role is Role.AGENT:
            # Until it has reported its copies (ready), what the store holds of its region is from before
            # it started: the others keep the region out of their answers meanwhile.
            meta[REPORTS_META] = REPORTS_PENDING
        return meta

    def reported(self) -> None:
        """This agent's copies are reported (it is ready): its region may be answered from the store, once
        the others hold these reports (the newest one's HLC goes with the announcement)."""
        # What the others count (the observer's reports: copy entries with a value), not a deletion's HLC,
        # which they never hold as a report: the region would stay "returning".
        self.announce(REPORTS_META, str(self.observer.reports.get(self.store.writer, 0)))

    def _same_zone(self, member: Member) -> str | None:
        """An agent configured for another zone is no member of this cluster (it would serve our store)."""
        theirs = member.metadata.get("zone")
        if theirs == self.settings.dns.zone:
            return None
        if member.name not in self._zone_refused:
            self._zone_refused.add(member.name)
            logger.warning("gossip member %s refused: it serves zone %s, this agent %s", member.name, theirs,
                           self.settings.dns.zone)
        return "zone-mismatch"

    def _current_signer(self) -> Signer:
        assert self.tls is not None and self.tls.signer is not None
        return self.tls.signer

    def _file_certificate(self) -> None:
        """This agent's certificate into the store, so every agent can check what it signs."""
        assert self.tls is not None and self.tls.signer is not None
        cert = Certificate(self.tls.signer.identity.der)
        self.store.put(cert_key(self.settings.region, cert), cert)

    def _certificate_rotated(self) -> None:
        tls = self.tls
        assert tls is not None
        if tls.signer is None or not tls.signer.identity.covers(self.settings.region, self.settings.node):
            logger.error("gossip TLS certificate reloaded but it names no identity of this agent; still signing "
                         "with the previous one")
            return
        self.book.set_authorities(tls.authorities)
        self.book.add(tls.signer.identity.der)
        self.store.signer = tls.signer
        self._file_certificate()

    def runners(self) -> dict[str, Runner]:
        runners: dict[str, Runner] = {
            "gossip join": self.node.run_join,
            "gossip anti-entropy": self.node.run_anti_entropy,
            "gossip keyring": self.keyring_watcher.run,
        }
        if self.tls is not None:
            runners["gossip tls"] = self.tls.run   # re-reads rotated certificate files
        if self.revocations is not None:
            runners["gossip revoked certificates"] = self.revocations.run
        runners["cluster observations"] = self.observer.run_publish
        runners["cluster ingress probes"] = self.observer.run_ingress
        runners["cluster verdicts"] = self.answers.run
        runners["clock recovery"] = self.recover_clock
        return runners

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.node.stop()

    async def synced(self, timeout: float) -> None:
        """Wait for a first completed exchange with a peer. A lone first agent (no seed ever resolved to
        anyone but itself) comes up after ``timeout``; an agent that had seeds to join waits on: one whose
        peers never answer (a wrong CA, a wrong key, unreachable seeds) is an island, not ready, refusing
        writes, and withholding an empty zone (SERVFAIL, never NXDOMAIN)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.anti_entropy.synced.wait(), timeout)
            return
        if self.node.join_attempts == 0:
            return
        logger.warning("no completed sync with any peer %.0f s after start although seeds were found: not "
                       "ready, writes refused, until one completes (check gossip.seeds, the keyring and the CA)",
                       timeout)
        await self.anti_entropy.synced.wait()
        logger.info("first sync with a peer completed")

    def clock(self) -> ClockVerdict:
        """This agent's clock against its peers' (see :mod:`region_agent.cluster.clock`)."""
        live = [v.member.name for v in self.node.members()
                if v.state in LIVE_STATES and v.member.name != self.node.name]
        return clock_verdict(self.membership.clock_offsets, live, now=asyncio.get_running_loop().time(),
                             wall=time.time(), lead=self.store.clock.lead_ms() / 1000,
                             max_offset=self.settings.cluster.max_clock_offset)

    def writable(self) -> str | None:
        """Why this agent must take no write now (a skewed clock, a pull-only rejoin), or None."""
        if self.rejoining():
            return "rejoining pull-only after an absence beyond the tombstone horizon"
        verdict = self.clock()
        return None if verdict.ok else verdict.reason

    def rejoining(self) -> bool:
        """Pull-only (see :mod:`region_agent.gossip.sync`): not ready, no answers, no writes until pulled."""
        return self.anti_entropy.pull_only

    def _on_pull_only(self, pulling: bool) -> None:
        for listener in self.pull_listeners:
            listener(pulling)
        self._view_changed()

    def _clock_gauges(self) -> None:
        offset = Gauge("region_agent_clock_offset_seconds", "Median of the peers' wall clocks minus this agent's "
                       "(NaN: no recent measurement)", registry=self.registry)
        offset.set_function(lambda: v if (v := self.clock().offset) is not None else float("nan"))
        outlier = Gauge("region_agent_clock_outlier", "1 while this agent's clock (or its HLC) is off its peers' "
                        "beyond cluster.max_clock_offset: it refuses writes", registry=self.registry)
        outlier.set_function(lambda: 0.0 if self.clock().ok else 1.0)

    def _certificate_gauges(self) -> None:
        """When this agent's gossip certificate and the CA certificates it trusts expire (the TLS files are
        re-read when they change, so a rotated certificate moves the gauge)."""
        tls = self.tls
        if tls is None:
            return
        expiry = Gauge("region_agent_certificate_expiry_timestamp_seconds", "When a certificate this agent uses "
                       "expires (unix time): certificate=gossip (its identity), ca (the earliest trusted CA)",
                       ["certificate"], registry=self.registry)
        expiry.labels("gossip").set_function(lambda: tls.not_after.timestamp())  # noqa: PLW0108 (re-read: a reload)
        expiry.labels("ca").set_function(
            lambda: min((ca.not_valid_after_utc.timestamp() for ca in tls.authorities), default=float("nan")))

    async def recover_clock(self) -> None:
        """Once the wall clock is right again, drop what this agent wrote during a forward jump (no peer took
        it: it was stamped beyond their bound) and forget the HLC's lead, so writes resume."""
        bound_ms = self.store.clock.max_drift_ms
        while True:
            await asyncio.sleep(CLOCK_CHECK_SECONDS)
            verdict = self.clock()
            if verdict.lead * 1000 <= bound_ms or (verdict.offset is not None
                                                  and abs(verdict.offset) > self.settings.cluster.max_clock_offset):
                continue
            dropped = self.drop_future_writes(int(time.time() * 1000) + bound_ms)
            logger.warning("clock: the HLC was %.0f s ahead of the wall clock; %d entries this agent stamped in the "
                           "future dropped (no peer took them), writes resume", verdict.lead, dropped)

    def drop_future_writes(self, limit_ms: int) -> int:
        """Drop this agent's own entries stamped after ``limit_ms`` and reset the HLC below them."""
        mine = writer_agent(self.store.writer)
        dropped = self.store.drop(lambda e: physical_ms(e.version.hlc) > limit_ms
                                  and writer_agent(e.version.writer) == mine)
        self.store.clock.reset(max((e.version.hlc for e in self.store.entries()), default=0))
        return len(dropped)

    def island(self) -> bool:
        """Seeds were there to join, but no exchange with a peer ever completed."""
        return self.node.join_attempts > 0 and not self.anti_entropy.synced.is_set()

    def may_have_peers(self) -> bool:
        g = self.settings.gossip
        return bool(g.seeds or g.seeds_dns)

    def _on_member_change(self, view: MemberView, previous: State | None) -> None:
        if view.state is State.ALIVE and previous is not State.ALIVE and previous is not State.SUSPECT:
            self.observer.probe_soon()   # a member (re)appeared: look at its region's ingress now
        self.answers.request()
        self._view_changed()

    def _view_changed(self) -> None:
        for listener in self.view_listeners:
            listener()

    # --- views ---------------------------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        island: tuple[str, ...] = (
            ("gossip: no completed sync with any peer although seeds were found (island): writes refused",)
            if self.island() else ())
        verdict = self.clock()
        island += () if verdict.ok else (f"clock: {verdict.reason}",)
        island += ("gossip: rejoining pull-only (no fresh sync for longer than the tombstone horizon): not ready, "
                   "DNS SERVFAIL, writes refused until the peers' state is pulled",) if self.rejoining() else ()
        lab = ("gossip.allow_unsigned: no identity certificates, any keyring holder can forge writes",) \
            if self.unsigned else ()
        return (island + lab + self.keyring_watcher.problems() + (() if self.tls is None else self.tls.problems())
                + (() if self.revocations is None else self.revocations.problems()))

    def member_rows(self) -> list[MemberRow]:
        """The members as rows, ``since`` as wall time (the control API shows them to people)."""
        return member_rows(self.node.members(), since_wall=self.node.since_wall, rtt=self.membership.rtt.get)

    def members_by_region(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for view in self.node.members():
            if view.state in LIVE_STATES:
                counts[view.member.region] = counts.get(view.member.region, 0) + 1
        return counts

    def peer_digests(self) -> dict[str, str | None]:
        """Every other live member's store digest as last heard by anti-entropy (None: not heard yet)."""
        heard = self.anti_entropy.peer_digests
        return {view.member.name: (heard[view.member.name].digest if view.member.name in heard else None)
                for view in self.node.members()
                if view.member.name != self.node.name and view.state in LIVE_STATES}

    def announce(self, key: str, value: str) -> None:
        """Set one key of this agent's member metadata (a new incarnation only when it changes)."""
        self.membership.update_meta({**self.membership.local.metadata, key: value})
