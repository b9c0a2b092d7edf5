"""Pure answers of the health listener: a :class:`RegionView` in, (status, body, headers) out.

No sockets, no clock, no aiohttp: the listener passes the view, the feed's freshness, the
time and the request id, so every answer is a table-testable function. The hot path
(``global_health`` as plain text) is a dict lookup plus a small header dict, with its
bodies and statuses prebuilt per reason; JSON is encoded only when a client asks for it.

Precedence of a ``/global-health/<slug>`` answer, first match wins:

1. the sidecar's feed is older than the bound → 503 ``stale`` (every slug, known or not);
2. no view yet, or the watch caches have not finished their first full LIST → 503
   ``cache-not-synced`` (we can not tell a missing project from one not yet listed);
3. the slug is not in the view → 404 ``not-found``;
4. the copy is healthy → 200 ``ok``, else 503 with the copy's reason. The producer
   (``region_agent.kube``) decides the reason, including ``data-not-streaming`` and ``fenced``;
   a copy of a known project whose Service does not exist here is 503 ``not-found``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from region_agent.state.local import BindingStatus, CopyReason, CopyStatus, RegionView

__all__ = [
    "IN_PROCESS",
    "Answer",
    "CopyCounts",
    "Freshness",
    "bad_request",
    "count_copies",
    "degraded_reasons",
    "global_health",
    "liveness",
    "method_not_allowed",
    "metrics",
    "not_found",
    "readiness",
    "region_health",
    "server_error",
    "unauthorized",
    "verdict",
]

TEXT = "text/plain; charset=utf-8"
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current the held view is. In-process the view is always current."""

    sidecar: bool
    stale: bool = False
    age_seconds: float | None = None  # since the agent last vouched for the view; None if never
    bound_seconds: float | None = None


IN_PROCESS = Freshness(sidecar=False)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]  # complete: Content-Type, X-Region, X-Request-Id, ...
    reason: str = ""  # the health reason, for request logs ("" when the path has none)


@dataclass(frozen=True, slots=True)
class CopyCounts:
    total: int
    healthy: int
    by_reason: Mapping[str, int]  # unhealthy copies only

    @property
    def unhealthy(self) -> int:
        return self.total - self.healthy


def count_copies(view: RegionView | None) -> CopyCounts:
    """O(copies); the listener memoizes it per view."""
    if view is None:
        return CopyCounts(0, 0, {})
    healthy = 0
    reasons: Counter[str] = Counter()
    for copy in view.copies.values():
        if copy.healthy:
            healthy += 1
        else:
            reasons[copy.reason.value] += 1
    return CopyCounts(len(view.copies), healthy, dict(sorted(reasons.items())))


# --- /global-health/<slug> ------------------------------------------------------------------

_STATUS_OF: dict[CopyReason, int] = {reason: 503 for reason in CopyReason}
_STATUS_OF[CopyReason.OK] = 200
_BODY_OF: dict[CopyReason, bytes] = {reason: reason.value.encode() for reason in CopyReason}


def verdict(
    view: RegionView | None, slug: str, freshness: Freshness
) -> tuple[int, CopyReason, CopyStatus | None]:
    """(HTTP status, reason, the copy if known) by the precedence in the module docstring."""
    if freshness.stale:
        return 503, CopyReason.STALE, None
    if view is None or not view.synced:
        return 503, CopyReason.CACHE_NOT_SYNCED, None
    copy = view.copies.get(slug)
    if copy is None:
        return 404, CopyReason.NOT_FOUND, None
    if copy.healthy:
        return 200, CopyReason.OK, copy
    # An unhealthy copy must carry a reason; "ok" there is the producer's bug, not an answer.
    reason = copy.reason if copy.reason is not CopyReason.OK else CopyReason.NO_READY_REVISION
    return 503, reason, copy


def _base_headers(region: str, request_id: str, content_type: str) -> dict[str, str]:
    return {
        "Content-Type": content_type,
        "Cache-Control": "no-store",
        "X-Region": region,
        "X-Request-Id": request_id,
    }


def global_health(
    view: RegionView | None,
    slug: str,
    *,
    region: str,
    request_id: str,
    freshness: Freshness,
    want_json: bool,
    now: float,
    verbose: bool = False,
) -> Answer:
    """``GET /global-health/<slug>``: 200 ``ok`` or 503/404 with the reason.

    The public listener shows reason codes only; ``verbose`` (the operator listener) adds
    the detail text, namespace, Service and revisions.
    """
    status, reason, copy = verdict(view, slug, freshness)
    if not want_json:
        return Answer(
            status,
            _BODY_OF[reason],
            {
                "Content-Type": TEXT,
                "Cache-Control": "no-store",
                "X-Region": region,
                "X-Request-Id": request_id,
                "X-Health-Reason": reason.value,
            },
            reason.value,
        )
    facts: dict[str, Any] = {
        "region": region,
        "slug": slug,
        "status": status,
        "healthy": status == 200,
        "reason": reason.value,
        "view_generated_at": view.generated_at if view else None,
        "view_age_seconds": _age(now, view.generated_at) if view else None,
        "feed_age_seconds": freshness.age_seconds if freshness.sidecar else None,
        "request_id": request_id,
    }
    if verbose:
        facts["detail"] = _detail(view, reason, copy, freshness)
        facts["namespace"] = copy.namespace if copy else None
        facts["service"] = copy.service if copy else None
        facts["revisions"] = list(copy.revisions) if copy else []
    headers = _base_headers(region, request_id, JSON)
    headers["X-Health-Reason"] = reason.value
    return Answer(status, _json(facts), headers, reason.value)


