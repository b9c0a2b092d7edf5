"""Prometheus metrics of the health listener, cheap on the hot path.

A prometheus_client ``Counter.labels(...).inc()`` plus ``Histogram.observe()`` costs a few
microseconds per request (label lookup, locks); at 15,000 requests/s on one core that is a
tenth of the budget. So the listener counts into plain ints and lists (one event loop, no
locks needed), and these collectors turn them into metric families only when scraped.
View gauges (copies, sync, feed age) are also computed at scrape time from the source.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from region_agent.health.views import CopyCounts, Freshness, count_copies
from region_agent.state.local import RegionView

__all__ = ["KINDS", "LATENCY_BOUNDS", "ConnectionStats", "ListenerMetrics", "RequestStats", "ViewCollector"]

# Path kinds, the only values of the `kind` label (a bounded set: never the raw path).
KINDS = ("global-health", "region", "livez", "readyz", "metrics", "document", "malformed", "unauthorized", "other",
         "api")
# Handler latency is tens of microseconds; the upper buckets catch a stalled loop.
LATENCY_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
# Why the listener closed a connection itself (the `reason` label).
# reserve-*: accepted on the reserve descriptor under exhaustion, answered at once or shed (nothing sent yet)
CLOSE_REASONS = ("header-timeout", "idle-timeout", "cap", "reserve-answered", "reserve-shed")


class RequestStats:
    """One listener's requests by kind and status code, and a handler-latency histogram by kind."""

    __slots__ = ("_buckets", "_counts", "_sums")

    def __init__(self) -> None:
        self._counts: dict[tuple[str, int], int] = {}
        self._buckets: dict[str, list[int]] = {kind: [0] * (len(LATENCY_BOUNDS) + 1) for kind in KINDS}
        self._sums: dict[str, float] = dict.fromkeys(KINDS, 0.0)

    def observe(self, kind: str, status: int, seconds: float) -> None:
        """Hot path: ``kind`` must be one of :data:`KINDS`."""
        key = (kind, status)
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        self._buckets[kind][bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self._sums[kind] += seconds

    def count(self, kind: str, status: int) -> int:
        return self._counts.get((kind, status), 0)


class ConnectionStats:
    """One listener's connections: open now, closed by the listener (by reason), accept errors."""

    __slots__ = ("accept_errors", "accept_paused", "closed", "open")

    def __init__(self) -> None:
        self.open = 0
        self.closed: dict[str, int] = dict.fromkeys(CLOSE_REASONS, 0)
        self.accept_errors: dict[str, int] = {}  # errno name -> failed accepts
        self.accept_paused = False


class ListenerMetrics(Collector):
    """The metrics of every listener of one process, exported with a ``listener`` label.

    Build one per registry and hand it to each :class:`~region_agent.health.listener.HealthListener`;
    the counting objects are plain (one event loop, no locks) and become metric families
    only when scraped.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._listeners: dict[str, tuple[RequestStats, ConnectionStats]] = {}
        self.logs_suppressed = Counter(
            "region_agent_health_request_logs_suppressed",
            "Request log lines dropped by the request_log_per_second limit (the requests were answered).",
            registry=registry,
        )
        registry.register(self)

    def add(self, listener: str) -> tuple[RequestStats, ConnectionStats]:
        if listener in self._listeners:
            raise ValueError(f"a listener named {listener!r} is already counted here")
        stats = self._listeners[listener] = (RequestStats(), ConnectionStats())
        return stats

    def describe(self) -> Iterable[Metric]:
        yield CounterMetricFamily("region_agent_health_requests", "", labels=["listener", "kind", "code"])
        yield HistogramMetricFamily("region_agent_health_request_duration_seconds", "", labels=["listener", "kind"])
        yield GaugeMetricFamily("region_agent_health_connections", "", labels=["listener"])
        yield CounterMetricFamily("region_agent_health_connections_closed", "", labels=["listener", "reason"])
        yield CounterMetricFamily("region_agent_health_accept_errors", "", labels=["listener", "error"])
        yield GaugeMetricFamily("region_agent_health_accept_paused", "", labels=["listener"])

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "region_agent_health_requests",
            "Requests answered by the health listeners, by listener, path kind and HTTP status code.",
            labels=["listener", "kind", "code"],
        )
        latency = HistogramMetricFamily(
            "region_agent_health_request_duration_seconds",
            "Time spent in a health listener's handler (after HTTP parsing), by listener and path kind.",
            labels=["listener", "kind"],
        )
        connections = GaugeMetricFamily(
            "region_agent_health_connections", "Open connections of a health listener.", labels=["listener"]
        )
        closed = CounterMetricFamily(
            "region_agent_health_connections_closed",
            "Connections a health listener closed itself: header-timeout (request not received in "
            "time), idle-timeout, cap (the quietest connection, to admit a new one over max_connections).",
            labels=["listener", "reason"],
        )
        accept_errors = CounterMetricFamily(
            "region_agent_health_accept_errors",
            "Failed accepts (EMFILE: out of descriptors, ...); the listener backs off and retries.",
            labels=["listener", "error"],
        )
        paused = GaugeMetricFamily(
            "region_agent_health_accept_paused",
            "1 while a health listener backs off from accepting after an accept error.",
            labels=["listener"],
        )
        for name, (stats, conns) in self._listeners.items():
            for (kind, status), n in sorted(stats._counts.items()):
                requests.add_metric([name, kind, str(status)], n)
            for kind in KINDS:
                if not any(stats._buckets[kind]):
                    continue  # a kind this listener never answered (the public one serves no /metrics)
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for bound, n in zip((*map(repr, LATENCY_BOUNDS), "+Inf"), stats._buckets[kind], strict=True):
                    cumulative += n
                    buckets.append((bound, cumulative))
                latency.add_metric([name, kind], buckets, stats._sums[kind])
            connections.add_metric([name], conns.open)
            for reason, n in conns.closed.items():
                closed.add_metric([name, reason], n)
            for error, n in sorted(conns.accept_errors.items()):
                accept_errors.add_metric([name, error], n)
            paused.add_metric([name], 1.0 if conns.accept_paused else 0.0)
        yield from (requests, latency, connections, closed, accept_errors, paused)


class ViewCollector(Collector):
    """Gauges about the held view, read from the source at scrape time.

    Registered once per process by whoever owns the source (the agent's ``HealthService``,
    the sidecar), not per listener.
    """

    def __init__(self, current: Callable[[], tuple[RegionView | None, Freshness]]) -> None:
        self._current = current
        self._counted: tuple[RegionView | None, CopyCounts] = (None, count_copies(None))

    def _snapshot(self) -> tuple[RegionView | None, Freshness, CopyCounts]:
        view, freshness = self._current()
        counted, counts = self._counted
        if counted is not view:  # views are immutable: count once per view
            counts = count_copies(view)
            self._counted = (view, counts)
        return view, freshness, counts

    def describe(self) -> Iterable[Metric]:
        for name in (
            "copies", "cache_synced", "view_generated_timestamp_seconds", "feed_stale", "feed_age_seconds"
        ):
            yield GaugeMetricFamily(f"region_agent_health_{name}", "")

    def collect(self) -> Iterable[Metric]:
        view, freshness, counts = self._snapshot()
        copies = GaugeMetricFamily(
            "region_agent_health_copies", "Copies in the held view, healthy or not.", labels=["state"]
        )
        copies.add_metric(["healthy"], counts.healthy)
        copies.add_metric(["unhealthy"], counts.unhealthy)
        yield copies
        yield GaugeMetricFamily(
            "region_agent_health_cache_synced",
            "1 once the held view says every watch cache completed its first full LIST.",
            value=1.0 if view is not None and view.synced else 0.0,
        )
        if view is not None:
            yield GaugeMetricFamily(
                "region_agent_health_view_generated_timestamp_seconds",
                "Wall time at which the agent built the held view.",
                value=view.generated_at,
            )
        if freshness.sidecar:
            yield GaugeMetricFamily(
                "region_agent_health_feed_stale",
                "1 while the feed is older than the bound and every project answers 503 stale.",
                value=1.0 if freshness.stale else 0.0,
            )
            if freshness.age_seconds is not None:
                yield GaugeMetricFamily(
                    "region_agent_health_feed_age_seconds",
                    "Seconds since the agent last vouched for the held view.",
                    value=freshness.age_seconds,
                )
