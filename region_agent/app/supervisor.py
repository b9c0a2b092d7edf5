"""Builds the agent's components, starts them in dependency order, stops them in reverse.

Start order: state (zone file, snapshot) → gossip (the port bound; joining runs in the
background) → DNS (tables compiled before the sockets open, so no query ever sees an empty zone)
→ health listener → Kubernetes watches and health checks → the loops that connect them (gossip's
among them: no loop runs before every port is bound, so a start that fails ends at once). A stop
(SIGTERM, SIGINT) drains (``/readyz`` 503 while DNS answers), cancels the loops and closes
sockets in reverse order within the shutdown budget; a second signal cuts the drain short.
SIGHUP re-reads the zone file and the GeoIP source.

Where copy health comes from: with ``kubernetes`` on, this region's copies are judged from the
Knative watch cache (:mod:`region_agent.kube.copy_writer`, owned by this region); every other
copy, and every copy in standalone mode, by the HTTP checks, whose results are this agent's
observations (:mod:`region_agent.state.observations`), laid over the store and never replicated.
In a gossip cluster each agent reports only its own region's copies and the regions decide
together whether a region is out (:mod:`region_agent.app.cluster`); a zone file there is an
import by the control role, after the first sync.

This module is lifecycle only: what the agent shows is assembled in
:mod:`region_agent.app.region_view`, what degrades it is each component's ``problems()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics

from region_agent.app.cluster import ClusterParts
from region_agent.app.consistency import MissingRegions
from region_agent.app.events import EventFeed, EventRing
from region_agent.app.region_view import RegionViews, ZoneDocument
from region_agent.app.settings import AgentSettings, mass_removal_allowed, reread_geoip_settings
from region_agent.app.status import StatusDocument
from region_agent.app.zone_source import ZoneFileSource
from region_agent.base.bearer import BearerToken
from region_agent.base.problems import Problems, ProblemsCollector
from region_agent.base.tasks import TaskSupervisor
from region_agent.base.tracing import start_from_env
from region_agent.checks.checker import Checker, StoreCopies
from region_agent.control import PREFIX as CONTROL_PREFIX
from region_agent.control import ControlAPI
from region_agent.globaldns.delegation import expected_ns_names
from region_agent.globaldns.reachability import ReachabilityMonitor
from region_agent.globaldns.service import ZoneService
from region_agent.health.operator import Document
from region_agent.health.service import HealthService
from region_agent.state.hlc import HybridClock
from region_agent.state.local import RegionView
from region_agent.state.model import CONTROL, Kind, role_writer
from region_agent.state.observations import Observations
from region_agent.state.persist import StoreSnapshotFile
from region_agent.state.store import TOMBSTONE_SWEEP_SECONDS, Entry, Store
from region_agent.zonefile.watcher import ZoneFileWatcher

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

    from region_agent.kube.copy_writer import LocalCopyWriter
    from region_agent.usage.service import UsageService

logger = logging.getLogger("region_agent.supervisor")
VERSION = "0.1.0"
disable_created_metrics()  # type: ignore[no-untyped-call]  # a *_created series per counter is noise on every scrape (75 of ~500 lines)
FAILED_START_BUDGET = 1.0  # seconds the loops of a start that failed get to stop (they served nothing)
Runner = Callable[[], Coroutine[Any, Any, Any]]


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        # OTLP traces when the OTEL_* environment asks; before the listeners and the control API that record them.
        self.tracing = start_from_env(region=settings.region, node=settings.node, version=VERSION,
                                      registry=self.registry)
        self.store = Store(writer=settings.writer_id, clock=HybridClock(lambda: int(time.time() * 1000)),
                           registry=self.registry)
        in_cluster = settings.gossip.enabled
        self.witness = settings.cluster.role == "witness"
        self.state_file: StoreSnapshotFile | None = None
        if in_cluster and settings.state_file is not None:
            self.state_file = StoreSnapshotFile(settings.state_file, self.store, self.registry,
                                                interval=settings.state_file_interval)
        self.zone_file: ZoneFileSource | None = None
        if settings.zone_file is not None:
            watcher = ZoneFileWatcher(settings.zone_file, self.store, self.registry,
                                      poll_interval=settings.zone_file_poll_interval, settle=settings.zone_file_settle,
                                      max_bytes=settings.zone_file_max_bytes,
                                      allow_mass_removal=mass_removal_allowed(settings),
                                      writer=role_writer(settings.writer_id, CONTROL) if in_cluster else None)
            self.zone_file = ZoneFileSource(watcher, synced=self._cluster_synced if in_cluster else None)
        # What this agent's checks see of copies: beside the store, never written into it.
        self.observations = Observations()
        self.dns = ZoneService(settings.dns, self.store, self.registry, self.observations)
        self.dns.geoip.settings_loader = reread_geoip_settings  # a changed source needs no restart
        self.checker = Checker(self.store, settings.checks.config(f"region-agent/{VERSION}"), self.registry,
                               skip_region=settings.region if settings.kubernetes else None,
                               only_region=settings.region if in_cluster else None,
                               observations=StoreCopies(self.store) if in_cluster else self.observations)
        self.cluster: ClusterParts | None = None
        self.kube: LocalCopyWriter | None = None
        self.usage: UsageService | None = None
        self._kube_api: ApiClient | None = None
        self.reachability: ReachabilityMonitor | None = None
        if settings.reachability.active(settings.kubernetes):
            self.reachability = ReachabilityMonitor(
                settings.reachability, zone=settings.dns.zone, own_addresses=self._own_ns_addresses,
                expected_ns=lambda: expected_ns_names(self.store.regions.values(), settings.dns.zone),
                registry=self.registry)
        self.ready = asyncio.Event()
        self.tasks = TaskSupervisor(self.registry)
        self.problems_registry = Problems()
        self.registry.register(ProblemsCollector(self.problems_registry))
        Gauge("region_agent_build_info", "1, labelled with this agent's version, zone, region and role",
              ["version", "zone", "region", "role"], registry=self.registry).labels(
            VERSION, settings.dns.zone, settings.region, settings.cluster.role).set(1)
        self._stop = asyncio.Event()
        self._drain_cut = asyncio.Event()
        self.zone_document = ZoneDocument(zone=settings.dns.zone, store=self.store, dns=self.dns, ready=self.ready)
        # The status page's data (/status.json): recent transitions in a bounded ring, fed from here on.
        self.events = EventFeed(EventRing())
        self.store.subscribe(self.events.store_changed)
        self.status = StatusDocument(region=settings.region, node=settings.node, zone=settings.dns.zone,
                                     store=self.store, dns=self.dns, events=self.events.ring, ready=self.ready,
                                     cluster=lambda: self.cluster)
        # The control API on the operator listener: closed (401) without the operator token file.
        token_file = settings.health.operator_token_file
        token = BearerToken(token_file) if token_file else None
        self.control = ControlAPI(store=self.store, node=settings.node, region=settings.region,
                                  members=lambda: [] if self.cluster is None else self.cluster.member_rows(),
                                  has_majority=self.has_majority,
                                  digests=lambda: {} if self.cluster is None else self.cluster.peer_digests(),
                                  token=token,
                                  zone=self.zone_document.describe, registry=self.registry)
        self.health = HealthService(settings.health, region=settings.region, registry=self.registry,
                                    documents={"/zone": Document(self.zone_document.describe,
                                                                 self.zone_document.generation),
                                               "/status.json": Document(self.status.describe, self.status.generation)},
                                    handlers={CONTROL_PREFIX: self.control.handle})
        self.views = RegionViews(region=settings.region, zone=settings.dns.zone, store=self.store, dns=self.dns,
                                 health=self.health, problems=self.problems_registry,
                                 reachability=self.reachability, ready=self.ready, draining=self._stop)
        self.missing_regions = MissingRegions(self.store, self.registry)
        self.problems_registry.register(
            self.tasks, self.checker, self.missing_regions, None if self.zone_file is None else self.zone_file.watcher,
            self.reachability, self.dns, self.dns.workers, self.dns.geoip, self.state_file, self.dns.tsig_keys,
            token)
        self.store.subscribe(self._on_state_change)

    def _on_state_change(self, changes: list[Entry]) -> None:
        # Check targets follow regions and projects; copy health (what checks write) leaves
        # them as they are, and re-planning 10,000 projects on every health flip would be waste.
        if any(entry.key[0] != Kind.COPY.value for entry in changes):
            self.checker.request_reconcile()  # once per burst of changes, on the next loop turn

    # --- what other components ask ------------------------------------------------------------

    def problems(self) -> tuple[str, ...]:
        """What makes this agent degraded, one line each: operators see the text, the public a code."""
        return self.problems_registry.current()

    def region_view(self) -> RegionView:
        return self.views.build()

    def has_majority(self) -> bool:
        """The write gate: alone (no gossip) always open; in a cluster, see :mod:`region_agent.cluster.write_gate`."""
        return self.cluster is None or (not self.cluster.island() and self.cluster.writable() is None
                                        and self.cluster.write_gate.open())

    def _on_pull_only(self, pulling: bool) -> None:
        """An absence beyond the tombstone horizon: what this agent holds may hold deletes undone, so it
        answers SERVFAIL (never a stale answer) until it has pulled the peers' state."""
        if self.witness:
            return
        if pulling:
            self.dns.withhold()
        else:
            self.dns.release()

    def _own_ns_addresses(self) -> tuple[str, ...]:
        region = self.store.regions.get(self.settings.region)
        return () if region is None else region.ns_ipv4 + region.ns_ipv6

    def _reload(self) -> None:
        """SIGHUP: re-read the zone file and the GeoIP source."""
        if self.zone_file is not None:
            self.zone_file.watcher.request_reload()
        self.dns.geoip.request_reload()

    # --- lifecycle ----------------------------------------------------------------------------

    def _spawn(self, factory: Runner, name: str) -> None:
        """Run ``factory()`` until shutdown; a failure is logged, counted, visible, and restarted."""
        self.tasks.spawn(name, factory)

    async def start(self) -> None:
        if self.zone_file is not None:
            await self.zone_file.prepare()
        if self.state_file is not None:
            await self.state_file.load()  # before gossip: peers then send only what is newer
        if self.settings.gossip.enabled:
            await self._start_cluster()
            assert self.cluster is not None
            if not self.store.regions and not self.store.projects and self.cluster.may_have_peers():
                self.dns.withhold()   # an empty store is not an empty zone: SERVFAIL until synced
        if not self.witness:  # a witness serves no DNS and no copies: it only votes
            await self.dns.start()
        await self.health.start()
        # Every port is bound: only now the loops, so a start that fails has none to wait for.
        if self.cluster is not None:
            for name, factory in self.cluster.runners().items():
                self._spawn(factory, name)
        self.views.publish()
        if self.settings.kubernetes:
            await self._start_kube()
        if not self.witness:
            self._spawn(self.checker.run, "health checks")
        self._spawn(self.views.follow_zone, "view publisher")
        self._spawn(self.views.follow_problems, "problem publisher")
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
            self._spawn(self.zone_file.run, "zone file watcher")
        if self.reachability is not None:
            self._spawn(self.reachability.run, "dns reachability")
        # Everything built so far lives as long as the process: move it out of the garbage
        # collector's generations so full collections (pauses on the answer paths) stay short.
        gc.freeze()

    async def _start_cluster(self) -> None:
        """Bind the gossip port; joining and syncing run in the background once every port is bound."""
        cluster = self.cluster = ClusterParts(self.settings, store=self.store, observations=self.observations,
                                              registry=self.registry, user_agent=f"region-agent/{VERSION}",
                                              snapshot=None if self.state_file is None else self.state_file.times)
        await cluster.start()
        if self.state_file is not None:
            self.state_file.fresh = cluster.anti_entropy.last_fresh_wall   # kept with every snapshot
        cluster.view_listeners.append(self.views.publish_soon)
        self.events.follow_cluster(cluster.answers, cluster.node.member_listeners)
        if self.dns.acme is not None:
            self.dns.acme.gate = cluster.writable   # an UPDATE from a skewed clock would be refused everywhere
        self.views.cluster = cluster
        cluster.pull_listeners.append(self._on_pull_only)
        if cluster.rejoining():
            self._on_pull_only(True)   # pull-only from the start (the snapshot's last fresh round is too old)
        self.problems_registry.register(cluster)

    async def _start_kube(self) -> None:
        from region_agent.kube.client import build_api_client
        from region_agent.kube.copy_writer import LocalCopyWriter
        from region_agent.kube.sources import KubeSources

        self._kube_api = await build_api_client(self.settings.kube)
        sources = KubeSources(api=self._kube_api, settings=self.settings.kube, registry=self.registry)
        for name, factory in sources.runners().items():
            self._spawn(factory, name)
        self.kube = self.views.kube = LocalCopyWriter(sources, self.store, self.settings.region)
        self.kube.listeners.append(self.views.publish)
        self._spawn(self.kube.run, "local copy health")
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
        self.problems_registry.register(self.usage)
        self._spawn(pods.run, "kube-watch usage-pods")
        self._spawn(self.usage.run, "usage")

    async def _become_ready(self) -> None:
        if not self.witness:
            await self.checker.first_round.wait()
            if self.kube is not None:
                await self.kube.synced.wait()
        if self.cluster is not None:
            # A first exchange with a peer, so a restarted agent does not answer from an empty
            # store; a lone first agent comes up after the timeout.
            await self.cluster.synced(self.settings.gossip.ready_sync_timeout)
            if self.zone_file is not None and not self.witness:
                await self.zone_file.imported.wait()
            if not self.witness:
                # What the sync brought (projects of this region) is checked before this agent says it
                # has reported its copies: the others answer its region from those reports.
                await asyncio.sleep(0)   # the re-plan the sync asked for
                await self.checker.settled.wait()
            self.dns.release()
        if self.witness:
            logger.info("ready: witness of %s", self.settings.region)
        else:
            self.dns.set_health_known()
            await self.dns.compiled()  # ready means the answers follow health
            logger.info("ready: zone serial %s", self.dns.tables.serial if self.dns.tables else None)
        self.ready.set()
        if self.cluster is not None and not self.witness:
            self.cluster.reported()
        self.views.publish()
        await asyncio.Event().wait()

    async def _cluster_synced(self) -> None:
        assert self.cluster is not None
        await self.cluster.synced(self.settings.gossip.ready_sync_timeout)

    async def _sweep_tombstones(self) -> None:
        """Drop deletes older than the store's TTL, so the store does not grow forever."""
        while True:
            await asyncio.sleep(TOMBSTONE_SWEEP_SECONDS)
            if self.has_majority():
                self.control.sweep_idempotency()   # a control write: only where writes are taken
            dropped = self.store.expire_tombstones()
            if dropped:
                logger.info("state: %d tombstone(s) expired", dropped)

    async def stop(self) -> None:
        await self.tasks.stop(budget=self.settings.shutdown_budget)
        if self.cluster is not None:
            await self.cluster.stop()
        await self._close_listeners()

    async def _close_listeners(self) -> None:
        """Health, DNS, the Kubernetes client and the trace exporter, after the loops and the gossip."""
        with contextlib.suppress(Exception):
            await self.health.stop()
        await self.dns.stop()
        if self._kube_api is not None:
            await self._kube_api.close()
        if self.tracing is not None:
            await self.tracing.shutdown()  # bounded: a dead collector does not hold up the stop

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
        self.views.publish()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain_cut.wait(), seconds)

    async def abort_start(self) -> None:
        """Undo a start that failed: nothing was served, so nothing drains, checkpoints or says goodbye."""
        await self.tasks.stop(budget=FAILED_START_BUDGET)
        if self.cluster is not None:
            node = getattr(self.cluster, "node", None)  # absent when the cluster failed before binding
            if node is not None and node.membership is not None:
                node.membership.stop()  # silent: a node that never joined has nobody to tell it leaves
            await self.cluster.stop()
        await self._close_listeners()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            try:
                await self.start()
            except BaseException:
                await self.abort_start()
                raise
            try:
                await self._stop.wait()
                await self._drain()
                logger.info("stopping")
            finally:
                await self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

