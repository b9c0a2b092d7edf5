"""Builds the agent's components, starts them in dependency order, stops them in reverse.

Start order: state (zone file) → DNS (tables compiled before the sockets open, so no query
ever sees an empty zone) → health listener → Kubernetes watches and health checks → the
loops that connect them. A stop (SIGTERM, SIGINT) cancels the loops and closes sockets in
reverse order within the shutdown budget. SIGHUP re-reads the zone file and the GeoIP source
(``dns.geoip`` in the settings file).

Where copy health comes from: with ``kubernetes`` on, this region's copies are judged from
the Knative watch cache (written into the store as owned by this region, so the zone sees a
copy stop serving the moment the watch does); every other copy, and every copy in
standalone mode, is judged by the HTTP checks, whose results are this agent's observations
(``region_agent.state.observations``), laid over the store by the zone compiler and never replicated.

In a gossip cluster (``gossip.enabled``) each agent reports only its own region's copies (from
the watch, or without Kubernetes from HTTP checks of its own region) into the store, gossip
spreads every region's reports, and the regions decide together (``region_agent.cluster``) whether a
region is out: silent in gossip, or its ingress down, by a majority of the other regions'
vantage points; a witness (``cluster.role``) adds one. A zone file there is an import by the
control role.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from region_agent.app.settings import AgentSettings, SettingsError, load_settings
from region_agent.base.bearer import BearerToken
from region_agent.base.tasks import TaskSupervisor
from region_agent.checks.checker import Checker, StoreCopies
from region_agent.cluster.members import MemberRow, member_rows
from region_agent.cluster.quorum import Quorum, has_contact_majority, has_majority
from region_agent.control import PREFIX as CONTROL_PREFIX
from region_agent.control import ControlAPI
from region_agent.globaldns.delegation import expected_ns_names
from region_agent.globaldns.reachability import ReachabilityMonitor
from region_agent.globaldns.service import ZoneService
from region_agent.gossip.messages import State
from region_agent.health.operator import Document
from region_agent.health.service import HealthService
from region_agent.state.hlc import HybridClock
from region_agent.state.local import CopyReason, CopyStatus, RegionView
from region_agent.state.model import CopyHealth, Kind, copy_key
from region_agent.state.observations import Observations
from region_agent.state.persist import StoreSnapshotFile
from region_agent.state.store import TOMBSTONE_SWEEP_SECONDS, Entry, Store
from region_agent.zonefile.watcher import ZoneFileError, ZoneFileWatcher, off_loop, read_zone_file

logger = logging.getLogger("region_agent.supervisor")
VERSION = "0.1.0"
PROBLEM_POLL = 1.0  # seconds between looks at the agent's own problems (tasks, checks, usage)


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.started_at = time.time()
        self.store = Store(writer=settings.writer_id, clock=HybridClock(lambda: int(time.time() * 1000)),
                           registry=self.registry)
        cluster = settings.gossip.enabled
        self.witness = settings.cluster.role == "witness"
        self._view_pending: asyncio.Handle | None = None
        self.state_file: StoreSnapshotFile | None = None
        if cluster and settings.state_file is not None:
            self.state_file = StoreSnapshotFile(settings.state_file, self.store, self.registry,
                                                interval=settings.state_file_interval)
        self._zone_imported = asyncio.Event()  # cluster mode: the zone file's first import was tried
        self.zone_file: ZoneFileWatcher | None = None
        if settings.zone_file is not None:
            self.zone_file = ZoneFileWatcher(settings.zone_file, self.store, self.registry,
                                             poll_interval=settings.zone_file_poll_interval,
                                             settle=settings.zone_file_settle, max_bytes=settings.zone_file_max_bytes,
                                             allow_mass_removal=self._mass_removal_allowed,
                                             writer=f"control/{settings.node}" if cluster else None)
        # What this agent's checks see of copies: beside the store, never written into it.
        self.observations = Observations()
        self.dns = ZoneService(settings.dns, self.store, self.registry, self.observations)
        self.dns.geoip.settings_loader = self._geoip_settings  # a changed source needs no restart
        self.checker = Checker(self.store, settings.checks.config(f"region-agent/{VERSION}"), self.registry,
                               skip_region=settings.region if settings.kubernetes else None,
                               only_region=settings.region if cluster else None,
                               observations=StoreCopies(self.store) if cluster else self.observations)
        self.gossip: Any = None  # region_agent.gossip.node.GossipNode in a cluster
        self.replica: Any = None  # region_agent.app.replication.StoreReplica in a cluster
        self.observer: Any = None  # region_agent.cluster.observer.ClusterObserver in a cluster
        self.cluster_answers: Any = None  # region_agent.cluster.answers.ClusterAnswers in a cluster
        self.keyring_watcher: Any = None
        self.gossip_tls: Any = None
        # The control API on the operator listener: closed (401) without the operator token file.
        token_file = settings.health.operator_token_file
        self.quorum = Quorum(local_region=settings.region, max_age=settings.cluster.observation_max_age,
                             clock=time.time)
        self.control = ControlAPI(store=self.store, node=settings.node, region=settings.region,
                                  members=self._member_views, has_majority=self.has_majority,
                                  digests=self._peer_digests, token=BearerToken(token_file) if token_file else None,
                                  zone=self.zone_description)
        self.health = HealthService(settings.health, region=settings.region, registry=self.registry,
                                    documents={"/zone": Document(self.zone_description, self.zone_generation)},
                                    handlers={CONTROL_PREFIX: self.control.handle})
        self.reachability: ReachabilityMonitor | None = None
        if settings.reachability.active(settings.kubernetes):
            self.reachability = ReachabilityMonitor(
                settings.reachability, zone=settings.dns.zone, own_addresses=self._own_ns_addresses,
                expected_ns=lambda: expected_ns_names(self.store.regions.values(), settings.dns.zone),
                registry=self.registry)
        self.kube: Any = None  # region_agent.kube.sources.KubeSources, imported only when used
        self.usage: Any = None  # region_agent.usage.service.UsageService when metering runs; .status for health
        self._kube_api: Any = None
        self._local_slugs: set[str] = set()
        self._kube_synced = asyncio.Event()
        self._last_kube_snap: Any = None
        self.ready = asyncio.Event()
        self.tasks = TaskSupervisor(self.registry)
        self._stop = asyncio.Event()
        self._drain_cut = asyncio.Event()
        self.store.subscribe(self._on_state_change)
        self._state_changes = 0  # part of /zone's generation: O(1), where the digest hashes every bucket
        self.store.subscribe(self._count_state_change)

    def _on_state_change(self, changes: list[Entry]) -> None:
        # Check targets follow regions and projects; copy health (what checks write) leaves
        # them as they are, and re-planning 10,000 projects on every health flip would be waste.
        if any(entry.key[0] != Kind.COPY.value for entry in changes):
            self.checker.request_reconcile()  # once per burst of changes, on the next loop turn

    # --- views --------------------------------------------------------------------------

    def region_view(self, snap: Any = None) -> RegionView:
        """What the health listener answers from; ``snap`` is a KubeSnapshot already taken."""
        tables = self.dns.tables
        now = time.time()
        common = {"region": self.settings.region, "started_at": self.started_at, "generated_at": now,
                  "zone_serial": None if tables is None else tables.serial, "zone_digest": self.store.digest(),
                  "geoip": self.dns.geoip.status.to_dict(), "reachable": self._reachable_summary(),
                  "degraded": self.problems(), "draining": self._stop.is_set(),
                  "members": None if self.gossip is None else self._members_by_region(),
                  "cluster": None if self.cluster_answers is None else self.cluster_answers.describe()}
        if self.kube is None:
            ready = self.ready.is_set()
            return RegionView(synced=ready, synced_at=now if ready else None, **common)  # type: ignore[arg-type]
        # Between Kubernetes changes the last local view still holds (the follower publishes
        # a new one on every change), so a zone change does not rebuild it.
        snap = snap or self._last_kube_snap or self.kube.view()
        return RegionView(synced=snap.synced, synced_at=snap.synced_at, last_event_at=snap.last_event_at,
                          watch_errors=snap.watch_errors, copies=self._expected_copies(snap.copies),
                          bindings=snap.bindings, **common)  # type: ignore[arg-type]

    def has_majority(self) -> bool:
        """Whether writes are accepted: alone (no gossip) always; in a cluster, with a majority of regions alive."""
        if self.gossip is None:
            return True
        view = self.observer.view()
        membership = self.gossip.membership
        if membership is None:
            return has_majority(view)
        # Heard from (an ack of our probe, or their ping) within two probe rounds. Not stretched by
        # local health: an agent that can not reach the others is exactly the one whose health drops.
        c = membership.config
        window = 2 * (c.probe_interval * max(1, membership.live_count()) + c.probe_timeout)
        now = asyncio.get_running_loop().time()   # the membership's scheduler clock
        return has_majority(view) and has_contact_majority(view, membership.last_ack, now, window)

    def _member_views(self) -> list[MemberRow]:
        """The members as rows, ``since`` as wall time (the control API shows them to people)."""
        if self.gossip is None:
            return []
        membership = self.gossip.membership
        return member_rows(self.gossip.members(), since_wall=self.gossip.since_wall,
                           rtt=lambda name: None if membership is None else membership.rtt.get(name))

    def _peer_digests(self) -> dict[str, str | None]:
        """Every other member's store digest as last heard by anti-entropy (None: not heard yet)."""
        if self.gossip is None or self.gossip.anti_entropy is None:
            return {}
        heard = self.gossip.anti_entropy.peer_digests
        return {view.member.name: (heard[view.member.name].digest if view.member.name in heard else None)
                for view in self.gossip.members()
                if view.member.name != self.gossip.name and view.state in (State.ALIVE, State.SUSPECT)}

    def _members_by_region(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for region in (view.member.region for view in self.gossip.members()
                       if view.state in (State.ALIVE, State.SUSPECT)):
            counts[region] = counts.get(region, 0) + 1
        return counts

    def _expected_copies(self, copies: dict[str, CopyStatus]) -> dict[str, CopyStatus]:
        """The watched copies, plus a not-found entry for every project that should have one here.

        So ``/global-health/<slug>`` answers 503 ``not-found`` for a project of this region
        whose Service is missing, and 404 only for a slug nobody ever declared.
        """
        region = self.settings.region
        missing = {slug: CopyStatus(slug, False, CopyReason.NOT_FOUND,
                                    f"no Knative Service of project {slug} in region {region}")
                   for slug, project in self.store.projects.items()
                   if region in project.regions and slug not in copies}
        return {**copies, **missing} if missing else copies

    def zone_description(self) -> dict[str, Any]:
        tables = self.dns.tables
        return {
            "zone": self.settings.dns.zone, "serial": None if tables is None else tables.serial,
            "ready": self.ready.is_set(), "digest": self.store.digest(),
            "records": [] if tables is None else list(tables.description),
        }

    def zone_generation(self) -> tuple[object, ...]:
        """What /zone depends on: it is re-rendered only when this changes (never per request).

        The store's size covers tombstone expiry, which changes the digest without notifying.
        """
        tables = self.dns.tables
        return (id(tables), None if tables is None else tables.serial, self._state_changes, len(self.store),
                self.ready.is_set())

    def _count_state_change(self, _changes: list[Entry]) -> None:
        self._state_changes += 1

    def _reachable_summary(self) -> dict[str, Any] | None:
        return None if self.reachability is None else self.reachability.summary()

    def _reload(self) -> None:
        """SIGHUP: re-read the zone file and the GeoIP source."""
        if self.zone_file is not None:
            self.zone_file.request_reload()
        self.dns.geoip.request_reload()

    @staticmethod
    def _geoip_settings() -> tuple[Any, Any]:
        """The GeoIP settings as the settings file says now (called off the loop)."""
        dns = load_settings().dns
        return dns.geoip, dns.geoip_database

    def _own_ns_addresses(self) -> tuple[str, ...]:
        region = self.store.regions.get(self.settings.region)
        return () if region is None else region.ns_ipv4 + region.ns_ipv6

    def _mass_removal_allowed(self) -> bool:
        """The override as the settings file says now (called off the loop on every zone file read).

        So an operator confirms a refused mass removal by setting it and sending SIGHUP.
        """
        if self.settings.zone_file_allow_mass_removal:
            return True
        try:
            return load_settings().zone_file_allow_mass_removal
        except SettingsError:
            return False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self.zone_file is not None and not self.settings.gossip.enabled:
            await self.zone_file.load()  # a bad file at start is fatal: there is no old zone to keep
        elif self.zone_file is not None:
            # In a cluster the file is validated now (a bad one is fatal) but imported after the
            # first sync with a peer: only what differs from the cluster's state is then written,
            # so restarting the importing agent with an unchanged file changes nothing anywhere.
            await off_loop(read_zone_file, self.zone_file.path, self.zone_file.max_bytes)
        if self.state_file is not None:
            await self.state_file.load()  # before gossip: peers then send only what is newer
        if self.settings.gossip.enabled:
            await self._start_gossip()
        if not self.witness:  # a witness serves no DNS and no copies: it only votes
            await self.dns.start()
        await self.health.start()
        self.health.publish(self.region_view())
        if self.settings.kubernetes:
            await self._start_kube()
        if not self.witness:
            self._spawn(self.checker.run, "health checks")
        self._spawn(self._publish_views, "view publisher")
        self._spawn(self._publish_problems, "problem publisher")
        if self.dns.acme is not None:
            self._spawn(self.dns.acme.run_sweeper, "acme challenge sweeper")
        if self.dns.tsig_keys is not None:
            self._spawn(self.dns.tsig_keys.run, "tsig keys file")  # re-reads rotated TSIG keys
        self._spawn(self.dns.geoip.run, "geoip source")
        self._spawn(self._become_ready, "readiness")
        self._spawn(self._sweep_tombstones, "tombstone expiry")
        if self.state_file is not None:
            self._spawn(self.state_file.run, "state file")
        if self.zone_file is not None:
            self._spawn(self._import_zone_file if self.gossip is not None else self.zone_file.run,
                        "zone file watcher")
        if self.reachability is not None:
            self._spawn(self.reachability.run, "dns reachability")
        # Everything built so far lives as long as the process: move it out of the garbage
        # collector's generations so full collections (pauses on the answer paths) stay short.
        gc.freeze()

    async def _start_gossip(self) -> None:
        """Bind the gossip port, then join and sync in the background (the zone is served meanwhile)."""
        from region_agent.app.replication import StoreReplica
        from region_agent.cluster.answers import ClusterAnswers
        from region_agent.cluster.observer import ClusterObserver
        from region_agent.cluster.quorum import Policy
        from region_agent.gossip.keyfile import KeyringWatcher, load_keyring
        from region_agent.gossip.messages import Role
        from region_agent.gossip.metrics import register
        from region_agent.gossip.node import GossipNode

        g = self.settings.gossip
        assert g.keyring_file is not None  # the settings require it
        try:
            keyring = load_keyring(g.keyring_file)
        except (ValueError, OSError) as exc:
            raise SettingsError(f"gossip.keyring_file: {exc}") from exc
        tls = None
        if g.tls_ca_file is not None and g.tls_cert_file is not None and g.tls_key_file is not None:
            from region_agent.gossip.tls import GossipTls

            try:
                tls = GossipTls.from_files(g.tls_ca_file, g.tls_cert_file, g.tls_key_file)
            except (ValueError, OSError) as exc:
                raise SettingsError(f"gossip.tls_*: {exc}") from exc
        self.replica = StoreReplica(self.store, self.registry)
        role = Role.WITNESS if self.settings.cluster.role == "witness" else Role.AGENT
        node = self.gossip = GossipNode(g, region=self.settings.region, node=self.settings.node, keyring=keyring,
                                        replica=self.replica, tls=tls, role=role)
        try:
            await node.start()
        except OSError as exc:
            raise SettingsError(f"gossip.port: can not listen on {g.bind_address} port {g.port}: "
                                f"{exc.strerror or exc}") from exc
        self.keyring_watcher = KeyringWatcher(g.keyring_file, keyring)
        register(node, self.registry, self.keyring_watcher)
        c = self.settings.cluster
        checks = self.settings.checks
        self.observer = ClusterObserver(
            region=self.settings.region, settings=c, quorum=self.quorum, store=self.store, members=node.members,
            broadcast=node.broadcast, member_name=node.name, check_host=checks.host, check_port=checks.port,
            user_agent=f"region-agent/{VERSION} ingress-probe", registry=self.registry)
        self.cluster_answers = ClusterAnswers(store=self.store, observations=self.observations,
                                              view=self.observer.view, policy=Policy(c.two_region_policy),
                                              registry=self.registry)
        self.observer.listeners.append(self.cluster_answers.request)
        self.cluster_answers.listeners.append(self._publish_view_soon)
        node.user_handlers.append(self.replica.user_message)
        node.user_handlers.append(self.observer.user_message)
        self.replica.attach(node.broadcast, node.sync_now, node.queued_broadcasts)
        node.member_listeners.append(self._on_member_change)
        self._spawn(node.run_join, "gossip join")
        self._spawn(node.run_anti_entropy, "gossip anti-entropy")
        self._spawn(self.keyring_watcher.run, "gossip keyring")
        if tls is not None:
            self.gossip_tls = tls
            self._spawn(tls.run, "gossip tls")  # re-reads rotated certificate files
        self._spawn(self.observer.run_publish, "cluster observations")
        self._spawn(self.observer.run_ingress, "cluster ingress probes")
        self._spawn(self.cluster_answers.run, "cluster verdicts")

    def _on_member_change(self, view: Any, previous: Any) -> None:
        if view.state is State.ALIVE and previous is not State.ALIVE and previous is not State.SUSPECT:
            self.observer.probe_soon()   # a member (re)appeared: look at its region's ingress now
        self.cluster_answers.request()
        self._publish_view_soon()

    def _publish_view_soon(self) -> None:
        """Membership and verdict changes come in bursts: one new view on the next loop turn."""
        if self._view_pending is None and self.health.holder.get() is not None:
            self._view_pending = asyncio.get_running_loop().call_soon(self._publish_view_now)

    def _publish_view_now(self) -> None:
        self._view_pending = None
        self.health.publish(self.region_view())

    def _spawn(self, factory: Callable[[], Coroutine[Any, Any, Any]], name: str) -> None:
        """Run ``factory()`` until shutdown; a failure is logged, counted, visible, and restarted."""
        self.tasks.spawn(name, factory)

    async def _start_kube(self) -> None:
        from region_agent.kube.client import build_api_client
        from region_agent.kube.sources import KubeSources

        self._kube_api = await build_api_client(self.settings.kube)
        self.kube = KubeSources(api=self._kube_api, settings=self.settings.kube, registry=self.registry)
        for name, factory in self.kube.runners().items():
            self._spawn(factory, name)
        self._spawn(self._follow_kube, "local copy health")
        self._start_usage()

    def _start_usage(self) -> None:
        """Meter the project pods on this node; needs the node name from the downward API."""
        node = self.settings.kube.node_name
        if not self.settings.usage.enabled or not node:
            logger.info("usage metering off (%s)", "disabled" if not self.settings.usage.enabled
                        else "kube.node_name is not set")
            return
        from region_agent.usage.wiring import build_usage

        # The service registers its event handler, so it exists before the watch runs; tasks
        # stop in reverse order, so it also checkpoints before the watch is gone.
        pods, self.usage = build_usage(self.settings.usage, api=self._kube_api, registry=self.registry,
                                       region=self.settings.region, node=node, watch=self.settings.kube.watch)
        self._spawn(pods.run, "kube-watch usage-pods")
        self._spawn(self.usage.run, "usage")

    async def _follow_kube(self) -> None:
        """Write this region's copy health from the watch cache on every change."""
        kube = self.kube
        while True:
            await kube.changed.wait()
            kube.changed.clear()
            snap = self._last_kube_snap = kube.view()
            if snap.synced:  # before the first LIST we know nothing; unknown is not unhealthy
                self._write_local_copies(snap.copies)
                self._kube_synced.set()
            self.health.publish(self.region_view(snap))

    def _write_local_copies(self, copies: dict[str, Any]) -> None:
        region = self.settings.region
        # One batch: listeners (the zone, gossip) hear once; unchanged copies make no new version,
        # and a first sync of 10,000 copies goes to anti-entropy instead of 10,000 broadcasts.
        items = [(copy_key(slug, region), CopyHealth(status.healthy, status.reason.value))
                 for slug, status in copies.items()]
        items += [(copy_key(slug, region), CopyHealth(False, "not-found"))
                  for slug in self._local_slugs - copies.keys()]
        self.store.put_many(items)
        self._local_slugs = set(copies)

    async def _become_ready(self) -> None:
        if self.witness:
            await self._become_ready_witness()
            return
        await self.checker.first_round.wait()
        if self.settings.kubernetes:
            await self._kube_synced.wait()
        if self.gossip is not None and self.gossip.anti_entropy is not None:
            # A first exchange with a peer, so a restarted agent does not answer from an empty
            # store; a lone first agent comes up after the timeout.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gossip.anti_entropy.synced.wait(), self.settings.gossip.ready_sync_timeout)
            if self.zone_file is not None:
                await self._zone_imported.wait()
        self.dns.set_health_known()
        await self.dns.compiled()  # ready means the answers follow health
        self.ready.set()
        logger.info("ready: zone serial %s", self.dns.tables.serial if self.dns.tables else None)
        self.health.publish(self.region_view())
        await asyncio.Event().wait()

    async def _become_ready_witness(self) -> None:
        assert self.gossip is not None and self.gossip.anti_entropy is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.gossip.anti_entropy.synced.wait(), self.settings.gossip.ready_sync_timeout)
        self.ready.set()
        logger.info("ready: witness of %s", self.settings.region)
        self.health.publish(self.region_view())
        await asyncio.Event().wait()

    async def _import_zone_file(self) -> None:
        """Cluster mode: import the zone file once the store has synced with a peer, then follow it."""
        assert self.zone_file is not None and self.gossip is not None and self.gossip.anti_entropy is not None
        if not self._zone_imported.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gossip.anti_entropy.synced.wait(), self.settings.gossip.ready_sync_timeout)
            try:
                await self.zone_file.load()
            except ZoneFileError as exc:  # changed since start-up and now bad: the watcher reports it
                self.zone_file.problem = str(exc)
            self._zone_imported.set()
        await self.zone_file.run()

    async def _sweep_tombstones(self) -> None:
        """Drop deletes older than the store's TTL, so the store does not grow forever."""
        while True:
            await asyncio.sleep(TOMBSTONE_SWEEP_SECONDS)
            dropped = self.store.expire_tombstones()
            if dropped:
                logger.info("state: %d tombstone(s) expired", dropped)

    async def _publish_views(self) -> None:
        while True:
            await self.dns.changed.wait()
            self.dns.changed.clear()
            self.health.publish(self.region_view())

    def problems(self) -> tuple[str, ...]:
        """What makes this agent degraded, one line each: operators see the text, the public a code."""
        found = list(self.tasks.problems())
        checks = self.checker.problem()
        if checks is not None:
            found.append(checks)
        if self.zone_file is not None and self.zone_file.problem is not None:
            found.append(f"zone file refused, serving the previous zone: {self.zone_file.problem}")
        if self.usage is not None and self.usage.status.state != "ok":
            status = self.usage.status
            found.append(f"usage {status.state} ({status.code}): {status.reason}")
        if self.reachability is not None:
            found.extend(self.reachability.problems())
        geoip = self.dns.geoip.status.problem()
        if geoip is not None:
            found.append(geoip)
        if self.state_file is not None and self.state_file.problem is not None:
            found.append(self.state_file.problem)
        if self.keyring_watcher is not None and self.keyring_watcher.problem is not None:
            found.append(f"gossip keyring file refused, keeping the current keys: {self.keyring_watcher.problem}")
        if self.dns.tsig_keys is not None and self.dns.tsig_keys.problem is not None:
            found.append(f"TSIG keys file refused, keeping the current keys: {self.dns.tsig_keys.problem}")
        if self.gossip_tls is not None and self.gossip_tls.problem is not None:
            found.append(f"gossip TLS files refused, keeping the current certificates: {self.gossip_tls.problem}")
        return tuple(found)

    def _announce_reachability(self) -> None:
        """Tell the other members whether this agent's name server is reachable (its member metadata),
        so `region-agent members` shows a load balancer that drops UDP or TCP 53 anywhere in the cluster."""
        membership = None if self.gossip is None else self.gossip.membership
        if membership is None or self.reachability is None:
            return
        summary = self.reachability.summary()
        if summary["reachable"] is None:
            value = "unknown"
        else:
            value = "yes" if summary["reachable"] else "no:" + ",".join(summary["failed_transports"])
        membership.update_meta({**membership.local.metadata, "dns-reachable": value})

    async def _publish_problems(self) -> None:
        """Publish a new view whenever the agent's own problems differ from the view's (they have no event)."""
        while True:
            await asyncio.sleep(PROBLEM_POLL)
            self._announce_reachability()
            published = self.health.holder.get()
            if published is not None and (published.degraded != self.problems()
                                          or published.reachable != self._reachable_summary()):
                self.health.publish(self.region_view())

    async def stop(self) -> None:
        await self.tasks.stop(budget=self.settings.shutdown_budget)
        if self.gossip is not None:
            with contextlib.suppress(Exception):
                await self.gossip.stop()
        with contextlib.suppress(Exception):
            await self.health.stop()
        await self.dns.stop()
        if self._kube_api is not None:
            await self._kube_api.close()

    def request_stop(self) -> None:
        if self._stop.is_set():
            self._drain_cut.set()  # a second signal: stop now
        self._stop.set()

    async def _drain(self) -> None:
        """Report not ready (``/readyz`` 503 ``draining``) while DNS keeps answering, then return."""
        seconds = self.settings.shutdown_drain_seconds
        if seconds <= 0:
            return
        logger.info("draining for %.1f s: /readyz answers 503, DNS still answers", seconds)
        self.health.publish(self.region_view())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain_cut.wait(), seconds)

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            await self.start()
            await self._stop.wait()
            await self._drain()
            logger.info("stopping")
        finally:
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
