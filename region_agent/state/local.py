"""This region's own view, as the Kubernetes watch caches see it: pure data.

The kube side (``region_agent.kube``) produces these records; the health listener (``health``)
and the zone's copy health consume them. Keeping them here lets both sides depend on
``region_agent.state`` only, never on each other.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class CopyReason(enum.StrEnum):
    """Why a copy is (not) healthy; the strings are part of the HTTP API."""

    OK = "ok"
    NOT_FOUND = "not-found"
    NO_READY_REVISION = "no-ready-revision"
    ROUTE_NOT_READY = "route-not-ready"
    DATA_NOT_STREAMING = "data-not-streaming"
    FENCED = "fenced"
    STALE = "stale"
    CACHE_NOT_SYNCED = "cache-not-synced"


@dataclass(frozen=True, slots=True)
class CopyStatus:
    """One project's copy in this region (a Knative Service and its data bindings)."""

    slug: str
    healthy: bool
    reason: CopyReason
    detail: str = ""  # human words: the condition message, the failed revision, ...
    namespace: str = ""
    service: str = ""
    revisions: tuple[str, ...] = ()  # revisions carrying traffic now

    def to_dict(self) -> dict[str, Any]:
        return {
            "slug": self.slug, "healthy": self.healthy, "reason": self.reason.value, "detail": self.detail,
            "namespace": self.namespace, "service": self.service, "revisions": list(self.revisions),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CopyStatus:
        return cls(
            slug=str(data["slug"]), healthy=bool(data["healthy"]), reason=CopyReason(data["reason"]),
            detail=str(data.get("detail", "")), namespace=str(data.get("namespace", "")),
            service=str(data.get("service", "")), revisions=tuple(data.get("revisions") or ()),
        )


@dataclass(frozen=True, slots=True)
class BindingStatus:
    """A project's dedicated Postgres replica in this region (a CloudNativePG Cluster)."""

    slug: str
    namespace: str
    name: str
    streaming: bool
    lag_seconds: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "slug": self.slug, "namespace": self.namespace, "name": self.name, "streaming": self.streaming,
            "lag_seconds": self.lag_seconds, "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BindingStatus:
        lag = data.get("lag_seconds")
        return cls(
            slug=str(data["slug"]), namespace=str(data["namespace"]), name=str(data["name"]),
            streaming=bool(data["streaming"]), lag_seconds=None if lag is None else float(lag),
            detail=str(data.get("detail", "")),
        )


@dataclass(frozen=True, slots=True)
class RegionView:
    """Everything the health listener answers from, built by the agent on every change.

    Times are wall-clock seconds (``time.time()``) because the view may cross a process
    boundary to the health sidecar.
    """

    region: str
    started_at: float
    generated_at: float
    synced: bool  # every watch cache has completed its first full LIST
    synced_at: float | None = None
    last_event_at: float | None = None
    watch_errors: tuple[str, ...] = ()  # one line per failing watch, empty when all are fine
    copies: Mapping[str, CopyStatus] = field(default_factory=dict)
    bindings: tuple[BindingStatus, ...] = ()
    zone_serial: int | None = None
    zone_digest: str | None = None
    # Problems of the agent itself, one line each ("checks: local errors (EMFILE)", a task
    # restarting): the region reports degraded; the text is shown to operators only.
    degraded: tuple[str, ...] = ()
    draining: bool = False  # SIGTERM received: /readyz answers 503 while DNS still answers
    # The GeoIP database (region_agent.globaldns.geoip.source.GeoipStatus.to_dict(); None: not reported).
    geoip: Mapping[str, Any] | None = None
    # The name server's reachability self-check: {"reachable": true/false/null, "failed_transports": [...],
    # ...} (region_agent.globaldns.reachability.ReachabilityMonitor.summary(); None: the check is off).
    reachable: Mapping[str, Any] | None = None
    # Gossip members alive or suspect, by region (None: not in a cluster).
    members: Mapping[str, int] | None = None
    # The cluster's verdicts: {"majority": bool, "regions": {name: {"status", "in_answers", "reason"}}}
    # (region_agent.cluster.answers; None: not in a cluster).
    cluster: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "region": self.region, "started_at": self.started_at, "generated_at": self.generated_at,
            "synced": self.synced, "synced_at": self.synced_at, "last_event_at": self.last_event_at,
            "watch_errors": list(self.watch_errors),
            "copies": [c.to_dict() for c in self.copies.values()],
            "bindings": [b.to_dict() for b in self.bindings],
            "zone_serial": self.zone_serial, "zone_digest": self.zone_digest,
            "degraded": list(self.degraded), "draining": self.draining,
            "geoip": None if self.geoip is None else dict(self.geoip),
            "reachable": None if self.reachable is None else dict(self.reachable),
            "members": None if self.members is None else dict(self.members),
            "cluster": None if self.cluster is None else dict(self.cluster),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegionView:
        copies = [CopyStatus.from_dict(c) for c in data.get("copies") or ()]
        return cls(
            region=str(data["region"]), started_at=float(data["started_at"]),
            generated_at=float(data["generated_at"]), synced=bool(data["synced"]),
            synced_at=data.get("synced_at"), last_event_at=data.get("last_event_at"),
            watch_errors=tuple(data.get("watch_errors") or ()),
            copies={c.slug: c for c in copies},
            bindings=tuple(BindingStatus.from_dict(b) for b in data.get("bindings") or ()),
            zone_serial=data.get("zone_serial"), zone_digest=data.get("zone_digest"),
            degraded=tuple(data.get("degraded") or ()),
            geoip=data.get("geoip"), reachable=data.get("reachable"),
            members=data.get("members"), cluster=data.get("cluster"),
        )