def _detail(
    view: RegionView | None, reason: CopyReason, copy: CopyStatus | None, freshness: Freshness
) -> str:
    if reason is CopyReason.STALE:
        if freshness.age_seconds is None:
            return "the health sidecar has not heard from the agent yet"
        return (
            f"the agent has not vouched for this view for {freshness.age_seconds:.1f} s "
            f"(bound {freshness.bound_seconds} s)"
        )
    if reason is CopyReason.CACHE_NOT_SYNCED:
        return "no view yet" if view is None else "the watch caches have not finished their first full list"
    if copy is None:
        return "no copy of this project is known in this region"
    return copy.detail


# --- /health/region -----------------------------------------------------------------------


def degraded_reasons(
    view: RegionView | None, freshness: Freshness, *, lag_threshold_seconds: float
) -> tuple[str, ...]:
    """Why the region is degraded, in a fixed order; empty when it is not."""
    reasons: list[str] = []
    if freshness.stale:
        reasons.append("feed-stale")
    if view is None or not view.synced:
        reasons.append("cache-not-synced")
    if view is not None:
        if view.watch_errors:
            reasons.append("watch-failing")
        if any(_lagging(b, lag_threshold_seconds) for b in view.bindings):
            reasons.append("replica-lag")
        if view.degraded:
            reasons.append("agent-degraded")
    return tuple(reasons)


def _lagging(binding: BindingStatus, threshold: float) -> bool:
    return binding.lag_seconds is not None and binding.lag_seconds > threshold


def _binding_counts(bindings: tuple[BindingStatus, ...], threshold: float) -> dict[str, int]:
    return {
        "total": len(bindings),
        "streaming": sum(1 for b in bindings if b.streaming),
        "lagging": sum(1 for b in bindings if _lagging(b, threshold)),
    }


def region_health(
    view: RegionView | None,
    *,
    region: str,
    request_id: str,
    freshness: Freshness,
    now: float,
    lag_threshold_seconds: float,
    listener_started_at: float,
    counts: CopyCounts | None = None,
    verbose: bool = False,
) -> Answer:
    """``GET /health/region``: always 200 with JSON; degradation is in the headers and body.

    Public (default): reason codes and counts only. ``verbose`` (the operator listener) adds
    the watch errors' text, each binding, and the agent's problems (``agent_problems``).
    """
    if counts is None:
        counts = count_copies(view)
    reasons = degraded_reasons(view, freshness, lag_threshold_seconds=lag_threshold_seconds)
    body: dict[str, Any] = {
        "region": region,
        "mode": "sidecar" if freshness.sidecar else "in-process",
        "degraded": bool(reasons),
        "degraded_reasons": list(reasons),
        "uptime_seconds": _age(now, view.started_at) if view else None,
        "listener_uptime_seconds": _age(now, listener_started_at),
        "cache": {
            "synced": bool(view and view.synced),
            "synced_at": view.synced_at if view else None,
            "synced_age_seconds": _age(now, view.synced_at) if view else None,
            "last_event_at": view.last_event_at if view else None,
            "last_event_age_seconds": _age(now, view.last_event_at) if view else None,
            "watch_errors": len(view.watch_errors) if view else 0,
        },
        "view": {
            "generated_at": view.generated_at if view else None,
            "age_seconds": _age(now, view.generated_at) if view else None,
        },
        "feed": (
            {
                "age_seconds": freshness.age_seconds,
                "stale": freshness.stale,
                "stale_after_seconds": freshness.bound_seconds,
            }
            if freshness.sidecar
            else None
        ),
        "copies": {
            "total": counts.total,
            "healthy": counts.healthy,
            "unhealthy": counts.unhealthy,
            "by_reason": dict(counts.by_reason),
        },
        "bindings": _binding_counts(view.bindings if view else (), lag_threshold_seconds),
        "zone": {
            "serial": view.zone_serial if view else None,
            "digest": view.zone_digest if view else None,
        },
        # Gossip members alive or suspect per region (null outside a cluster): "members seen".
        "members": dict(view.members) if view is not None and view.members is not None else None,
        "cluster": _cluster(view.cluster if view else None, verbose=verbose),
        "geoip": _geoip(view.geoip if view else None, verbose=verbose),
        "reachable": _reachable(view.reachable if view else None, verbose=verbose),
        "request_id": request_id,
    }
    if verbose:
        body["cache"]["watch_errors"] = list(view.watch_errors) if view else []
        body["bindings"] = [
            {**b.to_dict(), "lagging": _lagging(b, lag_threshold_seconds)} for b in (view.bindings if view else ())
        ]
        body["agent_problems"] = list(view.degraded) if view else []
    headers = _base_headers(region, request_id, JSON)
    if reasons:
        headers["X-Degraded"] = "true"
        headers["X-Degraded-Reason"] = ",".join(reasons)
    return Answer(200, _json(body), headers, ",".join(reasons))


