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

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.state.local import RegionView
from health.views import CopyCounts, Freshness

__all__ = ["KINDS", "LATENCY_BOUNDS", "RequestStats", "ViewCollector"]

# Path kinds, the only values of the `kind` label (a bounded set: never the raw path).
KINDS = ("global-health", "region", "livez", "readyz", "metrics", "document", "other")
# Handler latency is tens of microseconds; the upper buckets catch a stalled loop.
LATENCY_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)


class RequestStats(Collector):
    """Requests by kind and status code, and a handler-latency histogram by kind."""

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

    def describe(self) -> Iterable[Metric]:
        yield CounterMetricFamily("region_agent_health_requests", "", labels=["kind", "code"])
        yield HistogramMetricFamily("region_agent_health_request_duration_seconds", "", labels=["kind"])

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "region_agent_health_requests",
            "Requests answered by the health listener, by path kind and HTTP status code.",
            labels=["kind", "code"],
        )
        for (kind, status), n in sorted(self._counts.items()):
            requests.add_metric([kind, str(status)], n)
        yield requests
        latency = HistogramMetricFamily(
            "region_agent_health_request_duration_seconds",
            "Time spent in the health listener's handler (after HTTP parsing), by path kind.",
            labels=["kind"],
        )
        for kind in KINDS:
            counts = self._buckets[kind]
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, n in zip((*map(repr, LATENCY_BOUNDS), "+Inf"), counts, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            latency.add_metric([kind], buckets, self._sums[kind])
        yield latency


class ViewCollector(Collector):
    """Gauges about the held view, read from the listener at scrape time."""

    def __init__(self, snapshot: Callable[[], tuple[RegionView | None, Freshness, CopyCounts]]) -> None:
        self._snapshot = snapshot

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
