"""The region view the health listener answers from, assembled from every component, and when to publish it.

A :class:`~region_agent.state.local.RegionView` is rebuilt and published on every change that
shows in it: the zone (``dns.changed``), the Kubernetes watch (a new snapshot), membership and
verdicts (bursts: one view on the next loop turn), and the agent's own problems, which have no
event and are polled once a second (:data:`PROBLEM_POLL`). Between Kubernetes changes the last
snapshot still holds, so a zone change does not rebuild the local view.

The ``/zone`` document of the operator listener (:class:`ZoneDocument`) is described here too,
with its generation key.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from region_agent.app.cluster import ClusterParts
from region_agent.base.problems import Problems
from region_agent.globaldns.reachability import ReachabilityMonitor
from region_agent.globaldns.service import ZoneService
from region_agent.health.service import HealthService
from region_agent.state.local import CopyReason, CopyStatus, RegionView
from region_agent.state.store import Entry, Store

if TYPE_CHECKING:
    from region_agent.kube.copy_writer import LocalCopyWriter
    from region_agent.kube.sources import KubeSnapshot

PROBLEM_POLL = 1.0  # seconds between looks at the agent's own problems (tasks, checks, usage)


class RegionViews:
    def __init__(self, *, region: str, zone: str, store: Store, dns: ZoneService, health: HealthService,
                 problems: Problems, reachability: ReachabilityMonitor | None, ready: asyncio.Event,
                 draining: asyncio.Event) -> None:
        self.region = region
        self.zone = zone
        self.store = store
        self.dns = dns
        self.health = health
        self.problems = problems
        self.reachability = reachability
        self.ready = ready
        self.draining = draining
        self.started_at = time.time()
        self.cluster: ClusterParts | None = None      # set once gossip has started
        self.kube: LocalCopyWriter | None = None      # set once the watches run
        self._pending: asyncio.Handle | None = None
        store.subscribe(lambda _changes: self.publish_soon())   # the digest moves with every change

    # --- the view ------------------------------------------------------------------------------

    def build(self, snap: KubeSnapshot | None = None) -> RegionView:
        """The view now; ``snap`` is a Kubernetes snapshot already taken (else the last one)."""
        tables = self.dns.tables
        now = time.time()
        cluster = self.cluster
        common: dict[str, Any] = {
            "region": self.region, "started_at": self.started_at, "generated_at": now,
            "zone_serial": None if tables is None else tables.serial, "zone_digest": self.store.digest(),
            "geoip": self.dns.geoip.status.to_dict(), "reachable": self._reachable(),
            "degraded": self.problems.current(), "draining": self.draining.is_set(),
            "members": None if cluster is None else cluster.members_by_region(),
            "cluster": None if cluster is None else cluster.answers.describe()}
        rejoining = cluster is not None and cluster.rejoining()   # not ready while it pulls the peers' state
        if self.kube is None:
            ready = self.ready.is_set() and not rejoining
            return RegionView(synced=ready, synced_at=now if ready else None, **common)
        snap = snap or self.kube.snapshot()
        return RegionView(synced=snap.synced and not rejoining, synced_at=snap.synced_at,
                          last_event_at=snap.last_event_at,
                          watch_errors=snap.watch_errors, copies=self._expected_copies(snap.copies),
                          bindings=snap.bindings, **common)

    def _expected_copies(self, copies: dict[str, CopyStatus]) -> dict[str, CopyStatus]:
        """The watched copies, plus a not-found entry for every project that should have one here.

        So ``/global-health/<slug>`` answers 503 ``not-found`` for a project of this region
        whose Service is missing, and 404 only for a slug nobody ever declared.
        """
        missing = {slug: CopyStatus(slug, False, CopyReason.NOT_FOUND,
                                    f"no Knative Service of project {slug} in region {self.region}")
                   for slug, project in self.store.projects.items()
                   if self.region in project.regions and slug not in copies}
        return {**copies, **missing} if missing else copies

    def _reachable(self) -> dict[str, Any] | None:
        return None if self.reachability is None else self.reachability.summary()

    # --- publishing ----------------------------------------------------------------------------

    def publish(self, snap: KubeSnapshot | None = None) -> None:
        self.health.publish(self.build(snap))

    def publish_soon(self) -> None:
        """Membership and verdict changes come in bursts: one new view on the next loop turn."""
        if self._pending is None and self.health.holder.get() is not None:
            self._pending = asyncio.get_running_loop().call_soon(self._publish_pending)

    def _publish_pending(self) -> None:
        self._pending = None
        self.publish()

    async def follow_zone(self) -> None:
        while True:
            await self.dns.changed.wait()
            self.dns.changed.clear()
            self.publish()

    async def follow_problems(self) -> None:
        """Publish a new view whenever the agent's own problems differ from the view's (they have no event);
        and gossip the name server's reachability as member metadata."""
        while True:
            await asyncio.sleep(PROBLEM_POLL)
            if self.cluster is not None and self.reachability is not None:
                self.cluster.announce("dns-reachable", self.reachability.member_meta())
            published = self.health.holder.get()
            if published is not None and (published.degraded != self.problems.current()
                                          or published.reachable != self._reachable()):
                self.publish()


class ZoneDocument:
    """The operator listener's ``/zone``: the zone as answered now, with each target's health."""

    def __init__(self, *, zone: str, store: Store, dns: ZoneService, ready: asyncio.Event) -> None:
        self.zone = zone
        self.store = store
        self.dns = dns
        self.ready = ready
        self._state_changes = 0  # part of the generation: O(1), where the digest hashes every bucket
        store.subscribe(self._count_state_change)

    def describe(self) -> dict[str, Any]:
        tables = self.dns.tables
        return {
            "zone": self.zone, "serial": None if tables is None else tables.serial,
            "ready": self.ready.is_set(), "digest": self.store.digest(),
            "records": [] if tables is None else list(tables.description),
        }

    def generation(self) -> tuple[object, ...]:
        """What the document depends on (it is re-rendered only when this changes, never per request).
        The store's size covers tombstone expiry, which changes the digest without notifying."""
        tables = self.dns.tables
        return (id(tables), None if tables is None else tables.serial, self._state_changes, len(self.store),
                self.ready.is_set())

    def _count_state_change(self, _changes: list[Entry]) -> None:
        self._state_changes += 1