def _cluster(cluster: Mapping[str, Any] | None, *, verbose: bool) -> dict[str, Any] | None:
    """Whether this agent sees a majority, and each region's verdict; reasons for operators only."""
    if cluster is None:
        return None
    regions = {name: {k: v for k, v in verdict.items() if verbose or k != "reason"}
               for name, verdict in (cluster.get("regions") or {}).items()}
    return {"majority": cluster.get("majority"), "regions": regions}


def _geoip(status: Mapping[str, Any] | None, *, verbose: bool) -> dict[str, Any] | None:
    """The GeoIP database's state; the public listener gets codes, not the location or error texts."""
    if status is None:
        return None
    shown = dict(status)
    if not verbose:
        shown.pop("location", None)
        for key in ("error", "refresh_error"):
            if isinstance(shown.get(key), Mapping):
                shown[key] = {k: v for k, v in shown[key].items() if k != "message"}
    return shown


def _reachable(summary: Mapping[str, Any] | None, *, verbose: bool) -> dict[str, Any]:
    """Whether this agent's public name-server addresses answer over UDP and TCP 53 (null: not checked)."""
    if summary is None:
        return {"reachable": None, "failed_transports": [], "checked": False}
    shown = {**summary, "checked": summary.get("reachable") is not None}
    if not verbose:
        shown.pop("errors", None)
        shown.pop("addresses", None)
    return shown


# --- probes, metrics, errors --------------------------------------------------------------


def liveness(*, region: str, request_id: str) -> Answer:
    """``/livez``: the process answers; nothing else is checked (a restart would not help)."""
    return Answer(200, b"ok", _base_headers(region, request_id, TEXT))


def readiness(view: RegionView | None, freshness: Freshness, *, region: str, request_id: str) -> Answer:
    """``/readyz``: ready once the caches completed their first full LIST and the feed is fresh.

    A degraded agent (a task restarting, usage metering without a spool) stays ready — it
    still answers DNS and health, and taking it out of the load balancer would only add an
    outage — but says so in the body and in ``X-Degraded``.
    """
    if view is not None and view.draining:
        reason = "draining"  # stopping: the load balancer should drop this agent before DNS goes
    elif freshness.stale:
        reason = CopyReason.STALE.value
    elif view is None or not view.synced:
        reason = CopyReason.CACHE_NOT_SYNCED.value
    elif view.degraded:
        headers = _base_headers(region, request_id, TEXT)
        headers["X-Degraded"] = "true"
        return Answer(200, b"ready, degraded: agent-degraded", headers)
    else:
        return Answer(200, b"ready", _base_headers(region, request_id, TEXT))
    return Answer(503, f"not ready: {reason}".encode(), _base_headers(region, request_id, TEXT), reason)


def metrics(body: bytes, content_type: str, *, region: str, request_id: str) -> Answer:
    return Answer(200, body, _base_headers(region, request_id, content_type))


def document(body: bytes, *, region: str, request_id: str) -> Answer:
    """A read-only JSON document, already serialized, of the operator listener (``/zone``)."""
    return Answer(200, body, _base_headers(region, request_id, JSON))


def unauthorized(*, region: str, request_id: str) -> Answer:
    headers = _base_headers(region, request_id, TEXT)
    headers["WWW-Authenticate"] = 'Bearer realm="region-agent operator"'
    return Answer(401, b"a bearer token is required", headers, "unauthorized")


_ERROR_BODIES = {400: b"bad request", 500: b"internal error", 504: b"timed out"}


def bad_request(status: int, *, region: str, request_id: str) -> Answer:
    """The answer to a request the HTTP parser refused (400) or a handler that failed (5xx)."""
    body = _ERROR_BODIES.get(status, b"error")
    headers = _base_headers(region, request_id, TEXT)
    headers["Connection"] = "close"
    return Answer(status, body, headers, "malformed" if status == 400 else "error")


def not_found(*, region: str, request_id: str) -> Answer:
    return Answer(404, b"no such path", _base_headers(region, request_id, TEXT))


def method_not_allowed(*, region: str, request_id: str) -> Answer:
    headers = _base_headers(region, request_id, TEXT)
    headers["Allow"] = "GET, HEAD"
    return Answer(405, b"only GET and HEAD", headers)


def server_error(*, region: str, request_id: str) -> Answer:
    return Answer(500, b"internal error", _base_headers(region, request_id, TEXT))


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 3)


def _json(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
