"""Prometheus metrics of the Kubernetes side, one set per registry.

Several informers (Services, Clusters, Pods) share one registry; the metric objects are created
once per registry and every informer writes its own ``resource`` label (the informer's name).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class InformerMetrics:
    objects: Gauge
    events: Counter
    relists: Counter
    watch_errors: Counter
    malformed: Counter
    handler_errors: Counter
    last_event: Gauge
    last_success: Gauge
    synced: Gauge
    list_seconds: Histogram

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> InformerMetrics:
        metrics = _informer_metrics.get(registry)
        if metrics is None:
            metrics = cls._create(registry)
            _informer_metrics[registry] = metrics
        return metrics

    @classmethod
    def _create(cls, registry: CollectorRegistry) -> InformerMetrics:
        label = ["resource"]
        return cls(
            objects=Gauge("region_agent_kube_objects", "Objects held in the watch cache.", label, registry=registry),
            events=Counter(
                "region_agent_kube_events_total",
                "Watch events received, by type (ADDED, MODIFIED, DELETED, BOOKMARK, ERROR), and "
                "deletions inferred by relists (SYNTHETIC_DELETED).",
                [*label, "type"],
                registry=registry,
            ),
            relists=Counter(
                "region_agent_kube_relists_total",
                "Full LISTs, by reason (initial, expired, list-expired, continue-expired, error).",
                [*label, "reason"],
                registry=registry,
            ),
            watch_errors=Counter(
                "region_agent_kube_watch_errors_total",
                "Failed list or watch attempts, by reason.",
                [*label, "reason"],
                registry=registry,
            ),
            malformed=Counter(
                "region_agent_kube_malformed_objects_total",
                "Objects or events skipped because they could not be understood.",
                label,
                registry=registry,
            ),
            handler_errors=Counter(
                "region_agent_kube_handler_errors_total",
                "Exceptions raised by event handlers (logged and ignored).",
                label,
                registry=registry,
            ),
            last_event=Gauge(
                "region_agent_kube_last_event_timestamp_seconds",
                "Wall time of the last watch event or bookmark; event age = time() - this.",
                label,
                registry=registry,
            ),
            last_success=Gauge(
                "region_agent_kube_last_success_timestamp_seconds",
                "Wall time the informer last completed a LIST or received data from a watch.",
                label,
                registry=registry,
            ),
            synced=Gauge(
                "region_agent_kube_synced",
                "1 once the first full LIST has been loaded into the cache.",
                label,
                registry=registry,
            ),
            list_seconds=Histogram(
                "region_agent_kube_list_duration_seconds",
                "Duration of full LISTs, all pages.",
                label,
                registry=registry,
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            ),
        )


@dataclass(frozen=True)
class CnpgMetrics:
    polls: Counter
    last_success: Gauge
    streaming: Gauge
    lag_seconds: Gauge

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> CnpgMetrics:
        metrics = _cnpg_metrics.get(registry)
        if metrics is None:
            labels = ["namespace", "cluster"]
            metrics = cls(
                polls=Counter(
                    "region_agent_kube_cnpg_polls_total",
                    "Polls of CloudNativePG instance status, by result (ok, error).",
                    [*labels, "result"],
                    registry=registry,
                ),
                last_success=Gauge(
                    "region_agent_kube_cnpg_last_success_timestamp_seconds",
                    "Wall time of the last successful status poll of a binding.",
                    labels,
                    registry=registry,
                ),
                streaming=Gauge(
                    "region_agent_kube_cnpg_streaming",
                    "1 while the binding's data condition holds (primary, or replica streaming).",
                    labels,
                    registry=registry,
                ),
                lag_seconds=Gauge(
                    "region_agent_kube_cnpg_replay_lag_seconds",
                    "Replay lag of the binding's replica in seconds (NaN when unknown).",
                    labels,
                    registry=registry,
                ),
            )
            _cnpg_metrics[registry] = metrics
        return metrics


_informer_metrics: weakref.WeakKeyDictionary[CollectorRegistry, InformerMetrics] = weakref.WeakKeyDictionary()
_cnpg_metrics: weakref.WeakKeyDictionary[CollectorRegistry, CnpgMetrics] = weakref.WeakKeyDictionary()
